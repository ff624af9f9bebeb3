"""Faults end to end, with real processes on the tiny synthetic model.

- a bad model file gives one "error: <path>: <reason>" line, exit code 1, no traceback;
- a worker killed mid-generation is named by the coordinator, which exits;
- Ctrl-C (SIGINT to the process group) and SIGTERM stop a run cleanly (exit code 130, 143), also
  while the workers are still starting;
- a normal run, and a coordinator killed with SIGKILL (mid-generation, or while its workers
  are still importing), leave no process behind;
- a worker that fails while loading is reported by the Engine as a WorkerError naming it;
and in every case no shared-memory segment and no private runtime directory stays behind.

Every `sparseinfer generate` runs in its own session (start_new_session=True, so its session
id is its pid): all its descendants, even re-parented orphans, are found by that session id in
/proc. Each run gets its own TMPDIR, so the private runtime dir (sparseinfer-*) it creates is
checked without racing other runs on the machine. Leaked shared memory is checked by name for
segments the coordinator mapped, and otherwise as "new since the start and mapped by nobody"
(a segment of some other live run is always mapped by its coordinator).

No test asserts how long anything took: every wait here ends as soon as what it waits for
happens, and its limit (HANG_S, tests/conftest.py) only turns a hang into a failure.
"""
from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from coordinator.runtime.engine import Engine, EngineOptions
from coordinator.runtime.worker_pool import WorkerError
from protocol.shm_layout import SHM_PREFIX
from tests.conftest import HANG_S, shm_segments
from tests.fixtures import procs
from tests.fixtures.mock_pool import MOCK, expected_dense, make_pool, run_ffn, write_x
from tests.fixtures.tiny_gguf import write_garbage_files

_BIN = Path(sys.executable).parent / "sparseinfer"
SPARSEINFER = [str(_BIN)] if _BIN.exists() else [sys.executable, "-m", "coordinator"]
PROMPT = "hi"
# gpu worker 0 (on the CPU here, holding a share so that it is started) + cpu worker 1, on any machine
WORKERS = ["--cpu-workers", "1", "--gpu-share", "0.3"]
LONG = [*WORKERS, "-n", "2000", "--ignore-eos", "--ctx", "4096"]  # runs far longer than any test waits
START_TIMEOUT_S = 90  # until the first generated text; generous for a loaded 2-core machine
EXIT_TIMEOUT_S = HANG_S  # any wait for an exit (honest ones: a few seconds): a hang fails the test instead of CI


# --------------------------------------------------------------------------- /proc helpers

def _session_members(sid: int) -> list[int]:
    """Live (non-zombie) processes of session `sid`."""
    out = []
    for pid in procs.pids():
        st = procs.stat_fields(pid)
        if st is not None and st[0] not in ("Z", "X") and int(st[3]) == sid:
            out.append(pid)
    return out


def _procs_mentioning(text: str) -> list[int]:
    return [p for p in procs.pids() if p != os.getpid() and text in procs.cmdline(p) and procs.alive(p)]


def _mapped_segments(pid: int | str) -> set[str]:
    """Names of /dev/shm/sparseinfer_* segments that process `pid` has mapped."""
    try:
        lines = procs.maps(pid).splitlines()
    except OSError:
        return set()
    out = set()
    for line in lines:
        i = line.find("/dev/shm/" + SHM_PREFIX)
        if i >= 0:
            out.add(line[i + len("/dev/shm/"):].split()[0])
    return out


def _leaked_segments(before: set[str]) -> set[str]:
    """Segments created since `before` that still exist and no live process has mapped."""
    new = shm_segments() - before
    if not new:
        return set()
    mapped = set()
    for pid in procs.pids():
        mapped |= _mapped_segments(pid)
    return new - mapped


def _wait_for(pred, timeout: float, interval: float = 0.05) -> bool:
    deadline = time.monotonic() + timeout
    while True:
        if pred():
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(interval)


def _no_traceback(run: "Generate") -> None:
    both = run.stdout + run.stderr
    assert "Traceback" not in both, f"traceback in the output:\n{both}"


# --------------------------------------------------------------------------- one run

