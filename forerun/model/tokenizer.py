"""The model's tokenizer: its tokenizer.json, or the vocabulary inside its GGUF file."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from forerun.model.cache import GGUFCacheEntry
from forerun.model.errors import ModelLoadError
from forerun.model.gguf_file import gguf_chat_template, open_gguf
from forerun.model.harmony_template import with_default_chat_template
from forerun.model.source import ModelSource

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

logger = logging.getLogger(__name__)


def load_tokenizer(source: ModelSource,
                   architecture: str | None = None) -> PreTrainedTokenizerBase:
    """The model's tokenizer (from tokenizer.json, or converted from the GGUF vocabulary).

    ``architecture``: the model's; one whose chat format forerun builds in (gpt-oss's
    harmony) gets that template when the files carry none.
    """
    entry = GGUFCacheEntry.for_source(source)
    if entry is not None:
        tok = entry.load_tokenizer()
        if tok is not None:
            return with_default_chat_template(tok, architecture)
    from transformers import AutoTokenizer  # ~1 s to import: only where a tokenizer loads

    try:
        if source.is_gguf:
            tok = _gguf_tokenizer(source)
        else:
            tok = AutoTokenizer.from_pretrained(source.path)
    except ModelLoadError:
        raise
    except Exception as exc:
        raise ModelLoadError(f"could not load the tokenizer of {source.name}: {exc}") from exc
    if source.is_gguf and not getattr(tok, "chat_template", None):
        template = gguf_chat_template(open_gguf(source.gguf_path))
        if template:
            tok.chat_template = template
    if entry is not None:
        entry.save_tokenizer(tok)  # as the files have it: the default is not cached
    return with_default_chat_template(tok, architecture)


def _gguf_tokenizer(source: ModelSource) -> PreTrainedTokenizerBase:
    """The tokenizer of a GGUF file: AutoTokenizer's (which reads the file's model config to
    pick a tokenizer class), else the generic fast tokenizer built from the file's
    ``tokenizer.ggml.*`` fields alone. transformers' config reader fails on some files whose
    vocabulary is fine: every gpt-oss GGUF, on its ``rope.scaling.*`` numbers."""
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    try:
        return AutoTokenizer.from_pretrained(source.path, gguf_file=source.gguf_file)
    except (TypeError, ValueError, KeyError) as exc:
        logger.info("transformers could not read the model config of %s (%s); building its "
                    "tokenizer from the file's vocabulary alone", source.name, exc)
        return PreTrainedTokenizerFast.from_pretrained(source.path, gguf_file=source.gguf_file)
