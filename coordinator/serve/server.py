"""The OpenAI-compatible HTTP server: `serve` runs the FastAPI app (app.py) on uvicorn over the
continuous-batching `Scheduler` (coordinator/runtime/batching.py).

The socket is bound before the model loads (a taken port fails at once, in one line); the
engine loads on a thread while /health answers 503 "loading"; requests then go to the
scheduler's slots, and a client that goes away cancels its sequence. A worker that dies
restarts the engine (or ends the server, for a supervisor), and SIGTERM lets running streams
finish first.
"""
from __future__ import annotations

import os
import socket
import sys
import threading
import time
from pathlib import Path
from typing import Callable

from ..runtime.batching import Scheduler
from ..runtime.reaper import start_reaper
from .app import create_app
from .limits import BODY_TIMEOUT_S, HEADER_TIMEOUT_S, MAX_CONNECTIONS, BodyLimit, room_for_connections
from .state import ServerState
from .thinking import ReasoningDefaults
from .uvicorn_protocol import header_timeout_protocol


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
          restart_window: float = 60.0, body_timeout: float = BODY_TIMEOUT_S,
          reasoning: ReasoningDefaults | None = None) -> None:
    """Bind, load the engine on a thread (health says "loading" meanwhile), serve until SIGINT
    or SIGTERM, then stop the scheduler and close the engine (its workers and shared memory)."""
    import uvicorn

    sock = bind(host, port)
    bound_port = sock.getsockname()[1]
    room_for_connections()
    # The scheduler thread spins (holding the GIL) while workers compute; the HTTP thread then
    # gets the GIL only when the interpreter forces a switch. 5 ms by default: a disconnect took
    # ~100 decode steps to notice on a tiny model. 0.5 ms keeps the event loop responsive.
    sys.setswitchinterval(0.0005)
    state = ServerState(model_id=Path(model_path).name.removesuffix(".gguf"), reasoning=reasoning or ReasoningDefaults())
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
