"""The OpenAI-compatible HTTP server: FastAPI routes over the continuous-batching `Scheduler`.

    POST /v1/chat/completions, POST /v1/completions   (stream or not; SSE ends with [DONE])
    GET  /v1/models, GET /health, POST /tokenize, POST /detokenize, GET /metrics (Prometheus)

The socket is bound before the model loads (a taken port fails at once, in one line); the
engine loads on a thread while /health answers 503 "loading"; requests then go to the
scheduler's slots, and a client that goes away cancels its sequence.
"""
from __future__ import annotations

import asyncio
import functools
import hmac
import os
import resource
import socket
import sys
import threading
import time
import uuid
from dataclasses import dataclass, field
from importlib.resources import files
from pathlib import Path
from typing import Callable

import anyio
import anyio.to_thread
from fastapi import FastAPI, Request as HttpRequest
from fastapi.exceptions import RequestValidationError
from fastapi.responses import HTMLResponse, JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from . import tool_calls
from .api_schema import ChatRequest, CompletionRequest, DetokenizeRequest, TokenizeRequest
from ..batching import DoneEvent, FailedEvent, Overloaded, Request, Scheduler, TokenEvent
from .metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE, ServerMetrics
from ..reaper import start_reaper
from ..sampling import SamplingParams
from ..structured_output import Constraint, GrammarError, TokenTable, grammar_for

MAX_BODY_BYTES = 8 << 20  # a request body beyond this is refused before it is parsed
HEADER_TIMEOUT_S = 10.0  # a connection's time to deliver a request's headers (idle and slowloris ones)
BODY_TIMEOUT_S = 30.0  # a request's time to deliver its body once its headers are in
MAX_CONNECTIONS = 512  # open connections and running requests; beyond them uvicorn answers 503


