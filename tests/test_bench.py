"""`sparseinfer bench`: the byte accounting, and a real run on a tiny model (dense vs sparse)."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from types import SimpleNamespace

import gguf
import pytest
import numpy as np
import torch

from coordinator.runtime.model_files import thresholds_path
from coordinator.tools import observe
from coordinator.tools.bench import Mode, ffn_bytes_per_token, ratios


def _fake_engine(hidden=8, n_ff=10, n_layers=3, n_experts_used=0):
    cfg = SimpleNamespace(hidden=hidden, n_ff=n_ff, n_layers=n_layers, routed=n_experts_used > 0,
                          n_experts_used=n_experts_used)
    return SimpleNamespace(cfg=cfg, opts=SimpleNamespace(weights="f32"))


def test_ffn_bytes_follow_what_each_mode_reads():
    eng = _fake_engine()
    row = 8 * 4  # one float32 row of `hidden`
    n = 10 * 3
    assert ffn_bytes_per_token(eng, Mode("dense"), 1.0) == n * 3 * row
    # thresholds: every gate row is read to decide, up and down only for the active fifth
    assert ffn_bytes_per_token(eng, Mode("s", sparsity=0.8), 0.2) == pytest.approx(n * (row + 2 * row * 0.2))
    preds = SimpleNamespace(fc1=[torch.zeros(2, 8)] * 3, fc2=[torch.zeros(10, 2)] * 3)
    assert ffn_bytes_per_token(eng, Mode("p", predictors=preds), 0.5) == pytest.approx(
        n * 3 * row * 0.5 + 3 * (16 + 20) * 4)
    eng.opts.weights = "int8"  # int8 values and a float32 scale per row
    assert ffn_bytes_per_token(eng, Mode("dense"), 1.0) == n * 3 * (8 + 4)
    # routed experts: a dense token computes its k experts' neurons (active fraction 1 of those)
    routed = _fake_engine(n_experts_used=4)
    assert ffn_bytes_per_token(routed, Mode("dense"), 1.0) == 4 * n * 3 * row


def test_ratios_against_the_base_mode():
    res = {"dense": dict(pp_tok_s=100, tg_tok_s=10, ffn_ms_per_token=8.0),
           "sparse": dict(pp_tok_s=100, tg_tok_s=15, ffn_ms_per_token=4.0)}
    assert ratios(res, "dense") == {"sparse": dict(pp=1.0, tg=1.5, ffn_time=0.5)}
    # decoding in lockstep times no per-layer exchange: no FFN ratio, not a division by zero
    res["dense"]["ffn_ms_per_token"] = 0.0
    assert ratios(res, "dense") == {"sparse": dict(pp=1.0, tg=1.5, ffn_time=None)}


def test_twin_counts_take_a_dense_twin_as_read_whole():
    """A twin whose threshold word is negative (the lm_head of a thresholds file without head
    levels) read its rows in full at every token: counted as read whole, not as skipped"""
    class Twin:
        twin_bytes = 1000

        def __init__(self, counts):
            self.counts = counts

        def reset_twin_counts(self):
            c, self.counts = self.counts, (0, 0)
            return c

        def twin_bytes_read(self, active, groups):
            return 10 * active + groups

    sparse, dense = Twin((30, 2)), Twin((0, 0))
    eng = SimpleNamespace(twins=SimpleNamespace(matrices=[sparse, dense],
                                                words=[np.array([0.5], np.float32), np.array([-1.0], np.float32)]))
    assert observe.twin_counts(eng, tokens=4) == (302 + 4 * 1000, 2000)
    assert observe.twin_counts(eng, tokens=4) == (0 + 4 * 1000, 2000)  # the counters were zeroed


@pytest.mark.parametrize("method", ["cats", "input"])
def test_bench_runs_dense_and_sparse_on_a_tiny_model(tiny_model_factory, tmp_path, method, no_leaks):
    """Calibrates when the thresholds are missing, then reports both modes from real runs: CATS
    on float32 matrices, input sparsity on Q4_0 ones (whose twins read less)."""
    model = tmp_path / "tiny.gguf"
    shutil.copy(tiny_model_factory(tensor_type="F32" if method == "cats" else "Q4_0"), model)
    r = subprocess.run([sys.executable, "-m", "coordinator", "bench", "-m", str(model), "--json",
                        "-p", "12", "-n", "5", "-r", "2", "--warmup", "0", "--sparsity", "0.5",
                        "--threads", "2", "--cpu-workers", "1", "--sparse-method", method],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert "calibrating first" in r.stderr and thresholds_path(model).exists()
    out = json.loads(r.stdout)
    res = out["results"]
    assert set(res) == {"dense", "sparse 0.50"}
    for name, m in res.items():
        assert len(m["ids"]) == 5
        assert m["tg_tok_s"] > 0 and m["pp_tok_s"] > 0 and m["ffn_ms_per_token"] > 0
        # one exchange per layer per decoded token, every timed rep
        assert m["sync_exchanges"] == 2 * 4 * out["n_layers"]
        assert m["sync_us_median"] <= m["sync_us_p99"]
    assert res["dense"]["active_fraction"] == 1.0
    assert 0.2 < res["sparse 0.50"]["active_fraction"] < 0.8  # held-out text: near, not at, 0.5
    assert res["sparse 0.50"]["weight_mb_per_token"] < res["dense"]["weight_mb_per_token"]
    assert set(out["ratios_vs_dense"]) == {"sparse 0.50"}
    assert out["read_bandwidth_gb_s"] > 0
    # the decode path the engine chose, and why, in one line (coordinator/runtime/decode_plan.py)
    assert out["decode_path"].split(":")[0] in ("lockstep", "split attention", "native", "torch")
    if method == "input":  # the text report says it too (thresholds calibrated above: no second calibration)
        r = subprocess.run([sys.executable, "-m", "coordinator", "bench", "-m", str(model), "-p", "12", "-n", "3",
                            "-r", "1", "--warmup", "0", "--sparsity", "0.5", "--threads", "2", "--cpu-workers", "1",
                            "--sparse-method", method], capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, r.stderr
        assert [line for line in r.stdout.splitlines() if line.startswith("decode path: ")] == \
            [f"decode path: {out['decode_path']}"]
    # without CUDA the coordinator computes a core's share: 1 of 2 with one single-threaded worker,
    # cut on a block of 32 neurons for the native kernels (64 of the tiny model's 160)
    assert out["coordinator_ffn_share"] == (0.0 if torch.cuda.is_available() else pytest.approx(0.5, abs=0.1))


@pytest.mark.parametrize("kind", ["Q4_0", "q4_k_m"])
def test_a_dense_token_reads_each_touched_tensor_once(tiny_model_factory, tmp_path_factory, no_leaks, kind):
    """The bytes the engine says a dense decoded token reads (coordinator's matrices + the
    FFN's, as the kernels read them) equal the bytes of the tensors a token touches, counted
    from the file's tensor table by scripts/bench_vs_llamacpp.py (issue 14: <= 1.15x)."""
    import importlib.util

    from coordinator.runtime.engine import Engine, EngineOptions
    from coordinator.tools import observe
    from tests.conftest import REPO, run_make_bench_model

    spec = importlib.util.spec_from_file_location("bench_vs_llamacpp", REPO / "scripts" / "bench_vs_llamacpp.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    if kind == "q4_k_m":  # ffn_down Q4_K in layer 0, Q6_K in layer 1 (llama.cpp's use_more_bits)
        path = tmp_path_factory.mktemp("kqm") / "tiny-q4_k_m.gguf"
        run_make_bench_model(["--shape", "tiny", "--quiet", "--type", "q4_k_m", "-o", str(path)])
        types = {t.name: t.tensor_type.name for t in gguf.GGUFReader(path).tensors}
        assert (types["blk.0.ffn_down.weight"], types["blk.1.ffn_down.weight"]) == ("Q4_K", "Q6_K")
    else:
        path = tiny_model_factory(tensor_type="Q4_0", seed=8)
    touched = script.touched_bytes(path)
    r = gguf.GGUFReader(path)
    by_name = {t.name: int(t.n_bytes) for t in r.tensors}
    emb = by_name.pop("token_embd.weight")
    vocab = int(next(t for t in r.tensors if t.name == "token_embd.weight").shape[1])
    assert touched == sum(by_name.values()) + (emb // vocab if "output.weight" in by_name else emb)
    with Engine(path, EngineOptions(threads=2, cpu_workers=1, weights="gguf", fast=True)) as eng:
        read = observe.coordinator_bytes_per_token(eng) + ffn_bytes_per_token(eng, Mode("dense"), 1.0)
    assert read == touched


def test_neuron_bytes_of_a_powerinfer_file_count_its_transposed_down(tiny_pwri, no_leaks):
    """A PWRI file holds ffn_down_t, not ffn_down: the benchmark's bytes per token read it."""
    from coordinator.runtime.engine import Engine, EngineOptions
    from coordinator.tools import observe
    from sparsecore.gguf_file import open_gguf

    sizes = {t.name: int(t.n_bytes) for t in open_gguf(tiny_pwri).tensors}  # PWRI magic: our reader
    assert "blk.0.ffn_down.weight" not in sizes
    with Engine(tiny_pwri, EngineOptions(threads=2, cpu_workers=1, weights="gguf", fast=True)) as eng:
        want = sum(sizes[f"blk.0.ffn_{n}.weight"] for n in ("gate", "up", "down_t")) / eng.cfg.n_ff
        assert observe.ffn_neuron_bytes(eng) == want
        assert ffn_bytes_per_token(eng, Mode("predictor", predictors=eng.predictors), 0.1) > 0


@pytest.mark.skipif(not (os.access("/sys/fs/cgroup/memory", os.W_OK) or os.access("/sys/fs/cgroup", os.W_OK)),
                    reason="needs a writable cgroup (root)")
def test_bench_runs_a_side_alone_under_a_memory_limit(tiny_model_factory, tmp_path):
    """scripts/bench_vs_llamacpp.py --mem-limit: the side runs in a cgroup made for it (its peak,
    page cache included, under the limit; its OOM kills counted), its disk reads are counted, and
    the group is gone afterwards; a side the limit refuses is a line, not a traceback."""
    from tests.conftest import REPO

    path = tiny_model_factory(tensor_type="Q4_0", seed=8)
    base = [sys.executable, str(REPO / "scripts" / "bench_vs_llamacpp.py"), "--model", str(path), "--only", "ours",
            "--pp", "8", "--tg", "4", "--reps", "1", "--max-other-cores", "-1", "--no-bandwidth"]
    before = set(os.listdir("/sys/fs/cgroup/memory" if os.path.isdir("/sys/fs/cgroup/memory") else "/sys/fs/cgroup"))
    out = tmp_path / "r.json"
    r = subprocess.run([*base, "--mem-limit", "1500", "--json", str(out)], capture_output=True, text=True,
                       timeout=300, cwd=REPO)
    assert r.returncode == 0, r.stderr[-2000:]
    res = json.loads(out.read_text())["results"]["ours dense"]
    assert 0 < res["cgroup_peak_bytes"] <= 1500 << 20 and res["oom_kills"] == 0 and res["disk_read_bytes"] >= 0
    r = subprocess.run([*base, "--mem-limit", "20"], capture_output=True, text=True, timeout=300, cwd=REPO)
    assert "ours under 20 MB:" in r.stdout and "no side ran under 20 MB" in r.stdout and "Traceback" not in r.stderr
    after = set(os.listdir("/sys/fs/cgroup/memory" if os.path.isdir("/sys/fs/cgroup/memory") else "/sys/fs/cgroup"))
    assert not {d for d in after - before if d.startswith("sparseinfer-bench-")}
