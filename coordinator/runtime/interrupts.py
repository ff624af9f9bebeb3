"""How the coordinator process is stopped: SIGTERM and SIGINT both raise KeyboardInterrupt in the
main thread, so `with Engine(...)` blocks unwind and shut the workers down and free the shared
memory whichever way the process is asked to stop (Ctrl-C, `kill`, `kill -INT`).

A handler runs wherever the main thread happens to be, and a library can swallow what it
raises: a Ctrl-C that landed in an import's abc.__subclasscheck__ under a C-level isinstance
was lost and the run went on to its end (seen in tests/test_cli_validation.py). So the signal is
also remembered, and long loops call `raise_if_interrupted` between steps."""
from __future__ import annotations

import signal

_pending = False  # a SIGINT or SIGTERM arrived and no one has handled its KeyboardInterrupt yet
_last = None  # the last stop signal that arrived (the exit status depends on which)


def _raise_interrupt(signum, frame):
    global _pending, _last
    _pending, _last = True, signum
    raise KeyboardInterrupt


def exit_status(command: str | None) -> int:
    """The status a process stopped by a signal exits with: a server asked to stop by SIGTERM (a
    service manager's stop) 0, as a clean stop; any other command stopped by SIGTERM 143 and by
    SIGINT (Ctrl-C) 130, the shells' 128 + signal number."""
    if _last == signal.SIGTERM:
        return 0 if command == "serve" else 128 + signal.SIGTERM
    return 128 + signal.SIGINT


def raise_if_interrupted() -> None:
    """Raise KeyboardInterrupt if a stop signal arrived whose exception may have been swallowed."""
    if _pending:
        raise KeyboardInterrupt


def pending() -> bool:
    """Whether a stop signal arrived whose KeyboardInterrupt no one has handled: another error
    raised meanwhile may be that interrupt wrapped by a library (a class body's dataclass fields:
    dataclasses' __set_name__ re-raises it as a RuntimeError)."""
    return _pending


def clear() -> None:
    """A KeyboardInterrupt was handled (the chat REPL stops a reply and goes on)."""
    global _pending
    _pending = False


def stop_on_signals() -> None:
    """Install the handlers (main thread only). SIGINT is set explicitly too: a process started as
    a background job inherits SIGINT ignored, and Python then leaves it ignored."""
    signal.signal(signal.SIGTERM, _raise_interrupt)
    signal.signal(signal.SIGINT, _raise_interrupt)