class Generate:
    """`sparseinfer generate -m MODEL -p hi ARGS` in its own session and its own TMPDIR,
    stdout and stderr into files (no pipe to fill up). Use as a context manager: on exit every
    process of its session that is still alive is SIGKILLed, so a failing test leaks nothing."""

    def __init__(self, model, *args: str):
        self.dir = Path(tempfile.mkdtemp(prefix="sif-"))  # short: ipc:// paths are limited to ~107 chars
        self.tmp = self.dir / "tmp"
        self.tmp.mkdir()
        self.out_path, self.err_path = self.dir / "stdout", self.dir / "stderr"
        env = dict(os.environ, TMPDIR=str(self.tmp))
        with open(self.out_path, "wb") as out, open(self.err_path, "wb") as err:
            self.proc = subprocess.Popen([*SPARSEINFER, "generate", "-m", str(model), "-p", PROMPT, *args],
                                         stdin=subprocess.DEVNULL, stdout=out, stderr=err, env=env,
                                         start_new_session=True)
        self.pid = self.proc.pid  # == its session id and process group id
        self.t0 = time.monotonic()
        self.segments: set[str] = set()
        self.workers: dict[str, tuple[int, int]] = {}  # role -> (worker id, pid)

    @property
    def stdout(self) -> str:
        return self.out_path.read_text(errors="replace")

    @property
    def stderr(self) -> str:
        return self.err_path.read_text(errors="replace")

    def find_workers(self) -> dict[str, tuple[int, int]]:
        found = {}
        for pid in _session_members(self.pid):
            m = re.search(r"-m (cpu|gpu)_worker .*--worker-id (\d+)", procs.cmdline(pid))
            if m:
                found.setdefault(m.group(1), (int(m.group(2)), pid))
        return found

    def wait_workers(self, timeout: float = START_TIMEOUT_S) -> dict[str, tuple[int, int]]:
        ok = _wait_for(lambda: self.proc.poll() is not None or len(self.find_workers()) >= 2, timeout)
        if self.proc.poll() is not None:
            pytest.fail(f"generate exited ({self.proc.returncode}) before its workers started:\n{self.stderr}")
        assert ok, f"no workers after {timeout}s"
        self.workers = self.find_workers()
        return self.workers

    def wait_text(self, timeout: float = START_TIMEOUT_S) -> None:
        """Until some generated text (more than the echoed prompt) is on stdout."""
        ok = _wait_for(lambda: self.proc.poll() is not None or self.out_path.stat().st_size > len(PROMPT),
                       timeout, 0.1)
        if self.proc.poll() is not None:
            pytest.fail(f"generate exited ({self.proc.returncode}) before generating:\n{self.stderr}")
        assert ok, f"no generated text after {timeout}s; stderr:\n{self.stderr}"
        self.workers = self.find_workers()
        assert set(self.workers) == {"cpu", "gpu"}, self.workers
        self.segments = _mapped_segments(self.pid)
        assert self.segments, "the coordinator has no shared-memory segment mapped"

    def wait(self, timeout: float = EXIT_TIMEOUT_S) -> int:
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            pytest.fail(f"generate did not exit within {timeout}s; stderr:\n{self.stderr}")

    def leftovers(self) -> list[str]:
        return [f"{p}: {procs.cmdline(p)}" for p in _session_members(self.pid) if p != self.pid]

    def assert_clean(self, timeout: float = HANG_S) -> None:
        """No process of the run, none of its segments, no private runtime dir."""
        assert _wait_for(lambda: not self.leftovers(), timeout), f"processes left behind: {self.leftovers()}"
        assert _wait_for(lambda: not (self.segments & shm_segments()), timeout), \
            f"shared memory left behind: {sorted(self.segments & shm_segments())}"
        left = sorted(p.name for p in self.tmp.iterdir())
        assert not left, f"private runtime dir left in {self.tmp}: {left}"

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        for pid in _session_members(self.pid):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            pass
        shutil.rmtree(self.dir, ignore_errors=True)


@pytest.fixture(scope="module")
def long_model(tiny_model_factory) -> Path:
    """The tiny model with room for 2000 tokens of context."""
    return tiny_model_factory(ctx=4096)


# --------------------------------------------------------------------------- 1. bad files

# What the one stderr line must say besides the path (regular expressions).
BAD_FILES = {
    "missing": r"no such file",
    "directory": r"is a directory",
    "not_gguf": r"not a GGUF",
    "empty": r"empty|not a GGUF",
    "truncated": r"truncated",
    "truncated_header": r"truncated",
    "mamba_arch": r"architecture 'mamba'",
    "undequantizable_qtype": r"blk\.0\.ffn_gate\.weight.*Q1_0",
}
PARALLEL_BAD_RUNS = 4  # each one imports torch: more at once only makes each slower