class ApiError(Exception):
    def __init__(self, status: int, message: str, type_: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code


def error_body(status: int, message: str, type_: str, param=None, code=None, headers=None) -> JSONResponse:
    """OpenAI's error shape."""
    return JSONResponse({"error": {"message": message, "type": type_, "param": param, "code": code}}, status_code=status,
                        headers=headers)


@dataclass
class ServerState:
    model_id: str
    status: str = "loading"  # loading, ok, recovering (a worker died: restarting the engine), error
    error: str | None = None
    engine: object = None
    scheduler: Scheduler | None = None
    created: int = field(default_factory=lambda: int(time.time()))
    exit_status: int = 0  # non-zero: the server stopped because its engine failed for good
    metrics: object = None  # coordinator.serve.metrics.ServerMetrics, made with the app
    work_limiter: object = None  # anyio.CapacityLimiter of off_loop, made on the server's event loop

    def ready(self) -> Scheduler:
        if self.status == "ok" and self.scheduler is not None and self.scheduler.error is not None:
            self.status = "recovering"  # the loader thread sees the same error and restarts the engine
        if self.status in ("loading", "recovering"):
            raise ApiError(503, f"the model is {self.status}", "unavailable_error", code=self.status)
        if self.status != "ok":
            raise ApiError(500, f"the engine failed: {self.error}", "server_error")
        return self.scheduler


class BodyLimit:
    """ASGI middleware: refuse a body beyond `limit` bytes (413) before anything parses it, and
    one that does not arrive within `seconds` of its headers (408: a client trickling its body
    holds no connection for long). A sized body is judged by its Content-Length before a byte
    is read; a chunked one (no length) is counted as it comes. Either is read here whole and
    handed on, so a refused body never reaches a parser half-read (memory: the limit, once per
    request)."""

    def __init__(self, app, limit: int = MAX_BODY_BYTES, seconds: float = BODY_TIMEOUT_S):
        self.app, self.limit, self.seconds = app, limit, seconds

    def _too_large(self):
        return error_body(413, f"request body larger than {self.limit} bytes", "invalid_request_error")

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        length = dict(scope.get("headers") or []).get(b"content-length")
        if length is not None and (not length.isdigit() or int(length) > self.limit):
            return await self._too_large()(scope, receive, send)
        parts, seen = [], 0
        deadline = asyncio.get_running_loop().time() + self.seconds
        while True:
            try:
                msg = await asyncio.wait_for(receive(), max(0.0, deadline - asyncio.get_running_loop().time()))
            except asyncio.TimeoutError:
                return await error_body(408, f"request body not received within {self.seconds:g} s",
                                        "invalid_request_error", headers={"Connection": "close"})(scope, receive, send)
            if msg["type"] != "http.request":  # the client went away: let the app see it
                break
            seen += len(msg.get("body", b""))
            if seen > self.limit:
                return await self._too_large()(scope, receive, send)
            parts.append(msg.get("body", b""))
            if not msg.get("more_body", False):
                msg = {"type": "http.request", "body": b"".join(parts), "more_body": False}
                break
        replayed = False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return msg
            return await receive()
        await self.app(scope, replay, send)


def header_timeout_protocol(seconds: float):
    """uvicorn's HTTP protocol with a deadline for headers: from the moment a connection waits for
    a request (opened, or done with its last response) it has `seconds` to deliver the request's
    headers, else it is closed. uvicorn's own keep-alive timeout ends idle connections only after
    a first response, and stops the moment a byte arrives: a client sending nothing, or a header
    byte a second, held its connection for good."""
    from uvicorn.protocols.http.h11_impl import H11Protocol

    class HeaderDeadline(H11Protocol):
        _deadline = None

        def connection_made(self, transport):
            super().connection_made(transport)
            self._arm()

        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            self._arm()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            self._arm()

        def connection_lost(self, exc) -> None:
            if self._deadline is not None:
                self._deadline.cancel()
            super().connection_lost(exc)

        def _arm(self) -> None:
            waiting = self.cycle is None or self.cycle.response_complete
            if waiting and self._deadline is None:
                self._deadline = self.loop.call_later(seconds, self._expire)
            elif not waiting and self._deadline is not None:
                self._deadline.cancel()
                self._deadline = None

        def _expire(self) -> None:
            self._deadline = None
            if (self.cycle is None or self.cycle.response_complete) and not self.transport.is_closing():
                self.transport.close()

    return HeaderDeadline


CHAT_PAGE_CSP = ("default-src 'none'; script-src 'unsafe-inline'; style-src 'unsafe-inline'; connect-src 'self'; "
                 "img-src data:; base-uri 'none'; form-action 'none'; frame-ancestors 'none'")

# the routes requests are counted by (coordinator/serve/metrics.py); any other path counts as "other"
ROUTES = ("/v1/chat/completions", "/v1/completions", "/v1/models", "/tokenize", "/detokenize", "/health", "/metrics",
          "/")


def create_app(state: ServerState, api_key: str | None = None) -> FastAPI:
    app = FastAPI(title="sparseinfer", docs_url=None, redoc_url=None, openapi_url=None)

    @app.exception_handler(ApiError)
    async def _api_error(_, e: ApiError):
        return error_body(e.status, e.message, e.type, e.param, e.code)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: HttpRequest, e: RequestValidationError):
        ctype = request.headers.get("content-type", "")
        if request.method == "POST" and not ctype.split(";")[0].strip().lower().endswith("json"):
            return error_body(400, f"Content-Type must be application/json, not {ctype or 'none'}",
                              "invalid_request_error")
        err = (e.errors() or [{}])[0]
        loc = [str(x) for x in err.get("loc", ()) if x != "body"]
        param = ".".join(loc) or None
        msg = err.get("msg", "invalid request")
        return error_body(400, f"{param}: {msg}" if param else msg, "invalid_request_error", param)

    @app.exception_handler(StarletteHTTPException)
    async def _http(_, e: StarletteHTTPException):
        return error_body(e.status_code, str(e.detail), "invalid_request_error" if e.status_code < 500 else "server_error")

    @app.exception_handler(Exception)
    async def _bug(_, e: Exception):  # never a traceback to the client; one line to our log
        print(f"error: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
        return error_body(500, f"internal error: {type(e).__name__}", "server_error")

    def authorized(request: HttpRequest) -> bool:
        given = request.headers.get("authorization", "")
        return api_key is None or hmac.compare_digest(given.encode(), f"Bearer {api_key}".encode())

    metrics = state.metrics = ServerMetrics(state)

    @app.middleware("http")
    async def _auth(request: HttpRequest, call_next):
        path = request.url.path
        endpoint = path if path in ROUTES else "other"  # labels stay few whatever clients ask for
        if path not in ("/health", "/") and not authorized(request):  # "/": the static chat page
            metrics.request(endpoint, 401)
            return error_body(401, "invalid API key", "authentication_error", code="invalid_api_key")
        response = await call_next(request)
        metrics.request(endpoint, response.status_code)
        return response

    page = files(__package__).joinpath("web/chat.html").read_text("utf-8")

    @app.get("/")
    async def chat_page():
        """The chat page (coordinator/serve/web/chat.html): static, so open to all; it asks for the key
        and sends it with its API calls. Its CSP lets it reach this server only (offline, no CDN)."""
        return HTMLResponse(page, headers={"Content-Security-Policy": CHAT_PAGE_CSP,
                                           "X-Content-Type-Options": "nosniff"})

    @app.get("/metrics")
    async def prometheus():
        """Prometheus text format (coordinator/serve/metrics.py), behind the key like every route but /health."""
        return Response(metrics.text(), media_type=METRICS_CONTENT_TYPE)

    @app.get("/health")
    async def health(request: HttpRequest):
        """Open to all, as load balancers probe it; without the key only the status (what the
        server is doing and why it failed are for those who hold the key)."""
        if state.status == "ok" and state.scheduler is not None and state.scheduler.error is not None:
            state.status = "recovering"
        code = {"loading": 503, "recovering": 503, "error": 500}.get(state.status, 200)
        if not authorized(request) or state.status in ("loading", "recovering"):
            return JSONResponse({"status": state.status}, status_code=code)
        if state.status == "error":
            return JSONResponse({"status": "error", "error": state.error}, status_code=500)
        sched = state.scheduler
        return {"status": "ok", "slots_busy": sched.busy_slots(), "slots": len(sched.slots), "waiting": len(sched.waiting),
                "decode_steps": sched.steps}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": state.model_id, "object": "model", "created": state.created,
                                            "owned_by": "sparseinfer"}]}

    # Off the event loop (a long text's tokenizing would stall every stream and /health), and
    # at most WORK_THREADS at once (under the GIL more threads only queue for it; the rest wait).
    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest):
        eng = _engine(state)
        text = _text(body.content, "content")
        # the prompts' rule: a text that cannot fit the context is not tokenized (the tokenizer
        # holds the GIL throughout: a 1 MiB text stalled every stream for 0.75 s)
        _fits_at_all(state, len(text), "content")

        def work():
            ids = eng.tokenizer.encode(text, add_bos=None if body.add_special else False, add_eos=False)
            if body.with_pieces:
                return {"tokens": [{"id": i, "piece": eng.tokenizer.piece_bytes(i).decode("utf-8", "replace")}
                                   for i in ids]}
            return {"tokens": ids}
        return await off_loop(state, work)

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest):
        eng = _engine(state)
        n = eng.tokenizer.vocab_size
        bad = [t for t in body.tokens if not 0 <= t < n]
        if bad:
            raise ApiError(400, f"tokens: id {bad[0]} is outside the vocabulary (0..{n - 1})", param="tokens")
        return {"content": await off_loop(state, eng.tokenizer.decode, body.tokens)}

    @app.post("/v1/chat/completions")
    async def chat(body: ChatRequest, http: HttpRequest):
        sched = state.ready()
        _check_model(state, body.model)
        messages = [_message(m, i) for i, m in enumerate(body.messages)]
        _fits_at_all(state, sum(len(m["content"]) for m in messages), "messages")
        calls = _ToolUse.of(state, body, messages)
        try:  # before the template's render (a forked process): a request refused anyway costs nothing
            sched.check_room()
        except Overloaded as e:
            raise ApiError(503, f"server overloaded: {e}", "server_error", code="overloaded") from None
        try:
            ids = await off_loop(state, state.engine.encode_chat, calls.messages, **calls.template_vars)
        except Exception as e:  # a template that fails on these messages
            raise ApiError(400, f"messages: the chat template failed: {e}", param="messages") from None
        max_tokens = body.max_completion_tokens or body.max_tokens
        logprobs = (body.top_logprobs or 0) if body.logprobs else None
        return await _run(state, sched, http, body, ids, max_tokens, logprobs, chat=True, tools=calls)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, http: HttpRequest):
        sched = state.ready()
        _check_model(state, body.model)
        tk = state.engine.tokenizer
        if isinstance(body.prompt, str):
            _fits_at_all(state, len(body.prompt), "prompt")
            ids = await off_loop(state, tk.encode, _text(body.prompt, "prompt"))
        else:
            ids = list(body.prompt)
            bad = [t for t in ids if not 0 <= t < tk.vocab_size]
            if bad:
                raise ApiError(400, f"prompt: token id {bad[0]} is outside the vocabulary", param="prompt")
        return await _run(state, sched, http, body, ids, body.max_tokens, body.logprobs, chat=False)

    return app


