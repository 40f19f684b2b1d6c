"""The xgrammar backend: spec validation, compilation off the scheduler thread, matchers.

xgrammar is imported where a grammar is first needed, not with this module: it takes
about half a second, and most engine, API and rank processes never build a grammar.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

import torch

from forerun.structured.closing import ClosingPlanner
from forerun.structured.closing_text import TextClosingPlanner
from forerun.structured_params import StructuredOutputsParams

if TYPE_CHECKING:
    import xgrammar as xgr

logger = logging.getLogger(__name__)

# xgrammar's C++ errors start with "[12:34:56] /path/file.cc:123: " and sometimes an
# internal "Check failed: (...) is false: "; neither helps the user.
_CPP_PREFIX = re.compile(r"^\[[\d:]+\]\s+\S+:\d+:\s*")
_CHECK_FAILED = re.compile(r"Check failed: \(.*?\) is false:\s*")

# An object, as OpenAI's ``json_object`` promises, rather than any JSON value.
_JSON_OBJECT_SCHEMA = '{"type": "object"}'


def _clean_error(exc: BaseException) -> str:
    msg = str(exc).strip()
    msg = _CPP_PREFIX.sub("", msg)
    msg = _CHECK_FAILED.sub("", msg)
    return msg.splitlines()[0] if msg else type(exc).__name__


def _ebnf_string(text: str) -> str:
    """``text`` as an EBNF string literal: quotes, backslashes and controls escaped."""
    out = []
    for ch in text:
        if ch in '"\\':
            out.append("\\" + ch)
        elif ch == "\n":
            out.append("\\n")
        elif ch == "\t":
            out.append("\\t")
        elif ch == "\r":
            out.append("\\r")
        elif ord(ch) < 0x20:
            out.append(f"\\x{ord(ch):02x}")
        else:
            out.append(ch)
    return '"' + "".join(out) + '"'


def choice_to_ebnf(choices: list[str]) -> str:
    """One alternative per choice: the output is exactly one of the strings."""
    return "root ::= " + " | ".join(_ebnf_string(c) for c in choices)


def json_whitespace_options(params: StructuredOutputsParams) -> dict[str, Any]:
    """xgrammar's whitespace options for a ``json`` or ``json_object`` constraint.

    Compact unless the request asked for any whitespace (``disable_any_whitespace=False``):
    one line, with the single space after ``,`` and ``:`` that most training text has,
    so the model is not pushed off its usual tokens.
    """
    return {"any_whitespace": params.any_whitespace}


def _schema_dict(params: StructuredOutputsParams) -> dict[str, Any]:
    raw = params.json
    if isinstance(raw, str):
        try:
            raw = json.loads(raw)
        except json.JSONDecodeError as e:
            raise ValueError(f"structured_outputs.json: the schema is not valid JSON: {e}") from None
    if not isinstance(raw, dict):
        raise ValueError("structured_outputs.json: the schema must be a JSON object")
    return raw


def validate_structured_outputs(params: StructuredOutputsParams) -> None:
    """Raise ``ValueError`` naming the field and the problem if the spec cannot compile.

    Builds xgrammar's tokenizer-free ``Grammar`` (a parse: milliseconds), so the frontend
    rejects a bad spec before the request is queued; the costly, tokenizer-dependent
    compilation happens later on the backend's thread.
    """
    if params.reasoning_parser is not None:
        from forerun.reasoning import ReasoningParserManager

        try:
            ReasoningParserManager.get_reasoning_parser(params.reasoning_parser)
        except KeyError as e:
            raise ValueError(f"structured_outputs.reasoning_parser: {e.args[0]}") from None
    kind = params.kind
    import xgrammar as xgr

    try:
        if kind == "json":
            schema = _schema_dict(params)
            import jsonschema

            try:
                jsonschema.validators.validator_for(schema).check_schema(schema)
            except jsonschema.SchemaError as e:
                raise ValueError(
                    f"structured_outputs.json: invalid JSON schema: {e.message}") from None
            xgr.Grammar.from_json_schema(json.dumps(schema), **json_whitespace_options(params))
        elif kind == "regex":
            xgr.Grammar.from_regex(params.regex)
        elif kind == "choice":
            xgr.Grammar.from_ebnf(choice_to_ebnf(params.choice or []))
        elif kind == "grammar":
            xgr.Grammar.from_ebnf(params.grammar or "")
    except ValueError:
        raise
    except Exception as e:  # xgrammar raises RuntimeError with its parser's message
        what = {"json": "JSON schema", "regex": "regex", "choice": "choice",
                "grammar": "EBNF grammar"}[kind]
        raise ValueError(
            f"structured_outputs.{kind}: invalid {what}: {_clean_error(e)}") from None


class StructuredGrammar:
    """One request's grammar state: an xgrammar matcher that has seen every delivered token."""

    __slots__ = ("matcher", "num_accepted")

    def __init__(self, compiled: xgr.CompiledGrammar) -> None:
        import xgrammar as xgr

        self.matcher = xgr.GrammarMatcher(compiled)
        self.num_accepted = 0

    def accept_token(self, token_id: int) -> bool:
        try:
            ok = self.matcher.accept_token(token_id)
        except Exception:  # an id outside the vocabulary is a rejection, not a crash
            ok = False
        if ok:
            self.num_accepted += 1
        return ok

    def is_terminated(self) -> bool:
        return self.matcher.is_terminated()

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        self.matcher.fill_next_token_bitmask(bitmask, row)


