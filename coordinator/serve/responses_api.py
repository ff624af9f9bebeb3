"""POST /v1/responses: OpenAI's Responses API (the one its newer SDKs and agents use), over the
same chat machinery as /v1/chat/completions (chat_request.py).

The request: `input` (a string, or items: messages whose content is a string or input_text
parts, function_call and function_call_output items of earlier turns, reasoning items),
`instructions` (the system message), `max_output_tokens`, `tools` (function tools, flat:
name, description, parameters), `tool_choice`, `text.format` (text, json_object, json_schema:
structured output), `reasoning.effort` (the thinking's budget). Nothing is stored: a
`previous_response_id` is refused, the client sends the conversation again.

The reply: a response object whose `output` holds, in the order they came, a reasoning item
(the model's thinking as reasoning_text), a message item (output_text) and function_call items;
status "incomplete" (reason max_output_tokens) when cut short. Streamed: response.created,
response.in_progress, then per item response.output_item.added, its parts' added / delta /
done events, response.output_item.done, and response.completed (or response.incomplete),
every event numbered (sequence_number).
"""
from __future__ import annotations

import json
import time
import uuid
from typing import Annotated, Literal, Union

from fastapi import FastAPI, Request as HttpRequest
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag

from .chat_request import ClientGone, reply_parts, start_as_chat, whole_reply
from .state import ApiError, ServerState


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore")


class TextPart(_Body):
    type: Literal["input_text", "output_text", "text", "reasoning_text", "summary_text"]
    text: str


class MessageItem(_Body):
    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: Union[str, list[TextPart]]

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class FunctionCallItem(_Body):
    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str


class FunctionCallOutputItem(_Body):
    type: Literal["function_call_output"]
    call_id: str
    output: Union[str, list[TextPart]]


class ReasoningItem(_Body):
    type: Literal["reasoning"]
    summary: list[TextPart] = []
    content: list[TextPart] | None = None


def _item_kind(v) -> str:
    kind = v.get("type", "message") if isinstance(v, dict) else getattr(v, "type", "message")
    return kind if kind in ("message", "function_call", "function_call_output", "reasoning") else "unknown"


class _Unknown(_Body):
    type: Literal["message", "function_call", "function_call_output", "reasoning"]  # names the supported ones


Item = Annotated[Union[Annotated[MessageItem, Tag("message")], Annotated[FunctionCallItem, Tag("function_call")],
                       Annotated[FunctionCallOutputItem, Tag("function_call_output")],
                       Annotated[ReasoningItem, Tag("reasoning")], Annotated[_Unknown, Tag("unknown")]],
                 Discriminator(_item_kind)]


class FunctionTool(_Body):
    type: Literal["function"]
    name: str = Field(pattern=r"^[A-Za-z0-9_.-]{1,64}$")
    description: str | None = None
    parameters: dict | None = None
    strict: bool | None = None


class NamedFunction(_Body):
    type: Literal["function"]
    name: str


class TextFormat(_Body):
    type: Literal["text", "json_object", "json_schema"]
    name: str = "response"
    schema_: Union[dict, bool, None] = Field(None, alias="schema")
    strict: bool | None = None
    description: str | None = None


class TextConfig(_Body):
    format: TextFormat | None = None


class ReasoningConfig(_Body):
    effort: Literal["none", "minimal", "low", "medium", "high"] | None = None


class ResponsesRequest(_Body):
    model: str | None = None
    input: Union[str, list[Item]]
    instructions: str | None = None
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0.0, le=2.0, allow_inf_nan=False)
    top_p: float = Field(1.0, gt=0.0, le=1.0, allow_inf_nan=False)
    stream: bool = False
    tools: list[FunctionTool] | None = None
    tool_choice: Union[Literal["auto", "none", "required"], NamedFunction, None] = None
    parallel_tool_calls: bool = True
    text: TextConfig | None = None
    reasoning: ReasoningConfig | None = None
    previous_response_id: str | None = None
    metadata: dict | None = None


