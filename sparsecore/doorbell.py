"""How the per-layer exchange waits: spinning on shared-memory doorbell words, or sleeping on a
wake pipe.

A sleeping process needs a system call and a wake-up to hear from another. Through ZeroMQ that
costs about 0.2 ms median and milliseconds at the tail on a virtual machine (a ZeroMQ ping-pong
of 195 us median, 2 ms p99: each message hops through ZeroMQ's I/O thread), against about 2 us
for a spin on a shared word and 8 us for a round trip over a pipe (one wake-up each way).
Thirty layers a token make that the difference between a fast engine and a slow one. Spinning
needs a core per spinner and is only sound where stores are seen in program order by other
cores (x86-TSO); sleeping on a pipe needs neither, so it is what every process does once it
stops spinning. A wake pipe is a named FIFO in the run's private directory: the sleeper polls
it (beside its socket), the waker writes one byte.
"""
from __future__ import annotations

import os
import platform

WORKER_SPIN_US = 50_000  # a worker spins this long for the next step (covers lm_head + sampling)
COORDINATOR_SPIN_US = 20_000  # the coordinator spins this long for Done before it sleeps
SOCKET_CHECK_SPINS = 256  # a spinner looks at its socket (Shutdown, WorkerFailed, Done) this often


def spin_supported() -> bool:
    return platform.machine().lower() in ("x86_64", "amd64", "i386", "i686", "x86")


def usable_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


class WakePipe:
    """One process's wake-up line: a named FIFO that others ring and its owner polls.

    Every side opens it read-write and non-blocking: opening never waits for the other end,
    a writer never gets ENXIO while the owner is still starting, and a full pipe (a sleeper
    that has not drained it yet) just drops the byte, which carries no information anyway."""

    def __init__(self, path: str):
        self.path = path
        self.fd = os.open(path, os.O_RDWR | os.O_NONBLOCK)

    @classmethod
    def create(cls, path: str) -> "WakePipe":
        os.mkfifo(path, 0o600)
        return cls(path)

    def fileno(self) -> int:
        return self.fd

    def ring(self) -> None:
        try:
            os.write(self.fd, b"\0")
        except BlockingIOError:
            pass

    def drain(self) -> None:
        try:
            while os.read(self.fd, 4096):
                pass
        except BlockingIOError:
            pass

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
