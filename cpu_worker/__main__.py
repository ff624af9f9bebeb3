"""The CPU worker process: arguments, signals, parent death, exit. Its logic is worker.py.

    python -m cpu_worker --endpoint E --worker-id N
"""
from __future__ import annotations

import argparse
import os
import signal
import sys
from typing import Callable

from cpu_worker.worker import Worker, cpu_device
from sparsecore.lifeline import coordinator_pid, die_with_parent, process_gone


def main(role: str = "cpu", pick_device: Callable[[str], object] = cpu_device, argv=None) -> int:
    """Run one worker as the whole program of this process; ends it with os._exit."""
    ap = argparse.ArgumentParser(prog=f"{role}_worker")
    ap.add_argument("--endpoint", required=True)
    ap.add_argument("--worker-id", type=int, required=True)
    args = ap.parse_args(argv)
    # Ctrl-C goes to the whole process group; the coordinator decides when workers stop.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    die_with_parent()
    coordinator = coordinator_pid()
    if coordinator is not None and process_gone(coordinator):
        return 1  # it died before PR_SET_PDEATHSIG was in place: nobody is waiting for us
    w = Worker(args.endpoint, args.worker_id, role, pick_device)
    try:
        rc = w.serve()
    finally:
        w.close()
    # Sockets and shared memory are closed; skip the interpreter's teardown, which with torch
    # loaded takes from 0.3 s to well over a second on a busy machine and holds up the
    # coordinator's shutdown (multiprocessing's children end with os._exit the same way).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(rc)


if __name__ == "__main__":
    sys.exit(main())
