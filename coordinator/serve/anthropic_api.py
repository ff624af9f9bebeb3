"""POST /v1/messages and /v1/messages/count_tokens: Anthropic's Messages API, as llama-server
offers it, so Anthropic's SDKs and the coding agents built on them reach a local model.

A body becomes a ChatRequest (chat_request.py) and runs as a chat completion does, on the same
template, tools, grammar and scheduler: `system` is the system message; a user turn's
`tool_result` blocks are tool messages and its text blocks one user message; an assistant
turn's text, `tool_use` and `thinking` blocks are its content, tool calls and reasoning;
`tool_choice` any / tool / none are OpenAI's required / named / none; `thinking` enabled with
budget_tokens is the reasoning budget, disabled is a budget of 0; `output_config.format` (a JSON
schema) is structured output, `output_config.effort` the reasoning effort. Sampling fields
(temperature, top_p, top_k) are taken as the older clients send them.

The reply is a message of content blocks (thinking, text, tool_use) with stop_reason end_turn,
max_tokens, stop_sequence or tool_use; streamed, it is Anthropic's events in their order:
message_start, ping, then per block content_block_start, content_block_delta...,
content_block_stop, then message_delta (stop_reason, usage) and message_stop. Errors have
Anthropic's shape: {"type": "error", "error": {"type": ..., "message": ...}}.
"""
from __future__ import annotations

import json
import uuid
from typing import Annotated, Any, Literal, Union

from fastapi import FastAPI, Request as HttpRequest
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field

from .chat_request import ClientGone, chat_body, prepare_chat, reply_parts, start_as_chat, whole_reply
from .state import ApiError, ServerState

PATHS = ("/v1/messages", "/v1/messages/count_tokens")
_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                404: "not_found_error", 408: "timeout_error", 413: "request_too_large", 429: "rate_limit_error",
                503: "overloaded_error"}
PING_EVERY_S = 5.0  # a stream's keep-alive while a long prompt is prefilled


def is_anthropic(path: str) -> bool:
    return path in PATHS


def anthropic_error(status: int, message: str) -> JSONResponse:
    kind = _ERROR_TYPES.get(status, "api_error" if status >= 500 else "invalid_request_error")
    return JSONResponse({"type": "error", "error": {"type": kind, "message": message}}, status_code=status)


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore")


class TextBlock(_Body):
    type: Literal["text"]
    text: str


class ToolUseBlock(_Body):
    type: Literal["tool_use"]
    id: str
    name: str
    input: dict


class ToolResultBlock(_Body):
    type: Literal["tool_result"]
    tool_use_id: str
    content: Union[str, list[TextBlock], None] = None
    is_error: bool = False

    def text(self) -> str:
        body = self.content if isinstance(self.content, str) else "\n".join(b.text for b in self.content or [])
        return f"Error: {body}" if self.is_error else body


class ThinkingBlock(_Body):
    type: Literal["thinking"]
    thinking: str
    signature: str | None = None


class RedactedThinkingBlock(_Body):
    type: Literal["redacted_thinking"]
    data: str = ""


Block = Annotated[Union[TextBlock, ToolUseBlock, ToolResultBlock, ThinkingBlock, RedactedThinkingBlock],
                  Field(discriminator="type")]


class AnthropicMessage(_Body):
    role: Literal["user", "assistant"]
    content: Union[str, list[Block]]


class AnthropicTool(_Body):
    name: str = Field(pattern=r"^[A-Za-z0-9_.-]{1,64}$")
    description: str | None = None
    input_schema: dict


class AnthropicToolChoice(_Body):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool = False


class ThinkingConfig(_Body):
    type: Literal["enabled", "disabled", "adaptive"]
    budget_tokens: int | None = Field(None, ge=0)


class OutputFormat(_Body):
    type: Literal["json_schema"]
    schema_: Union[dict, bool] = Field(alias="schema")


class OutputConfig(_Body):
    """Anthropic's structured output (`format`: a JSON schema the reply follows) and effort."""
    format: OutputFormat | None = None
    effort: Literal["low", "medium", "high", "xhigh", "max"] | None = None


class CountTokensRequest(_Body):
    model: str
    messages: list[AnthropicMessage] = Field(min_length=1)
    system: Union[str, list[TextBlock], None] = None
    tools: list[AnthropicTool] | None = None
    tool_choice: AnthropicToolChoice | None = None
    thinking: ThinkingConfig | None = None
    output_config: OutputConfig | None = None