class XgrammarBackend:
    """Compiles specs into xgrammar grammars on a small thread pool, with xgrammar's cache.

    The tokenizer info (a pass over the whole vocabulary) is built on the pool too, on the
    first compilation, so an engine that never sees a grammar never pays for it.
    """

    def __init__(self, tokenizer_factory: Callable[[], Any], vocab_size: int,
                 stop_token_ids: list[int], max_workers: int = 1) -> None:
        self._tokenizer_factory = tokenizer_factory
        self.vocab_size = vocab_size
        self._stop_token_ids = list(stop_token_ids)
        self._compiler: xgr.GrammarCompiler | None = None
        self._tokenizer_info: xgr.TokenizerInfo | None = None
        self._token_bytes: list[bytes] | None = None
        self._closing_planner: ClosingPlanner | None = None
        self._text_closing_planner: TextClosingPlanner | None = None
        self._pool = ThreadPoolExecutor(max_workers=max_workers,
                                        thread_name_prefix="forerun-grammar")

    def _get_compiler(self) -> xgr.GrammarCompiler:
        if self._compiler is None:
            import xgrammar as xgr

            info = xgr.TokenizerInfo.from_huggingface(
                self._tokenizer_factory(), vocab_size=self.vocab_size,
                stop_token_ids=self._stop_token_ids or None)
            self._tokenizer_info = info
            self._compiler = xgr.GrammarCompiler(info, max_threads=2, cache_enabled=True)
        return self._compiler

    def token_bytes(self) -> list[bytes]:
        """Each token id's text as bytes, as xgrammar decodes the vocabulary (special tokens
        as their own text); built on first use, after a compilation."""
        if self._token_bytes is None:
            self._get_compiler()
            assert self._tokenizer_info is not None
            self._token_bytes = list(self._tokenizer_info.decoded_vocab)
        return self._token_bytes

    def closing_planner(self) -> ClosingPlanner:
        """The budget-aware ending's planner (built on first use, after a compilation)."""
        if self._closing_planner is None:
            token_bytes = self.token_bytes()
            tokenizer = self._tokenizer_factory()
            special = set(getattr(tokenizer, "all_special_ids", []) or [])
            special.update(self._stop_token_ids)
            self._closing_planner = ClosingPlanner(tokenizer, token_bytes, self.vocab_size,
                                                   special)
        return self._closing_planner

    def text_closing_planner(self) -> TextClosingPlanner:
        """The choice and regex ending's planner (shares the JSON planner's vocabulary)."""
        if self._text_closing_planner is None:
            json_planner = self.closing_planner()
            self._text_closing_planner = TextClosingPlanner(
                json_planner.token_bytes, json_planner.id_of, set(self._stop_token_ids))
        return self._text_closing_planner

    def compile_async(self, params: StructuredOutputsParams) -> Future[xgr.CompiledGrammar]:
        return self._pool.submit(self._compile, params)

    def new_grammar(self, compiled: xgr.CompiledGrammar) -> StructuredGrammar:
        return StructuredGrammar(compiled)

    def _compile(self, params: StructuredOutputsParams) -> xgr.CompiledGrammar:
        try:
            return self._compile_unchecked(params)
        except Exception as e:
            raise RuntimeError(_clean_error(e)) from None

    def _compile_unchecked(self, params: StructuredOutputsParams) -> xgr.CompiledGrammar:
        compiler = self._get_compiler()
        kind = params.kind
        if kind in ("json", "json_object"):
            schema = (json.dumps(_schema_dict(params)) if kind == "json"
                      else _JSON_OBJECT_SCHEMA)
            # xgrammar's compile cache keys on these options too, so a schema compiled both
            # ways is two cache entries, never one served for the other.
            return compiler.compile_json_schema(schema, **json_whitespace_options(params))
        if kind == "regex":
            return compiler.compile_regex(params.regex or "")
        if kind == "choice":
            return compiler.compile_grammar(choice_to_ebnf(params.choice or []))
        return compiler.compile_grammar(params.grammar or "")

    def allocate_bitmask(self, num_rows: int) -> torch.Tensor:
        import xgrammar as xgr

        return xgr.allocate_token_bitmask(num_rows, self.vocab_size)

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
