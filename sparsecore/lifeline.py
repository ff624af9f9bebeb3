"""How a worker process follows its coordinator's life: it must never outlive it.

Two mechanisms, because neither covers every case: PR_SET_PDEATHSIG has Linux SIGKILL us when
the parent dies (after it is set), and the coordinator's pid, passed in the environment, lets a
worker that was still importing when the coordinator died notice it (it was re-parented before
it could set the signal).
"""
from __future__ import annotations

import ctypes
import os
import signal

from protocol.addresses import COORDINATOR_PID_ENV


def die_with_parent() -> None:
    """Ask Linux to SIGKILL this process when its parent dies."""
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:
        pass


def coordinator_pid() -> int | None:
    try:
        return int(os.environ[COORDINATOR_PID_ENV])
    except (KeyError, ValueError):
        return None


def process_gone(pid: int) -> bool:
    """True when `pid` no longer runs (exited, or a zombie waiting to be reaped)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except FileNotFoundError:
        return True
    except (OSError, IndexError):
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        except PermissionError:
            pass
        return False


class Lifeline:
    """Remembers who started us; `gone()` says whether they have died since."""

    def __init__(self):
        self.ppid = os.getppid()
        self.coordinator = coordinator_pid()

    def gone(self) -> bool:
        if os.getppid() != self.ppid:
            return True
        return self.coordinator is not None and process_gone(self.coordinator)
