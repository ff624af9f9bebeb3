"""The chat-template renderer: one small long-lived process that renders templates for this
process, so a hostile template's cost (time, memory) lands there, never here, and a request
does not pay for forking a large process (88 ms for the 370 MB server, a copy of its page
tables each time).

The child (`python -m coordinator.text.template_renderer`) imports only jinja2 and msgpack, caps its
address space at start (its size then plus RENDER_MEMORY_BYTES: a memory bomb becomes a
MemoryError, after which it answers and exits so the next render gets a fresh one), ignores
Ctrl-C (the parent's to handle) and exits when its stdin closes or its parent is gone. Requests and
replies are msgpack frames (4-byte length, then the bytes) on its stdin and stdout; nothing in
them is executed. The parent (`Renderer`) sends one render at a time, waits at most
RENDER_SECONDS for the answer, and kills and replaces a child that is late or gone.
"""
from __future__ import annotations

import atexit
import os
import select
import signal
import struct
import subprocess
import sys
import threading
import time

import msgpack

_HEADER = struct.Struct("<I")
MAX_FRAME = 64 << 20  # a request's messages are bounded by the API's body limit; a reply by MAX_OUTPUT_CHARS


class RendererGone(Exception):
    """The child died or broke the protocol (the caller reports it as a template error)."""


class RendererLate(Exception):
    """The child did not answer within the deadline: it was killed."""


def _frame(obj) -> bytes:
    data = msgpack.packb(obj)
    return _HEADER.pack(len(data)) + data


class Renderer:
    """The parent's side: one child, started on first use, replaced when it is killed or dies."""

    def __init__(self):
        self._proc: subprocess.Popen | None = None
        self._lock = threading.Lock()
        self.started = 0  # children started so far (tests count them)

    def render(self, source: str, variables: dict, seconds: float, memory_bytes: int) -> dict:
        """The child's reply: {"ok": text} or {"error": reason, ...}. Raises RendererLate,
        RendererGone."""
        with self._lock:
            proc = self._child(memory_bytes)
            try:
                proc.stdin.write(_frame({"source": source, "variables": variables}))
                proc.stdin.flush()
            except (BrokenPipeError, OSError):
                self._discard()
                raise RendererGone("the renderer ended without an answer") from None
            try:
                reply = self._read(proc, time.monotonic() + seconds)
            except (RendererLate, RendererGone):  # late or broken: the next render gets a new child
                self._discard()
                raise
            if reply.get("restart"):  # it ran out of memory: the next render gets a fresh child
                self._discard()
            return reply

    def close(self) -> None:
        with self._lock:
            self._discard()

    def _child(self, memory_bytes: int) -> subprocess.Popen:
        if self._proc is None or self._proc.poll() is not None:
            self._discard()
            self._proc = subprocess.Popen(
                [sys.executable, "-m", "coordinator.text.template_renderer", str(memory_bytes)],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))), close_fds=True)
            self.started += 1
        return self._proc

    def _read(self, proc: subprocess.Popen, deadline: float) -> dict:
        fd = proc.stdout.fileno()
        buf = b""
        need = _HEADER.size
        size = None
        while len(buf) < need:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([fd], [], [], left)[0]:
                raise RendererLate()
            chunk = os.read(fd, min(1 << 20, need - len(buf)))
            if not chunk:
                raise RendererGone("the renderer ended without an answer")
            buf += chunk
            if size is None and len(buf) >= _HEADER.size:
                size = _HEADER.unpack(buf[:_HEADER.size])[0]
                if size > MAX_FRAME:
                    raise RendererGone("the renderer's answer is too large")
                need = _HEADER.size + size
        try:
            reply = msgpack.unpackb(buf[_HEADER.size:])
        except Exception:
            reply = None
        if not isinstance(reply, dict):
            raise RendererGone("the renderer's answer does not parse")
        return reply

    def _discard(self) -> None:
        proc, self._proc = self._proc, None
        if proc is None:
            return
        if proc.poll() is None:
            proc.kill()
        proc.wait()
        for f in (proc.stdin, proc.stdout):
            try:
                f.close()
            except OSError:
                pass


_RENDERER: Renderer | None = None
_RENDERER_LOCK = threading.Lock()


def renderer() -> Renderer:
    global _RENDERER
    with _RENDERER_LOCK:
        if _RENDERER is None:
            _RENDERER = Renderer()
            atexit.register(_RENDERER.close)
        return _RENDERER


# ---- the child ------------------------------------------------------------------------------

def _die_with_parent(parent: int) -> None:
    """Exit when the parent process is gone. Its death closes our stdin (EOF ends the loop);
    this watch covers a pipe end some other process still holds. (Not PR_SET_PDEATHSIG: that
    follows the thread that started us, and the server starts us from a pool thread that may
    end while the server serves on.)"""
    def watch():
        while True:
            time.sleep(1.0)
            if os.getppid() != parent:
                os._exit(0)
    threading.Thread(target=watch, name="parent-watch", daemon=True).start()


def _read_exact(fd: int, n: int) -> bytes | None:
    buf = b""
    while len(buf) < n:
        chunk = os.read(fd, n - len(buf))
        if not chunk:
            return None
        buf += chunk
    return buf


def main(memory_bytes: int) -> None:
    import resource

    from .chat_template import serve_one
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    parent = os.getppid()
    _die_with_parent(parent)
    with open("/proc/self/statm") as f:
        limit = int(f.read().split()[0]) * os.sysconf("SC_PAGE_SIZE") + memory_bytes
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    if hard == resource.RLIM_INFINITY or limit < hard:
        resource.setrlimit(resource.RLIMIT_AS, (limit, hard))
    fin, fout = sys.stdin.fileno(), sys.stdout.fileno()
    while os.getppid() == parent:
        head = _read_exact(fin, _HEADER.size)
        if head is None:
            return
        (size,) = _HEADER.unpack(head)
        if size > MAX_FRAME:
            return
        body = _read_exact(fin, size)
        if body is None:
            return
        reply = serve_one(msgpack.unpackb(body))
        data = _frame(reply)
        view = memoryview(data)
        while view:
            view = view[os.write(fout, view):]
        if reply.get("restart"):
            return


if __name__ == "__main__":
    main(int(sys.argv[1]))
