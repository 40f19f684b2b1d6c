"""vLLM's extras on chat responses: prompt logprobs and token ids (kept out of chat.py)."""

from __future__ import annotations

import msgspec

from forerun.outputs import RequestOutput
from forerun.server.bodies import UNSET, ChatCompletion
from forerun.server.logprobs import prompt_logprobs_json
from forerun.server.protocol import ChatCompletionRequest


def add_prompt_extras(resp: ChatCompletion, body: ChatCompletionRequest,
                      out: RequestOutput) -> None:
    """``prompt_logprobs`` and ``prompt_token_ids`` on the response, where vLLM puts them."""
    if body.prompt_logprobs is not None and out.prompt_logprobs is not None:
        resp.prompt_logprobs = prompt_logprobs_json(
            out.prompt_token_ids, out.prompt_logprobs, body.prompt_logprobs,
            body.tokens_as_ids)
    if body.return_token_ids:
        resp.prompt_token_ids = list(out.prompt_token_ids)


class StreamTokenIds:
    """``return_token_ids`` in a chat stream: each chunk's new ids, and the prompt's once.

    vLLM sends ``prompt_token_ids`` in one chunk only; here it is the first chunk that
    carries generated tokens (the role chunks go out before the engine has answered).
    """

    def __init__(self, enabled: bool | None, n: int) -> None:
        self.enabled = bool(enabled)
        self.sent = [0] * n
        self.prompt_sent = False

    def token_ids(self, index: int, out: RequestOutput | None
                  ) -> tuple[list[int] | msgspec.UnsetType, list[int] | msgspec.UnsetType]:
        """(this chunk's token ids for choice ``index``, the prompt's ids or UNSET)."""
        if not self.enabled:
            return UNSET, UNSET
        if out is None:
            return [], UNSET
        ids: list[int] = []
        for c in out.outputs:
            if c.index == index:
                ids = list(c.token_ids[self.sent[index]:])
                self.sent[index] = len(c.token_ids)
        prompt: list[int] | msgspec.UnsetType = UNSET
        if not self.prompt_sent:
            prompt, self.prompt_sent = list(out.prompt_token_ids), True
        return ids, prompt