def _messages(body: ResponsesRequest) -> list[dict]:
    out: list[dict] = [{"role": "system", "content": body.instructions}] if body.instructions else []
    if isinstance(body.input, str):
        return out + [{"role": "user", "content": body.input}]
    thought = None  # a reasoning item goes with the assistant turn that follows it
    for i, item in enumerate(body.input):
        if isinstance(item, MessageItem):
            m = {"role": item.role, "content": item.text()}
            if item.role == "assistant" and thought:
                m["reasoning_content"], thought = thought, None
            out.append(m)
        elif isinstance(item, FunctionCallItem):
            call = {"id": item.call_id, "type": "function", "function": {"name": item.name, "arguments": item.arguments}}
            last = out[-1] if out else None
            if last is not None and last["role"] == "assistant" and last.get("tool_calls") is not None:
                last["tool_calls"].append(call)
            elif last is not None and last["role"] == "assistant" and not last.get("tool_calls"):
                last["tool_calls"] = [call]
            else:
                out.append({"role": "assistant", "content": None, "tool_calls": [call],
                            **({"reasoning_content": thought} if thought else {})})
                thought = None
        elif isinstance(item, FunctionCallOutputItem):
            text = item.output if isinstance(item.output, str) else "".join(p.text for p in item.output)
            out.append({"role": "tool", "tool_call_id": item.call_id, "content": text})
        elif isinstance(item, ReasoningItem):
            thought = "".join(p.text for p in (item.content or item.summary))
        else:
            raise ApiError(400, f"input.{i}.type: unknown item type", param=f"input.{i}.type")
    return out


def _chat_fields(body: ResponsesRequest) -> dict:
    if body.previous_response_id:
        raise ApiError(400, "previous_response_id: responses are not stored here; send the conversation as input",
                       param="previous_response_id")
    fields = {"model": body.model, "messages": _messages(body), "temperature": body.temperature, "top_p": body.top_p,
              "max_tokens": body.max_output_tokens, "parallel_tool_calls": body.parallel_tool_calls}
    if body.tools:
        fields["tools"] = [{"type": "function", "function": {"name": t.name, "description": t.description,
                                                              "parameters": t.parameters}} for t in body.tools]
    if body.tool_choice is not None:
        fields["tool_choice"] = body.tool_choice if isinstance(body.tool_choice, str) else \
            {"type": "function", "function": {"name": body.tool_choice.name}}
    fmt = body.text.format if body.text else None
    if fmt is not None and fmt.type == "json_object":
        fields["response_format"] = {"type": "json_object"}
    elif fmt is not None and fmt.type == "json_schema":
        if fmt.schema_ is None:
            raise ApiError(400, "text.format.schema: a json_schema format needs its schema", param="text.format.schema")
        fields["response_format"] = {"type": "json_schema", "json_schema": {
            "name": fmt.name, "schema": fmt.schema_, "strict": fmt.strict}}
    if body.reasoning and body.reasoning.effort:
        fields["reasoning_effort"] = body.reasoning.effort
    return fields


class _Response:
    """The response object as it grows: its items, and the events that tell a stream about them."""

    def __init__(self, body: ResponsesRequest, model: str, tokenizer):
        self.body, self.model, self.tk = body, model, tokenizer
        self.id, self.created = "resp_" + uuid.uuid4().hex[:24], int(time.time())
        self.items: list[dict] = []
        self.seq = 0
        self.thought_text = ""

    def obj(self, status: str, usage: dict | None = None, incomplete: str | None = None) -> dict:
        b = self.body
        return {"id": self.id, "object": "response", "created_at": self.created, "status": status, "model": self.model,
                "output": self.items if status != "in_progress" else [], "error": None,
                "incomplete_details": {"reason": incomplete} if incomplete else None,
                "instructions": b.instructions, "max_output_tokens": b.max_output_tokens, "metadata": b.metadata or {},
                "parallel_tool_calls": b.parallel_tool_calls, "previous_response_id": None,
                "reasoning": {"effort": b.reasoning.effort if b.reasoning else None, "summary": None}, "store": False,
                "temperature": b.temperature, "top_p": b.top_p, "truncation": "disabled",
                "text": {"format": (b.text.format.model_dump(by_alias=True, exclude_none=True)
                                    if b.text and b.text.format else {"type": "text"})},
                "tool_choice": "auto" if b.tool_choice is None else b.tool_choice if isinstance(b.tool_choice, str)
                else b.tool_choice.model_dump(),
                "tools": [t.model_dump(exclude_none=True) for t in b.tools or []], "usage": usage}

    def usage(self, done) -> dict:
        thinking = len(self.tk.encode(self.thought_text, add_bos=False, add_eos=False)) if self.thought_text else 0
        return {"input_tokens": done.prompt_tokens, "input_tokens_details": {"cached_tokens": done.cached_tokens},
                "output_tokens": done.completion_tokens,
                "output_tokens_details": {"reasoning_tokens": min(thinking, done.completion_tokens)},
                "total_tokens": done.prompt_tokens + done.completion_tokens}

    def event(self, kind: str, **fields) -> str:
        data = {"type": kind, "sequence_number": self.seq, **fields}
        self.seq += 1
        return f"event: {kind}\ndata: {json.dumps(data, ensure_ascii=False)}\n\n"

    # ---- the items ----

    def open(self, kind: str, call=None) -> dict:
        if kind == "thinking":
            item = {"type": "reasoning", "id": "rs_" + uuid.uuid4().hex[:24], "summary": [],
                    "content": [{"type": "reasoning_text", "text": ""}], "status": "in_progress"}
        elif kind == "text":
            item = {"type": "message", "id": "msg_" + uuid.uuid4().hex[:24], "status": "in_progress",
                    "role": "assistant", "content": [{"type": "output_text", "text": "", "annotations": [],
                                                      "logprobs": []}]}
        else:
            item = {"type": "function_call", "id": "fc_" + uuid.uuid4().hex[:24], "call_id": call.id,
                    "name": call.name, "arguments": call.arguments, "status": "in_progress"}
        self.items.append(item)
        return item

    def add(self, item: dict, text: str) -> None:
        item["content"][0]["text"] += text
        if item["type"] == "reasoning":
            self.thought_text += text

    def close(self, item: dict) -> None:
        item["status"] = "completed"


