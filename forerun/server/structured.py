"""Request-body spellings of structured output -> StructuredOutputsParams.

Accepted: OpenAI's ``response_format`` (``json_schema``, ``json_object``, ``text``),
vLLM's ``structured_outputs`` object, and vLLM's older ``guided_json`` / ``guided_regex`` /
``guided_choice`` / ``guided_grammar``. At most one may ask for a constraint.
"""

from __future__ import annotations

from typing import Any

from forerun.structured.params import StructuredOutputsParams

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
    if fields.get("structured_outputs") is not None:
        found.append(("structured_outputs",
                      StructuredOutputsParams.from_any(fields["structured_outputs"])))
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
    return found[0][1] if found else None
