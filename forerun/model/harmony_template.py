"""gpt-oss's harmony chat template, built in for models that ship none of their own.

Every gpt-oss GGUF converted without its template, and a Hugging Face folder without
``chat_template.jinja``, would otherwise leave chat requests with no way to render; gpt-oss
does not work without the harmony format. The template renders:

- a system message (identity, knowledge cutoff, the date when known, the reasoning effort
  — ``reasoning_effort``, default medium — and the valid channels);
- a developer message with the conversation's system/developer instructions and the
  function tools as a TypeScript-like ``namespace functions``;
- user turns; assistant turns on the ``final`` channel, or their tool calls on
  ``commentary`` addressed ``to=functions.NAME`` and ending in ``<|call|>`` (after their
  reasoning on ``analysis``, which the model needs to resume, and any text beside the
  calls as a ``commentary`` preamble); tool results as messages from ``functions.NAME``
  (the call their ``tool_call_id`` names, else their ``name``, else the last call);
- ``<|start|>assistant`` to open the reply when ``add_generation_prompt`` is set.

Generation ends on ``<|return|>`` (the answer is done) or ``<|call|>`` (a tool call is);
``<|end|>`` only closes one message (the reasoning) inside the turn, so it is not a stop.
"""

from __future__ import annotations

from typing import Any

GPT_OSS_ARCHITECTURE = "GptOssForCausalLM"

