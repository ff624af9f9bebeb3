"""When the per-layer exchange may spin on shared-memory doorbell words instead of sleeping.

A sleeping process needs a system call and a wake-up to hear from another; on a virtual machine
that costs about 0.2 ms median and milliseconds at the tail (measured: a ZeroMQ ping-pong of
195 us median, 2 ms p99), against about 2 us for a spin on a shared word. Thirty layers a token
make that the difference between a fast engine and a slow one. Spinning is only sound where
stores are seen in program order by other cores (x86-TSO): elsewhere the pool uses messages.
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

