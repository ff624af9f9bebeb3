"""A streamed reply: the scheduler's events for one request as server-sent events, OpenAI's
chunks, ending with [DONE]; a client that goes away frees its slot."""
from __future__ import annotations

import asyncio

from fastapi import Request as HttpRequest

from ..runtime.batching import DoneEvent, FailedEvent, Request, TokenEvent
from .responses import ReplyFormat


async def sse_stream(req: Request, events: asyncio.Queue, fmt: ReplyFormat, include_usage: bool,
                     http: HttpRequest):
    import json

    def sse(obj) -> str:
        return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"
    try:
        if fmt.chat:
            yield sse(fmt.chunk({"role": "assistant", "content": ""}, None, None))
        while True:
            try:
                ev = await asyncio.wait_for(events.get(), timeout=0.25)
            except asyncio.TimeoutError:
                ev = None
            # Sending to a client that left does not fail under every ASGI server: ask, so the
            # slot is freed at the scheduler's next step rather than after the whole reply.
            if await http.is_disconnected():
                return
            if ev is None:
                continue
            if isinstance(ev, TokenEvent):
                thought, text, calls = fmt.split(ev.text)
                if thought:
                    yield sse(fmt.chunk({"reasoning_content": thought}, None if text else [ev], None))
                if text or not thought:
                    yield sse(fmt.chunk(text, [ev], None))
                for c in calls:
                    yield sse(fmt.call_chunk(c))
            elif isinstance(ev, DoneEvent):
                thought, text, calls = fmt.split(ev.text, final=True)
                if thought:
                    yield sse(fmt.chunk({"reasoning_content": thought}, None, None))
                if calls:
                    yield sse(fmt.chunk(text, None, None))
                    for c in calls:
                        yield sse(fmt.call_chunk(c))
                    text = ""
                yield sse(fmt.chunk(text, None, fmt.finish_reason(ev)))
                if include_usage:
                    yield sse(fmt.usage_chunk(ev))
                break
            elif isinstance(ev, FailedEvent):
                yield sse({"error": {"message": f"generation failed: {ev.message}", "type": "server_error",
                                     "param": None, "code": None}})
                break
        yield "data: [DONE]\n\n"
    finally:
        req.cancelled.set()  # the client went away (or we finished): free the slot at the next step
