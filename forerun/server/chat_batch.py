"""``POST /v1/chat/completions/batch``: vLLM's batched chat, several conversations at once.

The body is a chat completion whose ``messages`` is a list of conversations. Each runs as
its own request with the shared settings (structured output applies to each); the answer
is one ``chat.completion`` with one choice per conversation, ``index`` its position, and
the usage of them all. As in vLLM: no streaming, no tools, no beam search, ``n`` is 1.
"""

from __future__ import annotations

import logging
from typing import Any

from fastapi import Request
from fastapi.responses import Response
from pydantic import model_validator

from forerun.engine.core_client import EngineDeadError
from forerun.server.bodies import ChatChoice, ChatCompletion, Usage, encode
from forerun.server.chat import chat_prompt_ids
from forerun.server.chat_template_args import echo_text, response_role
from forerun.server.edge import unless_disconnected
from forerun.server.errors import APIError, engine_dead_error
from forerun.server.logprobs import chat_logprobs
from forerun.server.protocol import ChatCompletionRequest
from forerun.server.reasoning import plan_reasoning
from forerun.server.serving import (
    ServingContext,
    check_model,
    final_outputs,
    now_s,
    request_ids,
    start_requests,
)
from forerun.server.tool_calls import plan_tools, tool_message

logger = logging.getLogger(__name__)


class BatchChatCompletionRequest(ChatCompletionRequest):
    """A chat completion body whose ``messages`` is a list of conversations."""

    @model_validator(mode="after")
    def _check_batch(self) -> BatchChatCompletionRequest:
        convs = self.messages
        if not isinstance(convs, list) or not convs or not all(
                isinstance(c, list) and c for c in convs):
            raise ValueError("messages: must be a non-empty list of conversations, each a "
                             "non-empty list of messages")
        for name, off in (("stream", False), ("use_beam_search", False), ("n", 1)):
            if getattr(self, name) != off:
                raise ValueError(f"{name}: batched chat completions need {name} = "
                                 f"{str(off).lower()}")
        if self.tools:
            raise ValueError("tools: batched chat completions do not take tools")
        return self

    def conversation(self, i: int) -> ChatCompletionRequest:
        """The single chat request of conversation ``i`` (every other field shared)."""
        fields: dict[str, Any] = self.model_dump(exclude_unset=True, exclude={"messages"})
        return ChatCompletionRequest.model_validate({**fields, "messages": self.messages[i]})


def _in_conversation(err: APIError, i: int) -> APIError:
    """A chat-template error of conversation ``i``, naming ``messages[i]``."""
    if err.param is not None and err.param.startswith("messages"):
        where = f"messages[{i}]"
        err.param = where + err.param[len("messages"):]
        if err.message.startswith("messages"):
            err.message = where + err.message[len("messages"):]
    return err


async def create_batch_chat_completion(ctx: ServingContext, body: BatchChatCompletionRequest,
                                       request: Request, body_bytes: int = 0) -> Response:
    check_model(ctx, body.model)
    convs = [body.conversation(i) for i in range(len(body.messages))]
    prompts = []
    plans = [plan_tools(ctx.tool_config, conv) for conv in convs]  # no tools: plain text
    for i, (conv, plan) in enumerate(zip(convs, plans, strict=True)):
        try:
            prompts.append({"prompt_token_ids": chat_prompt_ids(ctx, conv, plan)})
        except APIError as err:
            raise _in_conversation(err, i) from None
    rplans = [plan_reasoning(ctx.reasoning_parser, conv, ctx.engine.tokenizer,
                             ctx.structured_enable_in_reasoning) for conv in convs]
    convs = [conv if rp is None else rp.adjust_request(conv)
             for conv, rp in zip(convs, rplans, strict=True)]
    rid, engine_id = request_ids(request, "chatcmpl")
    # One request per conversation, admitted or refused together.
    streams = await start_requests(ctx, convs[0], engine_id, prompts,
                                   body.requested_max_tokens, None, body_bytes)
    try:
        outs = await unless_disconnected(request, final_outputs(streams))
    except EngineDeadError as exc:
        raise engine_dead_error(exc) from None
    choices, n_prompt, n_gen = [], 0, 0
    for i, (conv, plan, rplan, out) in enumerate(zip(convs, plans, rplans, outs,
                                                     strict=True)):
        (c,) = out.outputs
        lps = None
        if conv.logprobs and c.logprobs is not None:
            lps = chat_logprobs(c.token_ids, c.logprobs, conv.top_logprobs or 0,
                                conv.tokens_as_ids)
        reasoning, text = (None, c.text) if rplan is None else rplan.split_whole(c.text)
        message, finish = tool_message(plan, response_role(conv), text, c.finish_reason)
        message.content = echo_text(conv) + (message.content or "")
        if rplan is not None:
            rplan.annotate(message, reasoning)
        choices.append(ChatChoice(i, message, lps, finish_reason=finish,
                                  stop_reason=c.stop_reason,
                                  token_ids=list(c.token_ids) if conv.return_token_ids
                                  else None))
        n_prompt += len(out.prompt_token_ids)
        n_gen += len(c.token_ids)
    resp = ChatCompletion(rid, now_s(), ctx.model_name, choices, Usage.of(n_prompt, n_gen))
    return Response(encode(resp), media_type="application/json")
