"""Request-body spellings of structured output -> StructuredOutputsParams.

Accepted: OpenAI's ``response_format`` (``json_schema``, ``json_object``, ``text``),
vLLM's ``structured_outputs`` object, and vLLM's older ``guided_json`` / ``guided_regex`` /
``guided_choice`` / ``guided_grammar``. At most one may ask for a constraint. A
``structured_outputs`` object that holds only options (``disable_any_whitespace``,
``enable_in_reasoning``, ...) applies them to the constraint another field asks for, as in
vLLM. ``reasoning_parser`` is the server's to set (from ``--reasoning-parser``).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from forerun.structured_params import KINDS, OPTIONS, StructuredOutputsParams

_GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
           "guided_grammar": "grammar"}


def _from_response_format(rf: Any) -> StructuredOutputsParams | None:
    if not isinstance(rf, dict):
        raise ValueError("response_format: must be an object")
    kind = rf.get("type")
    if kind in (None, "text"):
        return None
    if kind == "json_object":
        return StructuredOutputsParams(json_object=True)
    if kind == "json_schema":
        spec = rf.get("json_schema")
        if not isinstance(spec, dict):
            raise ValueError("response_format.json_schema: must be an object with a 'schema'")
        schema = spec.get("schema", spec.get("json_schema"))
        if not isinstance(schema, dict):
            raise ValueError("response_format.json_schema.schema: must be a JSON schema object")
        return StructuredOutputsParams(json=schema)
    raise ValueError(
        f"response_format.type: must be 'text', 'json_object' or 'json_schema', got {kind!r}")


def structured_outputs_of(fields: dict[str, Any]) -> StructuredOutputsParams | None:
    """The one constraint the body asks for, or None; ValueError names the bad field."""
    found: list[tuple[str, StructuredOutputsParams]] = []
    so = fields.get("structured_outputs")
    if isinstance(so, dict) and "reasoning_parser" in so:
        raise ValueError("structured_outputs.reasoning_parser: not a request field; the "
                         "server's --reasoning-parser sets it (send enable_in_reasoning: "
                         "true to constrain the reasoning too)")
    options: dict[str, Any] = {}
    if isinstance(so, dict) and so and not any(k in so for k in KINDS) and all(
            k in OPTIONS for k in so) and _asks_elsewhere(fields):
        # Options only, for the constraint response_format or a guided_* field asks for.
        options = so
    elif so is not None:
        found.append(("structured_outputs", StructuredOutputsParams.from_any(so)))
    for name, kind in _GUIDED.items():
        if fields.get(name) is not None:
            try:
                found.append((name, StructuredOutputsParams(**{kind: fields[name]})))
            except ValueError as e:
                raise ValueError(f"{name}: {str(e).split(': ', 1)[-1]}") from None
    if fields.get("response_format") is not None:
        so = _from_response_format(fields["response_format"])
        if so is not None:
            found.append(("response_format", so))
    if len(found) > 1:
        names = ", ".join(n for n, _ in found)
        raise ValueError(f"structured_outputs: give only one structured output field, got {names}")
    if not found:
        return None
    return dataclasses.replace(found[0][1], **options) if options else found[0][1]


def _asks_elsewhere(fields: dict[str, Any]) -> bool:
    rf = fields.get("response_format")
    return any(fields.get(n) is not None for n in _GUIDED) or (
        isinstance(rf, dict) and rf.get("type") not in (None, "text"))