@pytest.fixture(scope="module")
def bad_file_runs(tmp_path_factory):
    """Run `generate` on every bad file, a few at a time; key -> (path, stdout, stderr, exit code,
    whether it hung (still running after EXIT_TIMEOUT_S: killed), processes left, runtime dirs left)."""
    d = tmp_path_factory.mktemp("garbage")
    files = {k: Path(v) for k, v in write_garbage_files(d).items() if k in BAD_FILES}  # not random_bytes: as not_gguf
    files["missing"] = d / "does-not-exist.gguf"
    files["directory"] = d
    assert set(files) == set(BAD_FILES)
    before = shm_segments()
    todo, running, done = list(files), {}, {}
    try:
        while todo or running:
            while todo and len(running) < PARALLEL_BAD_RUNS:
                key = todo.pop(0)
                running[key] = Generate(files[key], "-n", "2")
            time.sleep(0.05)
            for key, run in list(running.items()):
                rc = run.proc.poll()
                hung = rc is None and time.monotonic() - run.t0 > EXIT_TIMEOUT_S
                if hung:
                    run.proc.kill()
                    rc = run.proc.wait()
                if rc is not None:
                    done[key] = (files[key], run.stdout, run.stderr, rc, hung, run.leftovers(),
                                 sorted(p.name for p in run.tmp.iterdir()))
                    del running[key]
                    run.__exit__(None, None, None)
        yield done, before
    finally:
        for run in running.values():
            run.__exit__(None, None, None)


@pytest.mark.parametrize("key", sorted(BAD_FILES))
def test_bad_model_file_gives_one_clear_error_line(bad_file_runs, key):
    done, shm_before = bad_file_runs
    path, out, err, rc, hung, leftovers, runtime_dirs = done[key]
    assert not hung, f"still running {EXIT_TIMEOUT_S:g}s after it started on {key}: killed"
    assert "Traceback" not in out + err, f"traceback for {key}:\n{err}"
    assert rc == 1, f"exit code {rc} for {key}; stderr:\n{err}"
    lines = err.strip().splitlines()
    assert len(lines) == 1, f"stderr for {key} is not one line:\n{err}"
    line = lines[0]
    assert line.startswith("error:"), line
    assert str(path) in line, f"the message does not name the file {path}: {line}"
    assert re.search(BAD_FILES[key], line), f"the message does not say /{BAD_FILES[key]}/: {line}"
    assert not leftovers, f"processes left behind: {leftovers}"
    assert not runtime_dirs, f"private runtime dir left behind: {runtime_dirs}"
    assert not _leaked_segments(shm_before)


# --------------------------------------------------------------------------- 2. a worker dies

@pytest.mark.parametrize("role", ["cpu", "gpu"])
def test_worker_killed_mid_generation_is_reported_fast(long_model, role):
    shm_before = shm_segments()
    with Generate(long_model, *LONG) as run:
        run.wait_text()
        worker_id, victim = run.workers[role]
        os.kill(victim, signal.SIGKILL)
        t_kill = time.monotonic()
        rc = run.wait()
        took = time.monotonic() - t_kill
        _no_traceback(run)
        err = run.stderr
        assert rc == 1, f"exit code {rc}; stderr:\n{err}"
        lines = [l for l in err.strip().splitlines() if not l.startswith("note:")]  # notes are not errors
        assert len(lines) == 1 and lines[0].startswith("error:"), f"not one error line:\n{err}"
        assert f"{role} worker {worker_id} (pid {victim}) died: killed by signal 9" in lines[0], lines[0]
        print(f"coordinator exited {took:.2f}s after {role} worker {worker_id} was killed")  # shown, not judged
        run.assert_clean()
    assert not _leaked_segments(shm_before)


# --------------------------------------------------------------------------- 3. Ctrl-C, SIGTERM

@pytest.mark.parametrize("how", ["sigint-to-group", "sigterm-to-coordinator"])
def test_interrupt_stops_cleanly(long_model, how):
    shm_before = shm_segments()
    with Generate(long_model, *LONG) as run:
        run.wait_text()
        if how == "sigint-to-group":  # what a terminal's Ctrl-C does
            os.killpg(run.pid, signal.SIGINT)
        else:
            os.kill(run.pid, signal.SIGTERM)
        t_sig = time.monotonic()
        rc = run.wait()
        took = time.monotonic() - t_sig
        _no_traceback(run)
        want = 130 if how == "sigint-to-group" else 143  # the shells' 128 + signal number
        assert rc == want, f"exit code {rc}; stderr:\n{run.stderr}"
        assert "interrupted" in run.stderr
        print(f"stopped {took:.2f}s after {how}")  # shown, not judged
        run.assert_clean()
    assert not _leaked_segments(shm_before)


