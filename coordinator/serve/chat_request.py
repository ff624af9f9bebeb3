"""A chat request from its body to its reply's parts, for every API that chats: OpenAI's chat
completions (app.py), Anthropic's messages (anthropic_api.py) and OpenAI's responses
(responses_api.py) each turn their body into a `ChatRequest` and go through here, so they share
the template, the tools, structured output, the thinking and the scheduler.

    prepare_chat(state, body)   checks, tools, thinking, the rendered prompt's token ids
    start_chat(...)             the scheduler's request and the splitter of its reply
    reply_parts(...)            the reply as ("thinking", str), ("text", str), ("call", Call),
                                then ("done", DoneEvent) or ("failed", message)
"""
from __future__ import annotations

import asyncio
from dataclasses import dataclass

from fastapi import Request as HttpRequest
from pydantic import ValidationError

from ..runtime.batching import DoneEvent, FailedEvent, Overloaded, Request, Scheduler, TokenEvent
from .api_schema import ChatRequest
from .completion import chat_message, check_model, fits_at_all, splitter, submit
from .reasoning import ReplySplitter
from .state import ApiError, ServerState, off_loop
from .thinking import Thinking
from .tool_use import ToolUse


class ClientGone(Exception):
    """The client closed its connection while its reply was being made (its slot is freed)."""


@dataclass
class PreparedChat:
    sched: Scheduler
    ids: list[int]
    tools: ToolUse
    thinking: Thinking


def chat_body(fields: dict) -> ChatRequest:
    """A ChatRequest made from another API's body; what does not fit is a 400 naming the field."""
    try:
        return ChatRequest.model_validate(fields)
    except ValidationError as e:
        err = e.errors()[0]
        where = ".".join(str(x) for x in err.get("loc", ()))
        raise ApiError(400, f"{where}: {err.get('msg', 'invalid')}" if where else err.get("msg", "invalid request"),
                       param=where or None) from None


def _constrained(body: ChatRequest, tools: ToolUse) -> bool:
    rf = body.response_format is not None and body.response_format.type != "text"
    return tools.grammar is not None or rf or body.json_schema is not None or bool(body.grammar or body.regex)


async def prepare_chat(state: ServerState, body: ChatRequest, check_room: bool = True) -> PreparedChat:
    """`check_room`: refuse the request (503) when no slot or place in the queue is free
    (not for a request that only counts the prompt's tokens)."""
    sched = state.ready()
    check_model(state, body.model)
    messages = [chat_message(m, i) for i, m in enumerate(body.messages)]
    fits_at_all(state, sum(len(m["content"]) for m in messages), "messages")
    tools = ToolUse.of(state, body, messages)
    template = state.engine.chat_template
    thinking = Thinking.of(state.reasoning, template, body, False)
    if thinking.family == "harmony" and thinking.parse:
        tools.grammar = None  # harmony's calls are its own messages: a hermes grammar would not fit them
    if _constrained(body, tools):
        thinking = Thinking.of(state.reasoning, template, body, True)
    try:  # before the template's render (a forked process): a request refused anyway costs nothing
        if check_room:
            sched.check_room()
    except Overloaded as e:
        raise ApiError(503, f"server overloaded: {e}", "server_error", code="overloaded") from None
    variables = {**thinking.template_vars, **tools.template_vars}
    try:
        ids = await off_loop(state, state.engine.encode_chat, tools.messages, **variables)
    except Exception as e:  # a template that fails on these messages
        raise ApiError(400, f"messages: the chat template failed: {e}", param="messages") from None
    thinking.after_prompt(state.engine.tokenizer, ids)
    return PreparedChat(sched, ids, tools, thinking)


async def start_chat(state: ServerState, chat: PreparedChat, body: ChatRequest,
                     max_tokens: int | None) -> tuple[Request, asyncio.Queue, ReplySplitter | None]:
    req, events = await submit(state, chat.sched, body, chat.ids, max_tokens, None, True, chat.tools, chat.thinking)
    return req, events, splitter(chat.tools, chat.thinking)


async def start_as_chat(state: ServerState, fields: dict, max_tokens: int | None
                        ) -> tuple[PreparedChat, Request, asyncio.Queue, ReplySplitter | None]:
    """Another API's request (Anthropic's messages, OpenAI's responses: `fields` its body as a
    chat completion's) checked, rendered and submitted as a chat completion is."""
    chat = chat_body(fields)
    prepared = await prepare_chat(state, chat)
    return (prepared, *await start_chat(state, prepared, chat, max_tokens))


async def reply_parts(req: Request, events: asyncio.Queue, split: ReplySplitter | None, http: HttpRequest,
                      idle: float = 0.5):
    """The reply's parts as they become certain; ("idle", None) after `idle` seconds without
    any (a stream's chance to send a keep-alive). Raises ClientGone when the client left."""
    try:
        while True:
            try:
                ev = await asyncio.wait_for(events.get(), timeout=idle)
            except asyncio.TimeoutError:
                ev = None
            if await http.is_disconnected():
                raise ClientGone()
            if ev is None:
                yield "idle", None
                continue
            if isinstance(ev, FailedEvent):
                yield "failed", ev.message
                return
            final = isinstance(ev, DoneEvent)
            if isinstance(ev, (TokenEvent, DoneEvent)):
                thought, text, calls = split.feed(ev.text, final) if split else ("", ev.text, [])
                if thought:
                    yield "thinking", thought
                if text:
                    yield "text", text
                for c in calls:
                    yield "call", c
            if final:
                yield "done", ev
                return
    finally:
        req.cancelled.set()  # a no-op once done; frees the slot if the client left


async def whole_reply(req, events, split, http) -> tuple[str, str, list, DoneEvent]:
    """(thinking, text, calls, done) of a reply not streamed; a failure is a 500."""
    thought, text, calls = [], [], []
    async for kind, value in reply_parts(req, events, split, http):
        if kind == "thinking":
            thought.append(value)
        elif kind == "text":
            text.append(value)
        elif kind == "call":
            calls.append(value)
        elif kind == "failed":
            raise ApiError(500, f"generation failed: {value}", "server_error")
        elif kind == "done":
            return "".join(thought), "".join(text), calls, value
    raise ClientGone()
