"""Where processes find each other: ipc:// sockets in a private (0700) directory by default."""
from __future__ import annotations

import os
import secrets
import tempfile
from pathlib import Path


def private_runtime_dir() -> Path:
    """A fresh 0700 directory for this run's ipc sockets."""
    return Path(tempfile.mkdtemp(prefix="sparseinfer-"))


def worker_endpoint(run_dir: Path, transport: str = "ipc") -> str:
    if transport == "tcp":
        return "tcp://127.0.0.1:*"  # bound with a random port; read back with LAST_ENDPOINT
    return f"ipc://{run_dir}/workers.sock"


# The coordinator's pid, passed to workers in the environment so a worker that was still
# starting when the coordinator died (before PR_SET_PDEATHSIG was set) notices and exits.
COORDINATOR_PID_ENV = "SPARSEINFER_COORDINATOR_PID"