def test_ctrl_c_while_workers_start(long_model):
    """Ctrl-C while the workers still import torch (before they ignore SIGINT): no worker
    traceback on the terminal, and it stops (that it terminates such workers at once instead of
    waiting 2 s for them: test_worker_pool_mock.py::test_close_before_hello_terminates_at_once)."""
    with Generate(long_model, *LONG) as run:
        run.wait_workers()
        os.killpg(run.pid, signal.SIGINT)
        t_sig = time.monotonic()
        rc = run.wait()
        took = time.monotonic() - t_sig
        _no_traceback(run)
        assert rc == 130, f"exit code {rc}; stderr:\n{run.stderr}"
        assert run.stderr.strip() == "interrupted", run.stderr
        print(f"stopped {took:.2f}s after Ctrl-C during startup")  # shown, not judged
        run.assert_clean()


# --------------------------------------------------------------------------- 4. normal exit

def test_normal_exit_leaves_nothing_behind(tiny_model):
    shm_before = shm_segments()
    with Generate(tiny_model, *WORKERS, "-n", "4") as run:
        workers = run.wait_workers()
        endpoint = re.search(r"--endpoint (\S+)", procs.cmdline(workers["cpu"][1])).group(1)
        run_dir = Path(endpoint.removeprefix("ipc://")).parent
        assert run_dir.parent == run.tmp and run_dir.name.startswith("sparseinfer-"), endpoint
        rc = run.wait()
        _no_traceback(run)
        assert rc == 0, run.stderr
        assert run.stdout.startswith(PROMPT) and len(run.stdout) > len(PROMPT)
        assert not run_dir.exists()
        run.assert_clean()
    assert not _leaked_segments(shm_before)


# --------------------------------------------------------------------------- 5. coordinator SIGKILL

def test_coordinator_sigkill_takes_workers_and_segment_with_it(long_model):
    with Generate(long_model, *LONG) as run:
        run.wait_text()
        worker_pids = [pid for _, pid in run.workers.values()]
        os.kill(run.pid, signal.SIGKILL)
        run.wait()
        t_kill = time.monotonic()
        # Workers: PR_SET_PDEATHSIG (and their parent check) end them.
        assert _wait_for(lambda: not any(procs.alive(p) for p in worker_pids), HANG_S), \
            f"workers still alive {HANG_S:g} s after the coordinator died: {[p for p in worker_pids if procs.alive(p)]}"
        print(f"workers gone {time.monotonic() - t_kill:.2f}s after the coordinator's SIGKILL")
        assert _wait_for(lambda: not run.leftovers(), HANG_S), f"left behind: {run.leftovers()}"
        # The segment: the run's reaper (coordinator/runtime/reaper.py) unlinks it when the
        # coordinator's end of its pipe closes.
        assert _wait_for(lambda: not (run.segments & shm_segments()), HANG_S), \
            f"shared memory left behind by a SIGKILLed coordinator: {sorted(run.segments & shm_segments())}"
        # The pool removed the run dir (socket, wake pipes) and the segment's name once every
        # worker was ready: nobody is left to remove them after a kill -9.
        run.assert_clean()


def test_sigkill_of_the_whole_tree_leaves_nothing(long_model):
    """kill -9 of every process of the run at once (coordinator and workers): no cleanup code
    runs anywhere, yet no segment, FIFO, socket or directory stays."""
    with Generate(long_model, *LONG) as run:
        run.wait_text()
        members = _session_members(run.pid)
        assert len(members) >= 3, members  # coordinator + 2 workers
        for pid in members:
            os.kill(pid, signal.SIGKILL)
        run.wait()
        assert _wait_for(lambda: not run.leftovers(), HANG_S), f"left behind: {run.leftovers()}"
        assert not (run.segments & shm_segments()), f"shared memory left behind: {sorted(run.segments)}"
        left = sorted(p.name for p in run.tmp.iterdir())
        assert not left, f"private runtime dir left in {run.tmp}: {left}"


