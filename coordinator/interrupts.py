"""How the coordinator process is stopped: SIGTERM and SIGINT both raise KeyboardInterrupt in the
main thread, so `with Engine(...)` blocks unwind and shut the workers down and free the shared
memory whichever way the process is asked to stop (Ctrl-C, `kill`, `kill -INT`)."""
from __future__ import annotations

import signal


def _raise_interrupt(signum, frame):
    raise KeyboardInterrupt


def stop_on_signals() -> None:
    """Install the handlers (main thread only). SIGINT is set explicitly too: a process started as
    a background job inherits SIGINT ignored, and Python then leaves it ignored."""
    signal.signal(signal.SIGTERM, _raise_interrupt)
    signal.signal(signal.SIGINT, signal.default_int_handler)
