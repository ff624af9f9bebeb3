"""One completion request, from its token ids to its reply: the checks of a request's text and
context, its grammar (structured output, or the calls a tool_choice requires), the scheduler's
request, and the reply, whole or streamed (streaming.py) in OpenAI's objects (responses.py)."""
from __future__ import annotations

import asyncio
import uuid

from fastapi import Request as HttpRequest
from fastapi.responses import JSONResponse, StreamingResponse

from ..runtime.batching import DoneEvent, FailedEvent, Overloaded, Request, Scheduler, TokenEvent
from ..runtime.sampling import SamplingParams
from ..text.structured_output import Constraint, GrammarError, TokenTable, grammar_for
from .reasoning import ReplySplitter
from .responses import ReplyFormat
from .state import ApiError, ServerState, off_loop
from .streaming import sse_stream
from .thinking import Thinking
from .tool_use import ToolUse


def checked_text(s: str, param: str) -> str:
    """JSON may carry lone UTF-16 surrogates ("\\ud800"), which no tokenizer can encode."""
    try:
        s.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ApiError(400, f"{param}: not valid Unicode text ({e.reason} at character {e.start})", param=param) from None
    return s


def fits_at_all(state: ServerState, chars: int, param: str) -> None:
    """Refuse a text that cannot fit the context whatever its tokens, before tokenizing it (a
    token spells at most `longest_token_chars` characters)."""
    at_least = chars // state.engine.tokenizer.longest_token_chars
    if at_least > state.scheduler.max_ctx:
        raise ApiError(400, f"{param}: {chars} characters are at least {at_least} tokens, more than the context "
                            f"size {state.scheduler.max_ctx}", param=param, code="context_length_exceeded")


def check_model(state: ServerState, model: str | None) -> None:
    if model and model not in (state.model_id, state.model_id + ".gguf"):
        raise ApiError(404, f"model {model!r} does not exist (this server runs {state.model_id!r})",
                       param="model", code="model_not_found")


async def submit(state: ServerState, sched: Scheduler, body, ids: list[int], max_tokens: int | None,
                 logprobs: int | None, chat: bool, tools: "ToolUse | None" = None,
                 thinking: "Thinking | None" = None) -> tuple[Request, asyncio.Queue]:
    """Check the request's room in the context, compile its grammar, and hand it to the
    scheduler: (the request, the queue its events arrive in on this event loop)."""
    if not ids:
        raise ApiError(400, "prompt: empty prompt, nothing to condition on", param="prompt")
    room = sched.max_ctx - len(ids)
    if room < 1 or (max_tokens is not None and max_tokens > room):
        want = max_tokens or 1
        raise ApiError(400, f"the prompt ({len(ids)} tokens) plus max_tokens ({want}) exceeds the context size "
                            f"{sched.max_ctx}", param="max_tokens" if room >= 1 else "messages" if chat else "prompt",
                       code="context_length_exceeded")
    constraint = await _constraint(state, body, tools.grammar if tools else None)
    if thinking is not None:
        constraint = thinking.constraint(state.engine.tokenizer, constraint, body.ignore_eos)
    sampling = SamplingParams(body.temperature, body.top_k, body.top_p, body.seed, body.min_p,
                              body.repeat_penalty, body.presence_penalty, body.frequency_penalty)
    loop = asyncio.get_running_loop()
    events: asyncio.Queue = asyncio.Queue()

    def on_event(ev):  # the scheduler's thread -> this request's queue on the event loop
        try:
            loop.call_soon_threadsafe(events.put_nowait, ev)
        except RuntimeError:  # the loop has closed: the server is going away
            pass

    req = Request(ids, max_tokens or room, state.metrics.watch(on_event), sampling, body.stop, not body.ignore_eos,
                  logprobs, constraint, keep_special=bool(thinking and thinking.keep_special))
    try:
        sched.submit(req)
    except Overloaded as e:
        raise ApiError(503, f"server overloaded: {e}", "server_error", code="overloaded") from None
    except ValueError as e:
        raise ApiError(400, str(e)) from None
    except RuntimeError as e:
        raise ApiError(500, f"the engine failed: {e}", "server_error") from None
    return req, events


