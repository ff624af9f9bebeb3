"""The memory plan (coordinator/runtime/memory_plan.py): made from the tensor table before anything is
loaded; a plan that does not fit in what is available ends in one line naming the numbers and
what would fit, before any worker process is started; the plan bounds what the processes then
really hold; `sparseinfer info` prints it."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from coordinator.runtime.engine import Engine, EngineOptions
from coordinator.runtime.memory_plan import (COORDINATOR_RUNTIME, TORCH_RUNTIME, WORKER_RUNTIME, available_memory,
                                             cgroup_free)
from sparsecore.errors import NotEnoughMemory
from sparsecore.kernels import interleaving
from tests.conftest import REPO


def _plan(path, **kw):
    return Engine(path, EngineOptions(threads=2, cpu_workers=1, **kw), plan_only=True).memory


def test_available_memory_reads_the_machine_and_the_override(monkeypatch):
    monkeypatch.delenv("SPARSEINFER_MEM_AVAILABLE", raising=False)
    n, source = available_memory()
    assert n is not None and n > 0 and (source == "MemAvailable" or source.startswith("the cgroup's"))
    for text, want in (("123456", 123456), ("512M", 512 << 20), ("8G", 8 << 30), ("1.5g", int(1.5 * (1 << 30)))):
        monkeypatch.setenv("SPARSEINFER_MEM_AVAILABLE", text)
        assert available_memory() == (want, "SPARSEINFER_MEM_AVAILABLE")
    monkeypatch.setenv("SPARSEINFER_MEM_AVAILABLE", "lots")
    with pytest.raises(ValueError, match="SPARSEINFER_MEM_AVAILABLE='lots'"):
        available_memory()


def _files(root, files: dict) -> None:
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)


def test_cgroup_v1_limits_are_read_the_tightest_ancestor_first(tmp_path):
    """cgroup v1 (this machine's kind): the memory controller's group and its ancestors; a limit
    of "none" (a 2^63-ish number) is no limit; page cache it could drop is not counted as used."""
    mb = 1 << 20
    _files(tmp_path, {
        "proc": "12:memory:/run/job\n3:cpu,cpuacct:/run/job\n0::/\n",
        "fs/memory/memory.limit_in_bytes": str(9223372036854771712),
        "fs/memory/memory.usage_in_bytes": str(5000 * mb),
        "fs/memory/run/memory.limit_in_bytes": str(1000 * mb),
        "fs/memory/run/memory.usage_in_bytes": str(300 * mb),
        "fs/memory/run/memory.stat": f"total_inactive_file {100 * mb}\nhierarchical_memory_limit {1000 * mb}\n",
        "fs/memory/run/job/memory.limit_in_bytes": str(9223372036854771712),
        "fs/memory/run/job/memory.usage_in_bytes": str(200 * mb),
        "fs/memory/run/job/memory.stat": f"total_inactive_file {50 * mb}\nhierarchical_memory_limit {1000 * mb}\n",
    })
    free, source = cgroup_free(tmp_path / "proc", tmp_path / "fs")
    assert free == 1000 * mb - 300 * mb + 100 * mb  # the parent's limit and its use (the job's and others')
    assert "memory.limit_in_bytes" in source and source.endswith("/run/memory.limit_in_bytes)")
    _files(tmp_path, {"fs/memory/run/job/memory.limit_in_bytes": str(600 * mb)})  # the job's own, tighter
    free, source = cgroup_free(tmp_path / "proc", tmp_path / "fs")
    assert free == 600 * mb - 200 * mb + 50 * mb and source.endswith("run/job/memory.limit_in_bytes)")
    _files(tmp_path, {"fs/memory/run/job/memory.limit_in_bytes": str(9223372036854771712)})
    _files(tmp_path, {"fs/memory/run/memory.limit_in_bytes": str(9223372036854771712),
                      "fs/memory/run/memory.stat": "", "fs/memory/run/job/memory.stat": ""})
    assert cgroup_free(tmp_path / "proc", tmp_path / "fs") is None  # no limit anywhere


def test_cgroup_v2_limits_are_read_the_tightest_ancestor_first(tmp_path):
    mb = 1 << 20
    _files(tmp_path, {
        "proc": "0::/a/b\n",
        "fs/a/memory.max": str(800 * mb), "fs/a/memory.current": str(600 * mb), "fs/a/memory.stat": "inactive_file 0\n",
        "fs/a/b/memory.max": str(2000 * mb), "fs/a/b/memory.current": str(100 * mb),
        "fs/a/b/memory.stat": f"inactive_file {10 * mb}\n",
    })
    free, source = cgroup_free(tmp_path / "proc", tmp_path / "fs")
    assert free == 200 * mb and source.endswith("a/memory.max)")  # the parent's is the tighter


def _down_bytes(path) -> int:
    from sparsecore.gguf_file import open_gguf

    return sum(int(t.n_bytes) for t in open_gguf(path).tensors if ".ffn_down." in t.name)


def test_plan_counts_each_kind(tiny_model_factory):
    path = tiny_model_factory(tensor_type="Q4_0")
    fast, exact = _plan(path), _plan(path, fast=False)
    size = path.stat().st_size
    # exact mode reads every matrix in place but down, whose columns the two processes holding
    # neurons each copy a share of; fast mode copies the interleaved ones where the CPU takes them
    assert exact.copied == _down_bytes(path) > 0 and 0.5 * size < exact.mapped + exact.copied <= size
    assert (fast.copied > 0.5 * size) == interleaving()
    assert fast.copied + fast.mapped == exact.copied + exact.mapped
    alone = _plan(path, fast=False, coordinator_share=0.0)
    assert alone.copied == 0  # the worker holds every neuron, the coordinator none: nothing copied
    assert fast.runtime == COORDINATOR_RUNTIME + WORKER_RUNTIME and fast.processes == 2
    # float copies of the weights compute in torch, which the coordinator then imports
    assert _plan(path, weights="f32").runtime == COORDINATOR_RUNTIME + WORKER_RUNTIME + TORCH_RUNTIME
    longer = _plan(path, ctx=256, kv_caches=4)
    assert longer.kv > fast.kv  # four caches against two (the tiny model's context is 256)


def test_a_plan_that_does_not_fit_is_refused_before_any_worker_starts(tiny_model_factory, monkeypatch):
    path = tiny_model_factory(tensor_type="Q4_0", ctx=4096)
    plan = _plan(path, ctx=4096, kv_caches=8)
    assert plan.kv > 0  # half of it over: a shorter context fits
    monkeypatch.setenv("SPARSEINFER_MEM_AVAILABLE", str(plan.anonymous - plan.kv // 2))
    started = []

    def launcher(shard, endpoint):
        started.append(shard)
        raise AssertionError("a worker was started")

    with pytest.raises(NotEnoughMemory) as ei:
        Engine(path, EngineOptions(threads=2, cpu_workers=1, ctx=4096, kv_caches=8), launcher=launcher)
    msg = str(ei.value)
    assert not started and "\n" not in msg
    assert msg.startswith(f"{path.name}: needs {plan.anonymous / 1e9:.2f} GB") and "SPARSEINFER_MEM_AVAILABLE" in msg
    assert "kv" in msg and "would fit: --ctx " in msg
    ctx = int(msg.split("--ctx ")[1].split(";")[0].split()[0])
    assert 256 <= ctx < 4096
    assert _plan(path, ctx=ctx, kv_caches=8).anonymous <= plan.anonymous - plan.kv // 2  # the hint fits


def test_the_command_line_says_it_in_one_line(tiny_model_factory):
    path = tiny_model_factory(tensor_type="Q4_0")
    env = {**os.environ, "SPARSEINFER_MEM_AVAILABLE": "10M"}
    r = subprocess.run([sys.executable, "-m", "coordinator", "generate", "-m", str(path), "-p", "hi", "-n", "2"],
                       capture_output=True, text=True, timeout=120, cwd=REPO, env=env)
    assert r.returncode != 0
    errors = [line for line in r.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "needs" in errors[0] and "0.01 GB is available" in errors[0], r.stderr
    assert "Traceback" not in r.stderr


V1_MEMORY = "/sys/fs/cgroup/memory"


@pytest.mark.skipif(not (os.path.isdir(V1_MEMORY) and os.access(V1_MEMORY, os.W_OK)),
                    reason="needs a writable cgroup v1 memory controller (root on a v1 machine)")
def test_under_a_real_cgroup_v1_limit_the_command_line_refuses_in_one_line(tiny_model_factory):
    """The limit of a v1 group the run is put in (as a user's container or systemd slice would)
    is seen: one line naming it, before any worker starts, not the kernel's OOM kill."""
    path = tiny_model_factory(tensor_type="Q4_0")
    group = f"{V1_MEMORY}/sparseinfer-test-{os.getpid()}"
    os.mkdir(group)
    try:
        with open(f"{group}/memory.limit_in_bytes", "w") as f:
            f.write(str(64 << 20))
        env = {k: v for k, v in os.environ.items() if k != "SPARSEINFER_MEM_AVAILABLE"}
        r = subprocess.run(["sh", "-c", f'echo $$ > {group}/cgroup.procs && exec "$0" "$@"', sys.executable, "-m",
                            "coordinator", "generate", "-m", str(path), "-p", "hi", "-n", "2"],
                           capture_output=True, text=True, timeout=120, cwd=REPO, env=env)
        assert r.returncode not in (0, -9, 137), r.stderr
        errors = [line for line in r.stderr.splitlines() if line.startswith("error:")]
        assert len(errors) == 1 and "memory.limit_in_bytes" in errors[0], r.stderr
        assert "Traceback" not in r.stderr
    finally:
        os.rmdir(group)


def test_info_prints_the_plan(tiny_model_factory):
    path = tiny_model_factory(tensor_type="Q4_0")
    run = [sys.executable, "-m", "coordinator", "info", "-m", str(path), "-t", "2", "--cpu-workers", "1"]
    r = subprocess.run([*run, "--json"], capture_output=True, text=True, timeout=120, cwd=REPO)
    assert r.returncode == 0, r.stderr
    mem = json.loads(r.stdout)["memory"]
    assert mem["total"] == sum(mem[k] for k in ("copied", "converted", "kv", "runtime", "mapped"))
    assert mem["must_fit"] == mem["total"] - mem["mapped"] and mem["processes"] == 2
    assert mem == {**mem, **{k: v for k, v in _plan(path).__dict__.items() if k in ("copied", "kv", "mapped")}}
    text = subprocess.run([*run, "--parallel", "4"], capture_output=True, text=True, timeout=120, cwd=REPO).stdout
    assert "memory plan (--ctx 2048, 2 processes, serve --parallel 4)" in text and "\n  fits" in text


def test_the_plan_bounds_what_the_processes_hold(smollm2_path):
    """After a prompt and some tokens, the processes' private memory is no more than the plan's
    anonymous bytes, and with the layouts they map from the layout cache at least the weights it
    says they copy. In an interpreter of its own:
    this one's memory holds what every earlier test of the session left (710 MB late in a full
    run against the plan's 689)."""
    script = f"""
import json, os
from coordinator.runtime.engine import Engine, EngineOptions
from tests.fixtures.procs import mapped_rss, status_bytes
with Engine({str(smollm2_path)!r}, EngineOptions()) as eng:
    list(eng.generate(list(range(5, 200)), 16, stop_at_eos=False))
    pids = [os.getpid(), *(w.pid for w in eng.pool.workers)]
    anon = sum(status_bytes(p, "RssAnon") for p in pids)
    layouts = sum(mapped_rss(p, ".lay") for p in pids)
    plan = eng.memory
print(json.dumps(dict(anon=anon, layouts=layouts, copied=plan.copied, converted=plan.converted,
                      anonymous=plan.anonymous, lines=plan.lines())))
"""
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300, cwd=REPO)
    assert r.returncode == 0, r.stderr[-2000:]
    got = json.loads(r.stdout.strip().splitlines()[-1])
    assert got["layouts"] > 0, got  # everything fits: the held layouts are mapped from the cache
    assert got["copied"] + got["converted"] <= got["anon"] + got["layouts"] <= got["anonymous"], got
