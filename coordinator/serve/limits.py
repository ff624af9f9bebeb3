"""What bounds a client: a request body's size and time (`BodyLimit`, ASGI middleware), the
open connections (MAX_CONNECTIONS, and the file descriptors they need), and the time a
connection has to send its headers (HEADER_TIMEOUT_S: uvicorn_protocol.py enforces it)."""
from __future__ import annotations

import asyncio
import resource

from .state import error_body

MAX_BODY_BYTES = 8 << 20  # a request body beyond this is refused before it is parsed
HEADER_TIMEOUT_S = 10.0  # a connection's time to deliver a request's headers (idle and slowloris ones)
BODY_TIMEOUT_S = 30.0  # a request's time to deliver its body once its headers are in
MAX_CONNECTIONS = 512  # open connections and running requests; beyond them uvicorn answers 503


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


def room_for_connections() -> None:
    """One file descriptor per connection: raise the soft limit (often 1024) toward the hard one
    so MAX_CONNECTIONS open connections, the workers' sockets and the model's files all fit."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = 4 * MAX_CONNECTIONS
    if soft != resource.RLIM_INFINITY and soft < want:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (want if hard == resource.RLIM_INFINITY else min(want, hard), hard))
        except (ValueError, OSError):
            pass
