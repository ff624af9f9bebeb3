"""scripts/launch keeps a coordinator serving; `sparseinfer prompt` streams replies from it."""
from __future__ import annotations

import contextlib
import signal
import subprocess
import sys
import time

import pytest

from tests.conftest import REPO, children_of

PROMPT = "the lazy dog"


def _run(args, **kw):
    return subprocess.run([sys.executable, "-m", "coordinator", *args], capture_output=True, text=True,
                          timeout=120, cwd=REPO, **kw)


@contextlib.contextmanager
def _server(model, tmp_path, **popen_kw):
    """scripts/launch serving `model`, ready; yields (process, endpoint) and kills it if still running."""
    endpoint = f"ipc://{tmp_path}/front.sock"
    ready = tmp_path / "ready"
    server = subprocess.Popen([sys.executable, str(REPO / "scripts" / "launch"), "-m", str(model),
                               "--endpoint", endpoint, "--ready-file", str(ready), "-t", "2", "--cpu-workers", "1"],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **popen_kw)
    try:
        deadline = time.monotonic() + 90
        while not ready.exists():
            assert server.poll() is None, server.stderr.read()
            assert time.monotonic() < deadline, "server did not become ready"
            time.sleep(0.1)
        yield server, endpoint
    finally:
        if server.poll() is None:
            server.kill()
            server.wait()


def _assert_gone(workers: list[int]) -> None:
    """Workers (and the resource tracker) exit right after the coordinator; allow them a moment."""
    deadline = time.monotonic() + 5
    while [p for p in workers if _alive(p)] and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not [p for p in workers if _alive(p)]


def test_launch_prompt_matches_generate_then_stops_cleanly(tiny_model, tmp_path, no_leaks):
    with _server(tiny_model, tmp_path) as (server, endpoint):
        workers = children_of(server.pid)
        assert len(workers) >= 2  # coordinator started its GPU and CPU workers as processes

        common = ["-p", PROMPT, "-n", "10", "--ignore-eos"]
        served = [_run(["prompt", *common, "--endpoint", endpoint]) for _ in range(2)]
        for r in served:
            assert r.returncode == 0, r.stderr
        direct = _run(["generate", "-m", str(tiny_model), *common, "--no-stats", "-t", "2"])
        assert direct.returncode == 0, direct.stderr
        assert served[0].stdout == served[1].stdout == direct.stdout
        assert served[0].stdout.startswith(PROMPT) and len(served[0].stdout) > len(PROMPT)

        bad = _run(["prompt", "-p", "x", "--top-p", "0", "--endpoint", endpoint])
        assert bad.returncode == 1 and "top-p" in bad.stderr  # bad request: error, server survives

        stop = _run(["prompt", "-p", "x", "-n", "1", "--endpoint", endpoint, "--stop-server"])
        assert stop.returncode == 0, stop.stderr
        assert server.wait(timeout=15) == 0
        _assert_gone(workers)


def _ignore_sigint():
    signal.signal(signal.SIGINT, signal.SIG_IGN)


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_signals_stop_the_server_cleanly_even_started_as_a_background_job(tiny_model, tmp_path, no_leaks, signum):
    """SIGTERM and SIGINT both stop the coordinator and its workers, also when it was started with
    SIGINT ignored, as a shell's background job is (`kill -INT` and Ctrl-C after `fg` still work)."""
    with _server(tiny_model, tmp_path, preexec_fn=_ignore_sigint) as (server, _):
        workers = children_of(server.pid)
        server.send_signal(signum)
        assert server.wait(timeout=30) == 130
        assert "interrupted" in server.stderr.read()
        _assert_gone(workers)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_prompt_without_server_fails_clearly(tmp_path):
    r = _run(["prompt", "-p", "x", "--endpoint", f"ipc://{tmp_path}/none.sock", "--timeout", "1"])
    assert r.returncode == 1
    assert "no reply from the coordinator" in r.stderr and "Traceback" not in r.stderr