def test_sigkill_of_the_whole_tree_while_workers_start_leaves_nothing(long_model):
    """The same kill before the workers are ready, while the segment and the run directory still
    have their names: the run's reaper (coordinator/runtime/reaper.py), outside the process group,
    removes them once the coordinator is gone."""
    with Generate(long_model, *LONG) as run:
        run.wait_workers()
        segments = _mapped_segments(run.pid)
        assert segments and any(run.tmp.iterdir())  # names exist: start-up is not over
        os.killpg(run.pid, signal.SIGKILL)
        run.wait()
        assert _wait_for(lambda: not (segments & shm_segments()) and not any(run.tmp.iterdir()), HANG_S), \
            f"left behind: {sorted(segments & shm_segments())}, {sorted(p.name for p in run.tmp.iterdir())}"
        assert _wait_for(lambda: not run.leftovers(), HANG_S, 0.2), f"left behind: {run.leftovers()}"


def test_the_reaper_leaves_with_the_run(tiny_model):
    with Generate(tiny_model, *WORKERS, "-n", "2") as run:
        run.wait()
    marker = str(tiny_model)
    assert _wait_for(lambda: not subprocess.run(["pgrep", "-f", marker], capture_output=True).stdout, HANG_S), \
        "a process of the run (its reaper?) outlived a normal exit"


def test_coordinator_sigkill_while_workers_start(long_model):
    """Killed while its workers are still importing (before they set PR_SET_PDEATHSIG): they
    must still notice and exit, not wait forever for an Assign from a dead coordinator."""
    with Generate(long_model, *LONG) as run:
        worker_pids = [pid for _, pid in run.wait_workers().values()]
        segments = _mapped_segments(run.pid)  # created before the workers are started
        os.kill(run.pid, signal.SIGKILL)
        run.wait()
        # They finish importing torch first (seconds on a loaded machine), then exit at once.
        assert _wait_for(lambda: not run.leftovers(), HANG_S, 0.2), \
            f"orphaned workers still alive {HANG_S:g} s after the coordinator died: {run.leftovers()}"
        assert not any(procs.alive(p) for p in worker_pids)
        assert segments and not (segments & shm_segments()), f"shared memory left behind: {segments}"


# --------------------------------------------------------------------------- 6. load failure

_FAILING_CPU_WORKER = """
import sys
from sparsecore import tensors
from sparsecore.errors import ModelFileError

_info = tensors.TensorStore.info

def info(self, name):
    if name == "blk.1.ffn_down.weight":  # as if this one tensor had a type we cannot read
        raise ModelFileError(f"{self.path}: tensor {name} has type IQ2_XXS, which sparseinfer does not support")
    return _info(self, name)

tensors.TensorStore.info = info
from cpu_worker.__main__ import main
sys.exit(main(argv=sys.argv[1:]))
"""


def _engine_failure(model, cpu_argv: list[str]) -> tuple[str, str]:
    """Start an Engine whose cpu worker 1 runs `cpu_argv` and whose gpu worker 0 is the torch-free
    tests/fixtures/mock_worker.py (it starts fast and says Hello; the real gpu worker is covered above);
    return (the WorkerError's message, the workers' endpoint)."""
    endpoints = []

    def launcher(shard, endpoint):
        endpoints.append(endpoint)
        if shard.role == "cpu":
            argv = cpu_argv
        else:
            argv = [sys.executable, str(MOCK), "--role", shard.role]
        return [*argv, "--endpoint", endpoint, "--worker-id", str(shard.worker_id)]

    # bounded by the engine's own startup timeout, whose "timed out" error the callers' checks refuse
    with pytest.raises(WorkerError) as ei:
        Engine(model, EngineOptions(cpu_workers=1, threads=2), launcher=launcher)
    assert endpoints and len(set(endpoints)) == 1
    return str(ei.value), endpoints[0]


def _assert_engine_cleaned_up(endpoint: str, shm_before: set[str]) -> None:
    assert _wait_for(lambda: not _procs_mentioning(endpoint), HANG_S), \
        f"worker processes left behind: {_procs_mentioning(endpoint)}"
    if endpoint.startswith("ipc://"):
        run_dir = Path(endpoint.removeprefix("ipc://")).parent
        assert not run_dir.exists(), f"private runtime dir left behind: {run_dir}"
    assert not _mapped_segments("self"), "this process still maps a segment"
    assert not _leaked_segments(shm_before)


def test_worker_failing_to_load_is_named(tiny_model):
    shm_before = shm_segments()
    msg, endpoint = _engine_failure(tiny_model, [sys.executable, "-c", _FAILING_CPU_WORKER])
    assert re.search(r"cpu worker 1 \(pid \d+\) failed while loading: ", msg), msg
    assert "blk.1.ffn_down.weight" in msg and "IQ2_XXS" in msg, msg
    _assert_engine_cleaned_up(endpoint, shm_before)


