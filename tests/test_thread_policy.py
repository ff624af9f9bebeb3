"""Our processes choose their OpenMP wait policy for themselves only: importing the engine makes
libgomp (loaded with torch) sleep instead of spinning between parallel regions, and leaves no
OMP_WAIT_POLICY in the environment that programs started from, or loaded into, the process
inherit (a leaked PASSIVE once slowed llama.cpp 3x in our benchmark)."""
from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from tests.conftest import REPO


def _spin_count(code: str) -> tuple[str, str]:
    """The spin count of the first libgomp that loads after the code prints MARK to stderr (the
    gguf package's sentencepiece brings a libgomp copy of its own, loaded earlier: not torch's)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OMP_", "GOMP_"))}
    env["OMP_DISPLAY_ENV"] = "VERBOSE"  # libgomp prints its settings when it loads
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=REPO,
                       timeout=120)
    assert r.returncode == 0, r.stderr
    m = re.search(r"GOMP_SPINCOUNT = '(\d+)'", r.stderr.split("MARK\n", 1)[-1])
    if m is None:
        pytest.skip("this torch's OpenMP runtime is not libgomp (no GOMP_SPINCOUNT shown)")
    return m.group(1), r.stdout.strip()


def test_engine_import_makes_openmp_passive_without_exporting_it():
    # the engine imports torch once its workers are started (EngineBuilder.start); torch's libgomp
    # loads then, under the policy coordinator/__init__.py sets for that import alone
    spins, leaked = _spin_count("import coordinator.runtime.engine, os, sys; "
                                "sys.stderr.write('MARK\\n'); sys.stderr.flush(); "
                                "import torch; print('OMP_WAIT_POLICY' in os.environ)")
    assert spins == "0"  # passive: threads sleep at once
    assert leaked == "False"


def test_plain_torch_keeps_its_default():
    """The control: without our package libgomp spins (so the test above can fail)."""
    spins, _ = _spin_count("import sys; sys.stderr.write('MARK\\n'); sys.stderr.flush(); import torch")
    assert spins != "0"


# ---- the per-layer exchange on a shared machine: when a side spins (protocol/doorbell.py) -------

from protocol import doorbell  # noqa: E402
from protocol.doorbell import SpinGovernor  # noqa: E402


def _governor(**kw) -> SpinGovernor:
    kw = dict(budget_s=0.02, contended_s=50e-6, window_s=0.005, min_cpu=0.7, probe_s=1.0, max_probe_s=8.0) | kw
    return SpinGovernor(**kw)


def _spin(g: SpinGovernor, now: float, cpu_share: float, n: int = 10, wall: float = 0.001) -> float:
    """Report `n` spins of `wall` seconds that got `cpu_share` of the core; returns the clock after."""
    for _ in range(n):
        g.budget(now)
        g.record(wall, wall * cpu_share, now)
        now += wall
    return now


def test_spins_that_keep_their_core_keep_spinning():
    g = _governor()
    _spin(g, 0.0, 0.98, n=1000)
    assert not g.contended and g.budget(10.0) == 0.02 and g.switches == 0


def test_preempted_spins_make_a_side_stop_spinning():
    g = _governor()
    now = _spin(g, 0.0, 0.4, n=4)  # 4 ms of spinning: not a window yet
    assert not g.contended
    now = _spin(g, now, 0.4, n=1)  # the window is full: 40 % CPU means another process had the core
    assert g.contended and g.switches == 1
    assert g.budget(now) == 50e-6  # a short spin, then the wake pipe
    _spin(g, now, 1.0, n=100, wall=50e-6)  # short contended spins prove nothing either way
    assert g.contended


def test_a_clean_probe_restores_spinning():
    g = _governor()
    now = _spin(g, 0.0, 0.4)
    assert g.contended and g.budget(now + 0.5) == 50e-6
    now += 1.0  # probe time: the full budget again, for one window
    assert g.budget(now) == 0.02 and g.probing
    _spin(g, now, 0.95)
    assert not g.contended and g.budget(now + 1) == 0.02 and g.switches == 1


def test_failed_probes_back_off_up_to_the_longest_wait():
    g = _governor()
    now = _spin(g, 0.0, 0.4)
    waits = []
    for _ in range(6):
        start = g.next_probe
        waits.append(start - now)
        now = _spin(g, start, 0.3)  # the probe window is still preempted
        assert g.contended
    assert [round(w) for w in waits[:4]] == [1, 2, 4, 8]  # about: each probe's own window shifts it
    assert g.next_probe - now <= 8.0 and g.switches == 1


def test_static_policy_never_changes_its_budget():
    g = _governor(adaptive=False)
    _spin(g, 0.0, 0.1, n=1000)
    assert not g.contended and g.budget(5.0) == 0.02


def test_a_contended_worker_does_not_spin_at_all():
    g = _governor(contended_s=0.0)
    now = _spin(g, 0.0, 0.2)
    assert g.budget(now) == 0.0


def test_sync_policy_from_the_environment(monkeypatch):
    monkeypatch.delenv(doorbell.SYNC_ENV, raising=False)
    assert doorbell.sync_policy() == "adaptive"
    for value, policy in [("static", "static"), (" Sleep ", "sleep"), ("nonsense", "adaptive")]:
        monkeypatch.setenv(doorbell.SYNC_ENV, value)
        assert doorbell.sync_policy() == policy
    monkeypatch.setenv(doorbell.SYNC_ENV, "sleep")
    assert not doorbell.choose_spin(1, cores=64)  # forced: nobody spins
    monkeypatch.setenv(doorbell.SYNC_ENV, "static")
    assert doorbell.choose_spin(1, cores=64) == doorbell.spin_supported()
    assert not doorbell.choose_spin(1, cores=1)  # a spinner per core still decides at start


def test_threads_default_to_the_usable_cores(monkeypatch):
    from coordinator.runtime import placement

    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2})
    assert placement.resolve_threads(None, None) == (3, 2, 1)


def test_contention_that_comes_back_soon_keeps_backing_off():
    g = _governor(recent_s=10.0)
    now = _spin(g, 0.0, 0.4)  # contended: first probe after 1 s
    now = _spin(g, g.next_probe, 0.95)  # a lucky clean probe: spinning again
    assert not g.contended
    now = _spin(g, now + 1.0, 0.4)  # preempted again 1 s later: the wait doubles, not restarts
    assert g.contended and g.next_probe - now == pytest.approx(2.0, abs=0.01)  # decided mid-window
    now = _spin(g, g.next_probe, 0.95)
    now = _spin(g, now + 60.0, 0.4)  # after a quiet minute: a fresh start
    assert g.contended and g.next_probe - now == pytest.approx(1.0, abs=0.01) and g.switches == 3