class MessagesRequest(CountTokensRequest):
    max_tokens: int = Field(ge=1)
    stop_sequences: list[str] | None = None
    temperature: float = Field(1.0, ge=0.0, le=1.0, allow_inf_nan=False)
    top_p: float | None = Field(None, gt=0.0, le=1.0, allow_inf_nan=False)
    top_k: int | None = Field(None, ge=0)
    stream: bool = False
    metadata: dict | None = None


def _messages(body: CountTokensRequest) -> list[dict]:
    """Anthropic's turns as OpenAI's chat messages (what the template and tools take)."""
    out: list[dict] = []
    if body.system:
        system = body.system if isinstance(body.system, str) else "\n\n".join(b.text for b in body.system)
        out.append({"role": "system", "content": system})
    for i, m in enumerate(body.messages):
        if isinstance(m.content, str):
            out.append({"role": m.role, "content": m.content})
            continue
        where = f"messages.{i}.content"
        if m.role == "user":
            texts = []
            for b in m.content:
                if isinstance(b, ToolResultBlock):
                    out.append({"role": "tool", "tool_call_id": b.tool_use_id, "content": b.text()})
                elif isinstance(b, TextBlock):
                    texts.append(b.text)
                else:
                    raise ApiError(400, f"{where}: a user turn holds text and tool_result blocks, not {b.type}",
                                   param=where)
            if texts or not m.content:
                out.append({"role": "user", "content": "\n\n".join(texts)})
            continue
        if any(isinstance(b, ToolResultBlock) for b in m.content):
            raise ApiError(400, f"{where}: tool_result blocks belong in a user turn", param=where)
        text = "".join(b.text for b in m.content if isinstance(b, TextBlock))
        thought = "".join(b.thinking for b in m.content if isinstance(b, ThinkingBlock))
        calls = [{"id": b.id, "type": "function", "function": {"name": b.name, "arguments": json.dumps(b.input)}}
                 for b in m.content if isinstance(b, ToolUseBlock)]
        out.append({"role": "assistant", "content": text or None, "tool_calls": calls or None,
                    "reasoning_content": thought or None})
    if out and out[-1]["role"] == "assistant":
        raise ApiError(400, "messages: the last turn is the assistant's; continuing it (prefill) is not supported",
                       param="messages")
    return out


def _chat_fields(body: CountTokensRequest) -> dict:
    fields: dict[str, Any] = {"model": body.model, "messages": _messages(body)}
    if body.tools:
        fields["tools"] = [{"type": "function", "function": {"name": t.name, "description": t.description,
                                                              "parameters": t.input_schema}} for t in body.tools]
    choice = body.tool_choice
    if choice is not None:
        if choice.type == "tool":
            if not choice.name:
                raise ApiError(400, "tool_choice.name: a tool choice of type 'tool' names the tool",
                               param="tool_choice.name")
            fields["tool_choice"] = {"type": "function", "function": {"name": choice.name}}
        else:
            fields["tool_choice"] = {"auto": "auto", "any": "required", "none": "none"}[choice.type]
        fields["parallel_tool_calls"] = not choice.disable_parallel_tool_use
    if body.thinking is not None and body.thinking.type != "adaptive":  # adaptive: the server's default
        fields["reasoning_budget"] = 0 if body.thinking.type == "disabled" else (
            body.thinking.budget_tokens if body.thinking.budget_tokens is not None else -1)
    out = body.output_config
    if out is not None and out.effort is not None and "reasoning_budget" not in fields:
        fields["reasoning_effort"] = {"xhigh": "high", "max": "high"}.get(out.effort, out.effort)
    if out is not None and out.format is not None:
        fields["response_format"] = {"type": "json_schema", "json_schema": {"name": "output",
                                                                            "schema": out.format.schema_}}
    if isinstance(body, MessagesRequest):
        fields.update(max_tokens=body.max_tokens, temperature=body.temperature, stop=body.stop_sequences)
        if body.top_p is not None:
            fields["top_p"] = body.top_p
        if body.top_k is not None:
            fields["top_k"] = body.top_k
    return fields


def _stop_reason(done, calls: bool) -> str:
    if done.reason == "length":
        return "max_tokens"
    if calls:
        return "tool_use"
    return "stop_sequence" if done.stop_string else "end_turn"


