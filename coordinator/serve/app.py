"""The FastAPI app: its routes, the API key, errors in OpenAI's shape, and the chat page.

    POST /v1/chat/completions, POST /v1/completions   (stream or not; SSE ends with [DONE])
    POST /v1/messages, /v1/messages/count_tokens      (Anthropic's API: anthropic_api.py, its error shape)
    POST /v1/responses                                 (OpenAI's Responses API: responses_api.py)
    GET  /v1/models, GET /health, POST /tokenize, POST /detokenize, GET /metrics (Prometheus)
    POST /v1/embeddings (embeddings.py)

A completion request is checked and tokenized here, then run by completion.py."""
from __future__ import annotations

import hmac
import sys
from importlib.resources import files

from fastapi import FastAPI, Request as HttpRequest
from fastapi.exceptions import RequestValidationError
from fastapi.responses import HTMLResponse, JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from .api_schema import ChatRequest, CompletionRequest, DetokenizeRequest, TokenizeRequest
from .anthropic_api import add_routes as add_anthropic_routes, anthropic_error, is_anthropic
from .chat_request import prepare_chat
from .completion import check_model, checked_text, fits_at_all, run_request
from .embeddings import add_routes as add_embedding_routes
from .metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE, ServerMetrics
from .responses_api import add_routes as add_responses_routes
from .state import ApiError, ServerState, error_body as openai_error, off_loop


CHAT_PAGE_CSP = ("default-src 'none'; script-src 'unsafe-inline'; style-src 'unsafe-inline'; connect-src 'self'; "
                 "img-src data:; base-uri 'none'; form-action 'none'; frame-ancestors 'none'")

# the routes requests are counted by (coordinator/serve/metrics.py); any other path counts as "other"
ROUTES = ("/v1/chat/completions", "/v1/completions", "/v1/models", "/tokenize", "/detokenize", "/health", "/metrics",
          "/", "/v1/messages", "/v1/messages/count_tokens", "/v1/responses", "/v1/embeddings")


def create_app(state: ServerState, api_key: str | None = None) -> FastAPI:
    app = FastAPI(title="sparseinfer", docs_url=None, redoc_url=None, openapi_url=None)

    def error_body(status, message, type_, param=None, code=None, request: HttpRequest | None = None):
        """OpenAI's error shape, or Anthropic's on its routes (its clients read theirs)."""
        if request is not None and is_anthropic(request.url.path):
            return anthropic_error(status, message)
        return openai_error(status, message, type_, param, code)

    @app.exception_handler(ApiError)
    async def _api_error(request: HttpRequest, e: ApiError):
        return error_body(e.status, e.message, e.type, e.param, e.code, request=request)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: HttpRequest, e: RequestValidationError):
        ctype = request.headers.get("content-type", "")
        if request.method == "POST" and not ctype.split(";")[0].strip().lower().endswith("json"):
            return error_body(400, f"Content-Type must be application/json, not {ctype or 'none'}",
                              "invalid_request_error", request=request)
        errors = e.errors() or [{}]
        # the newer APIs' bodies are unions of block types: the deepest error names the block
        newer = is_anthropic(request.url.path) or request.url.path == "/v1/responses"
        err = max(errors, key=lambda x: len(x.get("loc", ()))) if newer else errors[0]
        loc = [str(x) for x in err.get("loc", ()) if x != "body"]
        param = ".".join(loc) or None
        msg = err.get("msg", "invalid request")
        return error_body(400, f"{param}: {msg}" if param else msg, "invalid_request_error", param, request=request)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: HttpRequest, e: StarletteHTTPException):
        return error_body(e.status_code, str(e.detail), "invalid_request_error" if e.status_code < 500 else "server_error",
                          request=request)

    @app.exception_handler(Exception)
    async def _bug(request: HttpRequest, e: Exception):  # never a traceback to the client; one line to our log
        print(f"error: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
        return error_body(500, f"internal error: {type(e).__name__}", "server_error", request=request)

    def authorized(request: HttpRequest) -> bool:
        if api_key is None:
            return True
        given = request.headers.get("authorization", "")
        # Anthropic's clients send the key as x-api-key
        return (hmac.compare_digest(given.encode(), f"Bearer {api_key}".encode())
                or hmac.compare_digest(request.headers.get("x-api-key", "").encode(), api_key.encode()))

    metrics = state.metrics = ServerMetrics(state)

    @app.middleware("http")
    async def _auth(request: HttpRequest, call_next):
        path = request.url.path
        endpoint = path if path in ROUTES else "other"  # labels stay few whatever clients ask for
        if path not in ("/health", "/") and not authorized(request):  # "/": the static chat page
            metrics.request(endpoint, 401)
            return error_body(401, "invalid API key", "authentication_error", code="invalid_api_key", request=request)
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
        text = checked_text(body.content, "content")
        # the prompts' rule: a text that cannot fit the context is not tokenized (the tokenizer
        # holds the GIL throughout: a 1 MiB text stalled every stream for 0.75 s)
        fits_at_all(state, len(text), "content")

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
        prepared = await prepare_chat(state, body)
        max_tokens = body.max_completion_tokens or body.max_tokens
        logprobs = (body.top_logprobs or 0) if body.logprobs else None
        return await run_request(state, prepared.sched, http, body, prepared.ids, max_tokens, logprobs, chat=True,
                                 tools=prepared.tools, thinking=prepared.thinking)

    add_anthropic_routes(app, state)  # POST /v1/messages, /v1/messages/count_tokens
    add_responses_routes(app, state)  # POST /v1/responses

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, http: HttpRequest):
        sched = state.ready()
        check_model(state, body.model)
        tk = state.engine.tokenizer
        if isinstance(body.prompt, str):
            fits_at_all(state, len(body.prompt), "prompt")
            ids = await off_loop(state, tk.encode, checked_text(body.prompt, "prompt"))
        else:
            ids = list(body.prompt)
            bad = [t for t in ids if not 0 <= t < tk.vocab_size]
            if bad:
                raise ApiError(400, f"prompt: token id {bad[0]} is outside the vocabulary", param="prompt")
        return await run_request(state, sched, http, body, ids, body.max_tokens, body.logprobs, chat=False)

    add_embedding_routes(app, state)
    return app


def _engine(state: ServerState):
    state.ready()
    return state.engine