def splitter(tools: "ToolUse | None", thinking: "Thinking | None") -> "ReplySplitter | None":
    """What separates a chat reply's thinking, answer and tool calls (None: it is all answer)."""
    think = thinking.splitter({t.name for t in tools.tools} if tools else set()) if thinking else None
    parser = tools.parser() if tools and not (thinking and thinking.family == "harmony" and thinking.parse) else None
    return ReplySplitter(think, parser) if think is not None or parser is not None else None


async def run_request(state: ServerState, sched: Scheduler, http: HttpRequest, body, ids: list[int],
                      max_tokens: int | None, logprobs: int | None, chat: bool, tools: "ToolUse | None" = None,
                      thinking: "Thinking | None" = None):
    req, events = await submit(state, sched, body, ids, max_tokens, logprobs, chat, tools, thinking)
    rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
    fmt = ReplyFormat(state, rid, chat, logprobs is not None, state.engine.tokenizer, splitter(tools, thinking))
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        return StreamingResponse(sse_stream(req, events, fmt, include_usage, http), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
    text, infos, done = [], [], None
    try:
        while done is None:
            try:
                ev = await asyncio.wait_for(events.get(), timeout=0.5)
            except asyncio.TimeoutError:
                if await http.is_disconnected():
                    req.cancelled.set()
                    return JSONResponse({}, status_code=499)
                continue
            if isinstance(ev, TokenEvent):
                text.append(ev.text)
                infos.append(ev)
            elif isinstance(ev, DoneEvent):
                text.append(ev.text)
                done = ev
            elif isinstance(ev, FailedEvent):
                raise ApiError(500, f"generation failed: {ev.message}", "server_error")
    finally:
        req.cancelled.set()  # a no-op once done; frees the slot if this handler was cancelled
    return fmt.whole("".join(text), infos, done)


async def _constraint(state: ServerState, body, tool_grammar: str | None = None) -> Constraint | None:
    """The request's grammar (structured output, or the calls a tool_choice requires), compiled
    off the event loop (the vocabulary's table is built on first use); a grammar or schema that
    cannot be used is a 400 naming the field."""
    rf = body.response_format.model_dump(by_alias=True, exclude_none=True) if body.response_format else None
    try:
        grammar = grammar_for(response_format=rf, json_schema=body.json_schema, grammar=body.grammar, regex=body.regex)
        if tool_grammar is not None:
            if grammar is not None:
                raise GrammarError("tool_choice: a required tool call and a response format or grammar "
                                   "cannot both constrain the reply")
            grammar = _checked_tool_grammar(tool_grammar)
        if grammar is None:
            return None
        eng = state.engine
        return await off_loop(state, lambda: Constraint(TokenTable.of(eng.tokenizer, eng.model.cfg.vocab_size), grammar))
    except GrammarError as e:
        msg = str(e)
        head = msg.split(":")[0]
        param = head if head.split(".")[0] in ("response_format", "json_schema", "grammar", "regex", "tool_choice",
                                              "tools") else None
        raise ApiError(400, msg, param=param) from None


def _checked_tool_grammar(lark: str) -> str:
    try:
        return grammar_for(grammar=lark)
    except GrammarError as e:  # the tools' parameter schemas are what can be wrong here
        raise GrammarError("tools: a function's parameters are not a usable JSON schema: "
                           + str(e).split(": ", 1)[-1]) from None


def chat_message(m, i: int) -> dict:
    """A chat message as the template and tool_calls.prepare take it."""
    out = {"role": m.role, "content": checked_text(m.text(), "messages")}
    if m.tool_calls:
        out["tool_calls"] = [{"id": c.id or "", "type": "function",
                              "function": {"name": c.function.name, "arguments": c.function.arguments}}
                             for c in m.tool_calls]
    if m.tool_call_id is not None:
        out["tool_call_id"] = m.tool_call_id
    if m.name is not None:
        out["name"] = m.name
    if m.reasoning_content:
        out["reasoning_content"] = checked_text(m.reasoning_content, "messages")
    return out
