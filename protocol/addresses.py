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


# The path of a 0600 file in the run's private directory holding the run's secret, which a
# worker sends in its Hello: another local process that reaches the worker socket (tcp is open
# to every local user) cannot pass for a worker, so it cannot end or disturb the run.
SECRET_FILE_ENV = "SPARSEINFER_SECRET_FILE"


def write_secret(run_dir: Path) -> tuple[str, Path]:
    """A fresh random secret, written to run_dir/secret with mode 0600 (created so, never wider)."""
    secret = secrets.token_hex(32)
    path = run_dir / "secret"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(secret)
    return secret, path


def read_secret() -> str:
    """The run's secret from the file named in the environment; "" when there is none."""
    path = os.environ.get(SECRET_FILE_ENV)
    if not path:
        return ""
    try:
        with open(path) as f:
            return f.read(256).strip()
    except OSError:
        return ""


# The coordinator's pid, passed to workers in the environment so a worker that was still
# starting when the coordinator died (before PR_SET_PDEATHSIG was set) notices and exits.
COORDINATOR_PID_ENV = "SPARSEINFER_COORDINATOR_PID"