def test_worker_exiting_at_startup_is_named(tiny_model):
    shm_before = shm_segments()
    msg, endpoint = _engine_failure(tiny_model, [sys.executable, "-c", "import sys; sys.exit(3)"])
    assert re.search(r"cpu worker 1 \(pid \d+\) died: exited with code 3", msg), msg
    _assert_engine_cleaned_up(endpoint, shm_before)


@pytest.mark.parametrize("args,needle", [
    (["--coordinator-share", "1.5"], "coordinator share must be within [0, 1), got 1.5"),
    (["--coordinator-share", "0.3", "--vram-budget", "0.01"], "--coordinator-share goes with the static split"),
], ids=["out-of-range", "with-vram-budget"])
def test_bad_coordinator_share_is_one_clear_error(tiny_model, args, needle):
    shm_before = shm_segments()
    r = subprocess.run([sys.executable, "-m", "coordinator", "generate", "-m", str(tiny_model), "-p", "hi",
                        "-n", "2", *args], capture_output=True, text=True, timeout=120)
    assert r.returncode == 1, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error:") and needle in lines[0], r.stderr
    assert not _leaked_segments(shm_before)  # (another test run's live segments are not ours to judge)


# --------------------------------------------------------------------------- 7. worker channel

def _mock_pool(behaviors=None, **kw):
    from coordinator.runtime.placement import static_plan
    return make_pool(static_plan(n_layers=2, n_ff=40, gpu_share=0.4, n_cpu_workers=1), behaviors, **kw)


def test_secret_file_is_private(no_leaks):
    p = _mock_pool()
    try:
        assert oct(os.stat(p.run_dir).st_mode & 0o777) == "0o700"
        assert oct(os.stat(p.secret_path).st_mode & 0o777) == "0o600"
        assert p.secret_path.read_text() == p.secret and len(p.secret) == 64
    finally:
        p.close()


@pytest.mark.parametrize("transport", ["tcp", "ipc"])
def test_forged_messages_cannot_end_a_run(no_leaks, transport):
    """Another local process on the worker socket (tcp: any user can connect) sends junk, a
    forged WorkerFailed, a Hello with a wrong secret, several frames: all ignored, the run goes on."""
    import zmq
    from protocol.messages import Hello, WorkerFailed, encode
    import numpy as np

    p = _mock_pool(transport=transport, startup_timeout_s=60)
    ctx = zmq.Context()
    try:
        if transport == "tcp":
            assert p.endpoint.startswith("tcp://127.0.0.1:")
        forger = ctx.socket(zmq.DEALER)
        forger.setsockopt(zmq.LINGER, 0)
        forger.setsockopt(zmq.IDENTITY, b"cpu9")
        forger.connect(p.endpoint)
        forger.send(encode(Hello(1, "cpu", os.getpid(), "0" * 64)))  # a guessed secret, during startup
        p.wait_ready()
        for msg in (b"\x00" * 9, encode(WorkerFailed(1, "cpu", "forged")), encode(Hello(1, "cpu", 1, "x"))):
            forger.send(msg)
        forger.send_multipart([b"a", b"b", b"c"])
        time.sleep(0.3)
        p.check_alive()  # nothing of it counts
        rng = np.random.default_rng(0)
        write_x(p, rng, 2)
        np.testing.assert_array_equal(run_ffn(p, 1, 2), expected_dense(p, 1, 2).astype(np.float32))
        forger.close()
    finally:
        ctx.term()
        p.close()


def test_worker_without_the_secret_is_not_accepted(no_leaks):
    p = _mock_pool({1: "no_secret"}, startup_timeout_s=4)
    try:
        with pytest.raises(WorkerError, match=r"timed out .* waiting for: cpu worker 1"):
            p.wait_ready()
    finally:
        p.close()


def test_malformed_message_from_a_worker_ends_the_run_naming_it(no_leaks):
    p = _mock_pool({1: "junk_after_ready"}, startup_timeout_s=60)
    try:
        # the junk may arrive while the pool still waits for the other workers' Ready
        with pytest.raises(WorkerError, match=r"cpu worker 1 \(pid \d+\) sent a malformed message: undecodable"):
            p.wait_ready()
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline:
                p.check_alive()
                time.sleep(0.05)
    finally:
        p.close()
