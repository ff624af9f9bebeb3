"""What the server's parts share: `ServerState` (the engine, the scheduler, the status /health
reports), `ApiError` and OpenAI's error body, and `off_loop`, which runs a request's CPU work
off the event loop."""
from __future__ import annotations

import functools
import time
from dataclasses import dataclass, field

import anyio
import anyio.to_thread
from fastapi.responses import JSONResponse

from ..runtime.batching import Scheduler


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
    reasoning: object = None  # coordinator.serve.thinking.ReasoningDefaults: --reasoning-format, --reasoning-budget

    def ready(self) -> Scheduler:
        if self.status == "ok" and self.scheduler is not None and self.scheduler.error is not None:
            self.status = "recovering"  # the loader thread sees the same error and restarts the engine
        if self.status in ("loading", "recovering"):
            raise ApiError(503, f"the model is {self.status}", "unavailable_error", code=self.status)
        if self.status != "ok":
            raise ApiError(500, f"the engine failed: {self.error}", "server_error")
        return self.scheduler


WORK_THREADS = 2  # per-request CPU work (tokenizing, templates, grammars) running at once


async def off_loop(state: "ServerState", fn, *args, **kwargs):
    """fn(*args, **kwargs) in a worker thread, at most WORK_THREADS at a time (the event loop,
    hence every stream and /health, goes on meanwhile)."""
    if state.work_limiter is None:  # made on the event loop that uses it
        state.work_limiter = anyio.CapacityLimiter(WORK_THREADS)
    return await anyio.to_thread.run_sync(functools.partial(fn, *args, **kwargs), limiter=state.work_limiter)