def _engine(state: ServerState):
    state.ready()
    return state.engine


def _text(s: str, param: str) -> str:
    """JSON may carry lone UTF-16 surrogates ("\\ud800"), which no tokenizer can encode."""
    try:
        s.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ApiError(400, f"{param}: not valid Unicode text ({e.reason} at character {e.start})", param=param) from None
    return s


def _fits_at_all(state: ServerState, chars: int, param: str) -> None:
    """Refuse a text that cannot fit the context whatever its tokens, before tokenizing it (a
    token spells at most `longest_token_chars` characters)."""
    at_least = chars // state.engine.tokenizer.longest_token_chars
    if at_least > state.scheduler.max_ctx:
        raise ApiError(400, f"{param}: {chars} characters are at least {at_least} tokens, more than the context "
                            f"size {state.scheduler.max_ctx}", param=param, code="context_length_exceeded")


def _check_model(state: ServerState, model: str | None) -> None:
    if model and model not in (state.model_id, state.model_id + ".gguf"):
        raise ApiError(404, f"model {model!r} does not exist (this server runs {state.model_id!r})",
                       param="model", code="model_not_found")


async def _run(state: ServerState, sched: Scheduler, http: HttpRequest, body, ids: list[int],
               max_tokens: int | None, logprobs: int | None, chat: bool, tools: "_ToolUse | None" = None):
    if not ids:
        raise ApiError(400, "prompt: empty prompt, nothing to condition on", param="prompt")
    room = sched.max_ctx - len(ids)
    if room < 1 or (max_tokens is not None and max_tokens > room):
        want = max_tokens or 1
        raise ApiError(400, f"the prompt ({len(ids)} tokens) plus max_tokens ({want}) exceeds the context size "
                            f"{sched.max_ctx}", param="max_tokens" if room >= 1 else "messages" if chat else "prompt",
                       code="context_length_exceeded")
    constraint = await _constraint(state, body, tools.grammar if tools else None)
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
                  logprobs, constraint)
    try:
        sched.submit(req)
    except Overloaded as e:
        raise ApiError(503, f"server overloaded: {e}", "server_error", code="overloaded") from None
    except ValueError as e:
        raise ApiError(400, str(e)) from None
    except RuntimeError as e:
        raise ApiError(500, f"the engine failed: {e}", "server_error") from None
    rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
    fmt = _Format(state, rid, chat, logprobs is not None, state.engine.tokenizer,
                  tools.parser() if tools else None)
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        return StreamingResponse(_stream(req, events, fmt, include_usage, http), media_type="text/event-stream",
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


WORK_THREADS = 2  # per-request CPU work (tokenizing, templates, grammars) running at once


async def off_loop(state: "ServerState", fn, *args, **kwargs):
    """fn(*args, **kwargs) in a worker thread, at most WORK_THREADS at a time (the event loop,
    hence every stream and /health, goes on meanwhile)."""
    if state.work_limiter is None:  # made on the event loop that uses it
        state.work_limiter = anyio.CapacityLimiter(WORK_THREADS)
    return await anyio.to_thread.run_sync(functools.partial(fn, *args, **kwargs), limiter=state.work_limiter)


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


def _message(m, i: int) -> dict:
    """A chat message as the template and tool_calls.prepare take it."""
    out = {"role": m.role, "content": _text(m.text(), "messages")}
    if m.tool_calls:
        out["tool_calls"] = [{"id": c.id or "", "type": "function",
                              "function": {"name": c.function.name, "arguments": c.function.arguments}}
                             for c in m.tool_calls]
    if m.tool_call_id is not None:
        out["tool_call_id"] = m.tool_call_id
    if m.name is not None:
        out["name"] = m.name
    return out


def _control_token(tk, text: str) -> int | None:
    """The id of the control token spelled `text` (a grammar names it by id), or None."""
    i = next((i for i, t in enumerate(tk.tokens) if t == text), None)
    return i if i is not None and tk.is_special(i) else None


def _choice(choice):
    return choice.model_dump() if hasattr(choice, "model_dump") else choice


class _ToolUse:
    """A chat request's tools: the messages and variables its template gets, the grammar a
    required call needs, and a parser of the calls in the reply (coordinator/serve/tool_calls.py)."""

    def __init__(self, messages: list[dict], template_vars: dict, style: str, tools: list, grammar: str | None):
        self.messages, self.template_vars, self.style, self.tools, self.grammar = \
            messages, template_vars, style, tools, grammar

    @classmethod
    def of(cls, state: ServerState, body, messages: list[dict]) -> "_ToolUse":
        history = any(m["role"] == "tool" or m.get("tool_calls") for m in messages)
        if not body.tools and not history:
            return cls(messages, {}, "hermes", [], None)
        try:
            every = tool_calls.parse_tools([t.model_dump() for t in body.tools or []])
            offered, must = tool_calls.chosen(every, _choice(body.tool_choice) if body.tools else "none")
            # every tool is shown whatever the choice: the prompt stays the same from turn to turn,
            # so the next turn reuses its KV cache; the choice decides what is parsed or required
            shaped, variables, style = tool_calls.prepare(messages, every, state.engine.chat_template)
            grammar = None
            if must:
                opener = _control_token(state.engine.tokenizer, tool_calls.MISTRAL_OPEN) if style == "mistral" else None
                grammar = tool_calls.call_grammar(style, offered, body.parallel_tool_calls, opener)
        except tool_calls.ToolError as e:
            raise ApiError(400, str(e), param=str(e).split(":")[0]) from None
        return cls(shaped, variables, style, offered, grammar)

    def parser(self) -> "tool_calls.CallParser | None":
        return tool_calls.CallParser(self.style, self.tools) if self.tools else None


async def _stream(req: Request, events: asyncio.Queue, fmt: "_Format", include_usage: bool, http: HttpRequest):
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
                text, calls = fmt.split_calls(ev.text)
                yield sse(fmt.chunk(text, [ev], None))
                for c in calls:
                    yield sse(fmt.call_chunk(c))
            elif isinstance(ev, DoneEvent):
                text, calls = fmt.split_calls(ev.text, final=True)
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


class _Format:
    """OpenAI's response objects for one request."""

    def __init__(self, state: ServerState, rid: str, chat: bool, logprobs: bool, tokenizer,
                 calls: "tool_calls.CallParser | None" = None):
        self.model, self.rid, self.chat, self.logprobs, self.tk = state.model_id, rid, chat, logprobs, tokenizer
        self.created = int(time.time())
        self.offset = 0  # completions' text_offset: characters of the tokens before
        self.calls = calls  # finds tool calls in the reply, where the request offered tools

    def split_calls(self, text: str, final: bool = False) -> tuple[str, list]:
        """(content to send, tool calls completed) of the reply's next text."""
        if self.calls is None:
            return text, []
        return self.calls.finish(text) if final else self.calls.feed(text)

    def finish_reason(self, done: DoneEvent) -> str:
        if self.calls is not None and self.calls.calls and done.reason == "stop":  # cut short: "length"
            return "tool_calls"
        return done.reason if done.reason != "cancelled" else "stop"

    def call_chunk(self, call) -> dict:
        index = self.calls.calls.index(call)
        return self.chunk({"tool_calls": [call.as_openai(index)]}, None, None)

    def _piece(self, tok: int) -> tuple[str, list[int]]:
        b = self.tk.piece_bytes(tok) if not self.tk.is_special(tok) else self.tk.tokens[tok].encode()
        return b.decode("utf-8", "replace"), list(b)

    def _logprobs(self, infos: list[TokenEvent]):
        if not self.logprobs or not infos:
            return None
        if self.chat:
            content = []
            for ev in infos:
                s, b = self._piece(ev.token)
                top = [{"token": (p := self._piece(t))[0], "logprob": lp, "bytes": p[1]} for t, lp in (ev.top or [])]
                content.append({"token": s, "logprob": ev.logprob, "bytes": b, "top_logprobs": top})
            return {"content": content}
        tokens, lps, tops, offsets = [], [], [], []
        for ev in infos:
            s = self._piece(ev.token)[0]
            tokens.append(s)
            lps.append(ev.logprob)
            tops.append({self._piece(t)[0]: lp for t, lp in (ev.top or [])})
            offsets.append(self.offset)
            self.offset += len(s)
        return {"tokens": tokens, "token_logprobs": lps, "top_logprobs": tops, "text_offset": offsets}

    def _usage(self, done: DoneEvent) -> dict:
        return {"prompt_tokens": done.prompt_tokens, "completion_tokens": done.completion_tokens,
                "total_tokens": done.prompt_tokens + done.completion_tokens,
                "prompt_tokens_details": {"cached_tokens": done.cached_tokens}}

    def chunk(self, delta, infos, finish: str | None) -> dict:
        if self.chat:
            d = delta if isinstance(delta, dict) else ({"content": delta} if delta else {})
            choice = {"index": 0, "delta": d, "logprobs": self._logprobs(infos) if infos else None,
                      "finish_reason": finish}
            return {"id": self.rid, "object": "chat.completion.chunk", "created": self.created, "model": self.model,
                    "choices": [choice]}
        choice = {"index": 0, "text": delta, "logprobs": self._logprobs(infos) if infos else None,
                  "finish_reason": finish}
        return {"id": self.rid, "object": "text_completion", "created": self.created, "model": self.model,
                "choices": [choice]}

    def usage_chunk(self, done: DoneEvent) -> dict:
        obj = "chat.completion.chunk" if self.chat else "text_completion"
        return {"id": self.rid, "object": obj, "created": self.created, "model": self.model, "choices": [],
                "usage": self._usage(done)}

    def whole(self, text: str, infos: list[TokenEvent], done: DoneEvent) -> dict:
        text, calls = self.split_calls(text, final=True)
        reason = self.finish_reason(done)
        if self.chat:
            message = {"role": "assistant", "content": text}
            if calls:
                message = {"role": "assistant", "content": text or None,
                           "tool_calls": [c.as_openai() for c in calls]}
            choice = {"index": 0, "message": message,
                      "logprobs": self._logprobs(infos), "finish_reason": reason}
            obj = "chat.completion"
        else:
            choice = {"index": 0, "text": text, "logprobs": self._logprobs(infos), "finish_reason": reason}
            obj = "text_completion"
        return {"id": self.rid, "object": obj, "created": self.created, "model": self.model, "choices": [choice],
                "usage": self._usage(done)}


def _room_for_connections() -> None:
    """One file descriptor per connection: raise the soft limit (often 1024) toward the hard one
    so MAX_CONNECTIONS open connections, the workers' sockets and the model's files all fit."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = 4 * MAX_CONNECTIONS
    if soft != resource.RLIM_INFINITY and soft < want:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (want if hard == resource.RLIM_INFINITY else min(want, hard), hard))
        except (ValueError, OSError):
            pass


def bind(host: str, port: int) -> socket.socket:
    """The listening socket, bound now: a taken port is one clear error before the model loads."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror as e:
        raise OSError(f"cannot resolve host {host!r}: {e.strerror}") from None
    family, _, _, _, addr = infos[0]
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.bind(addr)
    except OSError as e:
        sock.close()
        raise OSError(f"cannot listen on {host}:{port}: {e.strerror}") from None
    sock.listen(128)
    sock.set_inheritable(False)
    return sock


def serve(load_engine: Callable[[], object], model_path: str, host: str = "127.0.0.1", port: int = 8080,
          api_key: str | None = None, parallel: int = 4, queue: int = 16, ready_file: str | None = None,
          header_timeout: float = HEADER_TIMEOUT_S, shutdown_grace: float = 5.0, on_worker_death: str = "restart",
          restart_window: float = 60.0, body_timeout: float = BODY_TIMEOUT_S) -> None:
    """Bind, load the engine on a thread (health says "loading" meanwhile), serve until SIGINT
    or SIGTERM, then stop the scheduler and close the engine (its workers and shared memory)."""
    import uvicorn

    sock = bind(host, port)
    bound_port = sock.getsockname()[1]
    _room_for_connections()
    # The scheduler thread spins (holding the GIL) while workers compute; the HTTP thread then
    # gets the GIL only when the interpreter forces a switch. 5 ms by default: a disconnect took
    # ~100 decode steps to notice on a tiny model. 0.5 ms keeps the event loop responsive.
    sys.setswitchinterval(0.0005)
    state = ServerState(model_id=Path(model_path).name.removesuffix(".gguf"))
    closing = threading.Event()

    def fail(msg: str) -> None:  # for good: one line, and the server exits non-zero (a supervisor's turn)
        state.status, state.error, state.exit_status = "error", msg, 1
        print(f"error: {msg}", file=sys.stderr, flush=True)
        server.should_exit = True

    def load():
        """Load the engine and serve from it; when a worker dies, restart the engine (its in-flight
        requests have failed; /health says "recovering" meanwhile), unless that happened within
        the last `restart_window` seconds or `on_worker_death` is "exit". Workers die with the
        thread that started them (their parent-death signal follows the creating thread, not
        the process): this thread lives until the server closes."""
        last_death = None
        while True:
            try:
                eng = load_engine()
            except BaseException as e:  # the model could not load: health says why, requests get 500
                state.status, state.error = "error", str(e) or type(e).__name__
                print(f"error: {state.error}", file=sys.stderr, flush=True)
                if last_death is not None:  # a restart that could not load: the supervisor's turn
                    fail(f"the engine could not be restarted: {state.error}")
                return
            if closing.is_set():
                eng.close()
                return
            state.engine = eng
            state.scheduler = Scheduler(eng, parallel, queue).start()
            state.status = "ok"
            if last_death is None:
                print(f"sparseinfer serving {state.model_id} on http://{host}:{bound_port}/v1 "
                      f"({parallel} parallel sequences)", file=sys.stderr, flush=True)
            while not closing.wait(0.1) and state.scheduler.error is None:
                pass
            error = state.scheduler.error
            state.scheduler.stop()
            eng.close()
            if closing.is_set() and error is None:
                return
            now = time.monotonic()
            if on_worker_death == "exit" or (last_death is not None and now - last_death < restart_window):
                why = "" if on_worker_death == "exit" else f" (the second within {restart_window:g} s)"
                fail(f"{error}{why}: exiting")
                return
            last_death = now
            state.status = "recovering"
            print(f"error: {error}: restarting the engine's workers", file=sys.stderr, flush=True)

    loader = threading.Thread(target=load, name="engine-loader", daemon=True)
    # on SIGTERM uvicorn stops accepting and lets running requests (streams) finish for up to
    # shutdown_grace seconds; then the engine closes
    config = uvicorn.Config(BodyLimit(create_app(state, api_key), seconds=body_timeout), log_level="warning",
                            timeout_graceful_shutdown=shutdown_grace,
                            lifespan="off", http=header_timeout_protocol(header_timeout),
                            limit_concurrency=MAX_CONNECTIONS)
    server = uvicorn.Server(config)
    reaper = None
    if ready_file:
        ready_file = str(Path(ready_file).resolve())
        partial = ready_file + ".part"
        reaper = start_reaper(None, None, files=(ready_file, partial))  # removes them if we are killed (kill -9)
        # whole or absent: a reader that sees the file also sees the address in it
        Path(partial).write_text(f"http://{host}:{bound_port}\n")
        os.replace(partial, ready_file)
    loader.start()
    try:
        server.run(sockets=[sock])
    finally:
        closing.set()  # the loader thread stops the scheduler and closes the engine
        loader.join()
        sock.close()
        if ready_file:
            Path(ready_file).unlink(missing_ok=True)
            os.close(reaper)
    if state.exit_status:
        sys.exit(state.exit_status)
