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
    k = body.engine_prompt_logprobs()  # asked for, or an echo's (vLLM shows both)
    if k is not None and out.prompt_logprobs is not None:
        resp.prompt_logprobs = prompt_logprobs_json(out.prompt_token_ids,
                                                    out.prompt_logprobs, k)
    if body.return_token_ids:
        resp.prompt_token_ids = list(out.prompt_token_ids)


class StreamTokenIds:
    """``return_token_ids`` in a chat stream: each chunk's new ids, and the prompt's on
    the role chunks (the first chunk of each choice, as vLLM sends them)."""

    def __init__(self, enabled: bool | None, n: int) -> None:
        self.enabled = bool(enabled)
        self.sent = [0] * n

    def prompt_ids(self, prompt_token_ids: list[int]) -> list[int] | msgspec.UnsetType:
        return list(prompt_token_ids) if self.enabled else UNSET

    def token_ids(self, index: int, out: RequestOutput | None
                  ) -> list[int] | msgspec.UnsetType:
        """This chunk's new token ids for choice ``index`` (UNSET unless asked for)."""
        if not self.enabled or out is None:
            return UNSET
        ids: list[int] = []
        for c in out.outputs:
            if c.index == index:
                ids = list(c.token_ids[self.sent[index]:])
                self.sent[index] = len(c.token_ids)
        return ids