def _tool_use(call) -> dict:
    """Anthropic's tool_use block: its input an object (a harmony call's body may not be JSON at
    all: then the text is kept under "arguments" rather than lost)."""
    try:
        args = json.loads(call.arguments)
    except json.JSONDecodeError:
        args = {"arguments": call.arguments}
    return {"type": "tool_use", "id": "toolu_" + uuid.uuid4().hex[:24], "name": call.name,
            "input": args if isinstance(args, dict) else {"arguments": args}}


def _sse(event: str, data: dict) -> str:
    return f"event: {event}\ndata: {json.dumps(data, ensure_ascii=False)}\n\n"


async def _stream(http: HttpRequest, body: MessagesRequest, mid: str, prompt_tokens: int,
                  req, events, split):
    """Anthropic's events: a block is opened when a part of a new kind arrives and closed when
    the next kind begins or the reply ends."""
    yield _sse("message_start", {"type": "message_start", "message": {
        "id": mid, "type": "message", "role": "assistant", "model": body.model, "content": [],
        "stop_reason": None, "stop_sequence": None, "usage": {"input_tokens": prompt_tokens, "output_tokens": 0}}})
    yield _sse("ping", {"type": "ping"})
    index, kind, calls, idle = -1, None, False, 0.0

    def open_block(block: dict) -> str:
        nonlocal index
        index += 1
        return _sse("content_block_start", {"type": "content_block_start", "index": index, "content_block": block})

    def close_block() -> str:
        return _sse("content_block_stop", {"type": "content_block_stop", "index": index})

    try:
        async for part, value in reply_parts(req, events, split, http):
            if part == "idle":
                idle += 0.5
                if idle >= PING_EVERY_S:
                    idle = 0.0
                    yield _sse("ping", {"type": "ping"})
                continue
            idle = 0.0
            if part in ("thinking", "text", "call") and (kind != part or part == "call"):
                if kind is not None:
                    yield close_block()
                kind = part
                if part == "thinking":
                    yield open_block({"type": "thinking", "thinking": "", "signature": ""})
                elif part == "text":
                    yield open_block({"type": "text", "text": ""})
            if part == "thinking":
                yield _sse("content_block_delta", {"type": "content_block_delta", "index": index,
                                                   "delta": {"type": "thinking_delta", "thinking": value}})
            elif part == "text":
                yield _sse("content_block_delta", {"type": "content_block_delta", "index": index,
                                                   "delta": {"type": "text_delta", "text": value}})
            elif part == "call":
                calls = True
                block = _tool_use(value)
                yield open_block({**block, "input": {}})
                yield _sse("content_block_delta", {"type": "content_block_delta", "index": index, "delta": {
                    "type": "input_json_delta", "partial_json": json.dumps(block["input"], ensure_ascii=False)}})
            elif part == "failed":
                yield _sse("error", {"type": "error", "error": {"type": "api_error",
                                                                "message": f"generation failed: {value}"}})
                return
            elif part == "done":
                if kind is not None:
                    yield close_block()
                yield _sse("message_delta", {"type": "message_delta", "delta": {
                    "stop_reason": _stop_reason(value, calls), "stop_sequence": value.stop_string},
                    "usage": {"output_tokens": value.completion_tokens}})
                yield _sse("message_stop", {"type": "message_stop"})
    except ClientGone:
        return


def add_routes(app: FastAPI, state: ServerState) -> None:
    @app.post("/v1/messages")
    async def messages(body: MessagesRequest, http: HttpRequest):
        prepared, req, events, split = await start_as_chat(state, _chat_fields(body), body.max_tokens)
        mid = "msg_" + uuid.uuid4().hex[:24]
        if body.stream:
            return StreamingResponse(_stream(http, body, mid, len(prepared.ids), req, events, split),
                                     media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        try:
            thought, text, calls, done = await whole_reply(req, events, split, http)
        except ClientGone:
            return JSONResponse({}, status_code=499)
        content = ([{"type": "thinking", "thinking": thought, "signature": ""}] if thought else []) + \
                  ([{"type": "text", "text": text}] if text else []) + [_tool_use(c) for c in calls]
        return {"id": mid, "type": "message", "role": "assistant", "model": body.model, "content": content,
                "stop_reason": _stop_reason(done, bool(calls)), "stop_sequence": done.stop_string,
                "usage": {"input_tokens": done.prompt_tokens, "output_tokens": done.completion_tokens}}

    @app.post("/v1/messages/count_tokens")
    async def count_tokens(body: CountTokensRequest):
        prepared = await prepare_chat(state, chat_body(_chat_fields(body)), check_room=False)
        return {"input_tokens": len(prepared.ids)}