def _status(done) -> tuple[str, str | None]:
    return ("incomplete", "max_output_tokens") if done.reason == "length" else ("completed", None)


async def _stream(resp: _Response, http: HttpRequest, req, events, split):
    yield resp.event("response.created", response=resp.obj("in_progress"))
    yield resp.event("response.in_progress", response=resp.obj("in_progress"))
    item = None
    kinds = {"thinking": "reasoning", "text": "message"}

    def closing():
        i = len(resp.items) - 1
        resp.close(item)
        if item["type"] == "function_call":
            yield resp.event("response.function_call_arguments.done", item_id=item["id"], output_index=i,
                             name=item["name"], arguments=item["arguments"])
        else:
            part = item["content"][0]
            done = "response.reasoning_text.done" if item["type"] == "reasoning" else "response.output_text.done"
            extra = {} if item["type"] == "reasoning" else {"logprobs": []}
            yield resp.event(done, item_id=item["id"], output_index=i, content_index=0, text=part["text"], **extra)
            yield resp.event("response.content_part.done", item_id=item["id"], output_index=i, content_index=0,
                             part=part)
        yield resp.event("response.output_item.done", output_index=i, item=item)

    try:
        async for part, value in reply_parts(req, events, split, http):
            if part in ("thinking", "text", "call") and (item is None or item["type"] != kinds.get(part) or
                                                         part == "call"):
                if item is not None:
                    for e in closing():
                        yield e
                item = resp.open(part, value if part == "call" else None)
                i = len(resp.items) - 1
                if part == "call":
                    yield resp.event("response.output_item.added", output_index=i,
                                     item={**item, "arguments": ""})
                    yield resp.event("response.function_call_arguments.delta", item_id=item["id"], output_index=i,
                                     delta=item["arguments"])
                    continue
                yield resp.event("response.output_item.added", output_index=i,
                                 item={**item, "content": []})
                yield resp.event("response.content_part.added", item_id=item["id"], output_index=i, content_index=0,
                                 part={**item["content"][0]})
            if part in ("thinking", "text"):
                resp.add(item, value)
                delta = "response.reasoning_text.delta" if part == "thinking" else "response.output_text.delta"
                extra = {} if part == "thinking" else {"logprobs": []}
                yield resp.event(delta, item_id=item["id"], output_index=len(resp.items) - 1, content_index=0,
                                 delta=value, **extra)
            elif part == "failed":
                failed = resp.obj("failed")
                failed["error"] = {"code": "server_error", "message": f"generation failed: {value}"}
                yield resp.event("response.failed", response=failed)
                return
            elif part == "done":
                if item is not None:
                    for e in closing():
                        yield e
                status, why = _status(value)
                yield resp.event("response.completed" if status == "completed" else "response.incomplete",
                                 response=resp.obj(status, resp.usage(value), why))
    except ClientGone:
        return


def add_routes(app: FastAPI, state: ServerState) -> None:
    @app.post("/v1/responses")
    async def responses(body: ResponsesRequest, http: HttpRequest):
        _, req, events, split = await start_as_chat(state, _chat_fields(body), body.max_output_tokens)
        resp = _Response(body, state.model_id, state.engine.tokenizer)
        if body.stream:
            return StreamingResponse(_stream(resp, http, req, events, split), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        try:
            thought, text, calls, done = await whole_reply(req, events, split, http)
        except ClientGone:
            return JSONResponse({}, status_code=499)
        for kind, value in (("thinking", thought), ("text", text)):
            if value:
                item = resp.open(kind)
                resp.add(item, value)
                resp.close(item)
        for c in calls:
            resp.close(resp.open("call", c))
        status, why = _status(done)
        return resp.obj(status, resp.usage(done), why)