# Jinja for transformers' apply_chat_template (its environment has tojson and, from 4.43,
# strftime_now). Whitespace control (-) keeps the output exactly the harmony text.
HARMONY_CHAT_TEMPLATE = r"""
{#- Every tag trims the whitespace around it and every newline is written as "\n":
    transformers renders with trim_blocks and lstrip_blocks, and harmony is exact text. -#}
{%- macro ts_type(p) -%}
  {%- if p.enum is defined -%}
    {%- for v in p.enum -%}{{ v | tojson }}{%- if not loop.last %}{{ " | " }}{% endif -%}{%- endfor -%}
  {%- elif p.type == "string" -%}{{ "string" }}
  {%- elif p.type == "number" or p.type == "integer" -%}{{ "number" }}
  {%- elif p.type == "boolean" -%}{{ "boolean" }}
  {%- elif p.type == "array" and p["items"] is defined -%}{{ ts_type(p["items"]) }}{{ "[]" }}
  {%- elif p.type == "array" -%}{{ "any[]" }}
  {%- elif p.type == "object" -%}{{ "object" }}
  {%- else -%}{{ "any" }}
  {%- endif -%}
{%- endmacro -%}
{%- macro render_tools(tools) -%}
  {{- "## functions\n\nnamespace functions {\n\n" -}}
  {%- for tool in tools -%}
    {%- set fn = tool.function if tool.function is defined else tool -%}
    {%- if fn.description -%}{{- "// " + fn.description + "\n" -}}{%- endif -%}
    {%- set params = fn.parameters if fn.parameters is defined and fn.parameters else {} -%}
    {%- if params.properties is defined and params.properties -%}
      {{- "type " + fn.name + " = (_: {\n" -}}
      {%- for name, prop in params.properties.items() -%}
        {%- if prop.description is defined and prop.description -%}
          {{- "// " + prop.description + "\n" -}}
        {%- endif -%}
        {{- name -}}
        {%- if not (params.required is defined and name in params.required) -%}{{ "?" }}{%- endif -%}
        {{- ": " + ts_type(prop) + ",\n" -}}
      {%- endfor -%}
      {{- "}) => any;\n\n" -}}
    {%- else -%}
      {{- "type " + fn.name + " = () => any;\n\n" -}}
    {%- endif -%}
  {%- endfor -%}
  {{- "} // namespace functions" -}}
{%- endmacro -%}
{%- set effort = reasoning_effort if reasoning_effort is defined and reasoning_effort else "medium" -%}
{%- if current_date is defined and current_date -%}
  {%- set today = current_date -%}
{%- elif strftime_now is defined -%}
  {%- set today = strftime_now("%Y-%m-%d") -%}
{%- else -%}
  {%- set today = "" -%}
{%- endif -%}
{{- "<|start|>system<|message|>You are ChatGPT, a large language model trained by OpenAI.\n" -}}
{{- "Knowledge cutoff: 2024-06\n" -}}
{%- if today -%}{{- "Current date: " + today + "\n" -}}{%- endif -%}
{{- "\nReasoning: " + effort + "\n\n" -}}
{{- "# Valid channels: analysis, commentary, final. Channel must be included for every message." -}}
{%- if tools -%}
  {{- "\nCalls to these tools must go to the commentary channel: 'functions'." -}}
{%- endif -%}
{{- "<|end|>" -}}
{%- set ns = namespace(instructions=[], last_call="", call_ids=[], call_names=[]) -%}
{%- for m in messages -%}
  {%- if m.role == "system" or m.role == "developer" -%}
    {%- set ns.instructions = ns.instructions + [m.content] -%}
  {%- endif -%}
{%- endfor -%}
{%- if ns.instructions or tools -%}
  {{- "<|start|>developer<|message|>" -}}
  {%- if ns.instructions -%}
    {{- "# Instructions\n\n" + ns.instructions | join("\n\n") -}}
    {%- if tools -%}{{- "\n\n" -}}{%- endif -%}
  {%- endif -%}
  {%- if tools -%}{{- "# Tools\n\n" + render_tools(tools) -}}{%- endif -%}
  {{- "<|end|>" -}}
{%- endif -%}
{%- for m in messages -%}
  {%- if m.role == "user" -%}
    {{- "<|start|>user<|message|>" + m.content + "<|end|>" -}}
  {%- elif m.role == "assistant" -%}
    {%- set thought = m.reasoning_content or m.reasoning or m.thinking -%}
    {%- if m.tool_calls -%}
      {#- The reasoning that led to a call stays: the model resumes from it. -#}
      {%- if thought -%}
        {{- "<|start|>assistant<|channel|>analysis<|message|>" + thought + "<|end|>" -}}
      {%- endif -%}
      {#- Text beside the calls is a preamble: commentary without a recipient. -#}
      {%- if m.content is string and m.content -%}
        {{- "<|start|>assistant<|channel|>commentary<|message|>" + m.content + "<|end|>" -}}
      {%- endif -%}
      {%- for call in m.tool_calls -%}
        {%- set fn = call.function if call.function is defined else call -%}
        {%- set ns.last_call = fn.name -%}
        {%- set ns.call_ids = ns.call_ids + [call.id if call.id is defined else none] -%}
        {%- set ns.call_names = ns.call_names + [fn.name] -%}
        {{- "<|start|>assistant<|channel|>commentary to=functions." + fn.name -}}
        {{- " <|constrain|>json<|message|>" -}}
        {%- if fn.arguments is string -%}{{- fn.arguments -}}
        {%- else -%}{{- fn.arguments | tojson -}}{%- endif -%}
        {{- "<|call|>" -}}
      {%- endfor -%}
    {%- elif loop.last and not add_generation_prompt -%}
      {#- The reply being continued: left open for the model to go on. -#}
      {{- "<|start|>assistant<|channel|>final<|message|>" + m.content -}}
    {%- else -%}
      {{- "<|start|>assistant<|channel|>final<|message|>" + m.content + "<|end|>" -}}
    {%- endif -%}
  {%- elif m.role == "tool" -%}
    {#- The function answering: the call its tool_call_id names, else its name, else the
        last call. -#}
    {%- set found = namespace(name="") -%}
    {%- if m.tool_call_id is defined and m.tool_call_id -%}
      {%- for cid in ns.call_ids -%}
        {%- if cid == m.tool_call_id -%}{%- set found.name = ns.call_names[loop.index0] -%}{%- endif -%}
      {%- endfor -%}
    {%- endif -%}
    {%- set name = found.name or (m.name if m.name is defined and m.name else ns.last_call) -%}
    {{- "<|start|>functions." + name + " to=assistant<|channel|>commentary<|message|>" -}}
    {{- m.content + "<|end|>" -}}
  {%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}{{- "<|start|>assistant" -}}{%- endif -%}
""".strip()


def default_chat_template(architecture: str | None) -> str | None:
    """The template forerun supplies for ``architecture`` when the model has none."""
    return HARMONY_CHAT_TEMPLATE if architecture == GPT_OSS_ARCHITECTURE else None


def with_default_chat_template(tokenizer: Any, architecture: str | None) -> Any:
    """``tokenizer``, given the built-in template of its architecture if it has none."""
    if not getattr(tokenizer, "chat_template", None):
        template = default_chat_template(architecture)
        if template is not None:
            tokenizer.chat_template = template
    return tokenizer
