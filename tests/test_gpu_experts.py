"""The GPU worker's experts (issue 42, "Expert placement"): under --vram-budget a routed model's
most-routed experts, by its routing profile, go whole to the GPU worker (coordinator/runtime/
placement.py expert_placement, expert_plan) and the CPU side shares the rest; every process
routes each token itself and computes only the chosen experts it owns (sparsecore/experts.py
ExpertsLayer `owned`; on CUDA, or with converted weights, sparsecore/torch_experts.py
TorchExpertsLayer, routed on the CPU by the same kernel). Each process counts the chosen experts
it computed (the shared segment's route counts), and the run reports the GPU worker's measured
share of the routed work beside the share placement predicted.

No GPU here: the GPU worker runs on the CPU device, on the file's blocks (the native kernels) or,
with --weights f32, in torch (the CUDA path's logic in float32). The tiny models' routes have a
margin (tests/fixtures/tiny_arch.py: no near-tie between the k-th and k+1-th expert), so the same
greedy tokens are expected whichever process computes which expert.
"""
from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

from coordinator.runtime.engine import Engine, EngineOptions
from coordinator.runtime.memory_plan import plan_memory
from coordinator.runtime.model_files import PROFILE_FORMAT, Profile, profile_path, save_profile
from coordinator.runtime.placement import expert_placement, expert_plan, gpu_expert_bytes
from coordinator.serve.metrics import routed_metrics
from sparsecore.config import read_config
from sparsecore.experts import route
from sparsecore.gguf_file import open_gguf
from sparsecore.kernels import FileMatrix
from sparsecore.tensors import TensorStore
from tests.conftest import REPO
from tests.fixtures.child_env import repo_env
from tests.fixtures.decoding import assert_batch_is_alone
from tests.fixtures.tiny_arch import N_EXPERTS, N_FF_EXPERT, write_tiny_arch

PROMPT = [5, 6, 7, 8, 9, 10, 11]
N_NEW = 10
# A budget of three experts of the tiny model (the file's blocks, as the GPU worker holds them on the
# CPU device): every expert weighs the same there.
N_PLACED = 3


@pytest.fixture(scope="module")
def profiled(tmp_path_factory):
    """The tiny qwen3moe and qwen2moe files, each with a routing profile beside it whose counts
    favour different experts in each layer (so a placement is not the same experts everywhere)."""
    out = {}
    for arch in ("qwen3moe", "qwen2moe"):
        path = write_tiny_arch(tmp_path_factory.mktemp(arch) / f"{arch}.gguf", arch)
        cfg = read_config(path, open_gguf(path))
        rng = np.random.default_rng(7)
        freqs = [rng.random(cfg.n_experts).astype(np.float32) for _ in range(cfg.n_layers)]
        save_profile(Profile(freqs, {"format": PROFILE_FORMAT, "unit": "expert", "tokens": 64}), profile_path(path))
        out[arch] = (path, cfg, freqs)
    return out


def budget_gib(path, cfg, weights: str, n: int) -> float:
    """A budget holding n experts as the GPU worker holds them without CUDA, and a little more."""
    one = gpu_expert_bytes(TensorStore(path, open_gguf(path)), cfg, weights, cuda=False)
    return (n + 0.5) * one / (1 << 30)


def run(path, observe: bool = False, **opts):
    """Greedy tokens after PROMPT, the engine's plan and workers' Ready, its run stats, and (observe)
    every FFN input the coordinator posted, by layer."""
    seen = []
    with Engine(path, EngineOptions(cpu_workers=1, threads=2, fast=False, gpu_device="cpu", **opts)) as eng:
        if observe:
            eng.ffn.observer = lambda layer, x, *_: seen.append((layer, np.array(x)))
        toks = list(eng.generate(PROMPT, N_NEW, stop_at_eos=False))
        assert eng.routed_work() == {**eng.stats()["routed"]}  # one run since the start: the same counts
        held = {w.role: np.frombuffer(w.experts, np.uint8).reshape(eng.cfg.n_layers, -1).astype(bool)
                for w in eng.pool.workers}
        devices = {w.role: w.device for w in eng.pool.workers}
        return toks, eng.plan, held, devices, eng.stats(), eng.expert_placement, seen


def routes_on(path, cfg, seen, experts) -> tuple[int, int, list[int]]:
    """(routed choices in all, those on `experts` per layer, the others dealt to two processes:
    the first, third.. of each token's and the second, fourth..), routing every observed FFN
    input with the engine's kernel over the file's router: a count made apart from the processes'."""
    store = TensorStore(path, open_gguf(path))
    total = on = 0
    dealt = [0, 0]
    for layer, x in seen:
        ids = route(FileMatrix(store.info(f"blk.{layer}.ffn_gate_inp.weight")), x, cfg.n_experts_used,
                    cfg.expert_norm)[0]
        total += ids.size
        placed = np.isin(ids, experts[layer])
        on += int(placed.sum())
        for row in placed:
            rest = int((~row).sum())
            dealt[0], dealt[1] = dealt[0] + (rest + 1) // 2, dealt[1] + rest // 2
    return total, on, dealt


@pytest.mark.parametrize("arch", ["qwen3moe", "qwen2moe"])
def test_the_gpu_worker_owns_the_most_routed_experts_and_the_tokens_do_not_change(profiled, arch, no_leaks):
    path, cfg, freqs = profiled[arch]
    want, *_ = run(path)
    toks, plan, held, devices, stats, placed, seen = run(path, observe=True,
                                                         vram_budget_gb=budget_gib(path, cfg, "gguf", N_PLACED))
    assert toks == want
    # the CPU worker and the coordinator deal the other experts: each holds them whole
    assert [s.role for s in plan.shards] == ["gpu", "cpu", "coordinator"] and stats["routed"]["dealt"] == [1, 2]
    # the placement is the profile's most-routed experts, and the workers hold exactly those
    expected = expert_placement(freqs, gpu_expert_bytes(TensorStore(path, open_gguf(path)), cfg, "gguf", False),
                                int(budget_gib(path, cfg, "gguf", N_PLACED) * (1 << 30)))
    assert placed["placed"] == N_PLACED == expected["placed"]
    order = np.argsort(-np.stack(freqs), axis=None, kind="stable")[:N_PLACED]
    top = np.zeros((cfg.n_layers, cfg.n_experts), bool)
    top.flat[order] = True
    np.testing.assert_array_equal(held["gpu"], top)
    np.testing.assert_array_equal(held["cpu"], ~top)
    assert devices["gpu"] == "cpu"
    # the GPU worker holds all neurons of its experts, the others the rest of every other expert
    assert [len(n) for n in plan.shards[0].neurons] == [N_FF_EXPERT if t.any() else 0 for t in top]
    # the measured share: what each process counted is a count made apart from them
    total, on_gpu, dealt = routes_on(path, cfg, seen, [np.flatnonzero(t) for t in top])
    assert total == (len(PROMPT) + N_NEW - 1) * cfg.n_layers * cfg.n_experts_used
    routed = stats["routed"]
    by_role = {p["role"]: p for p in routed["processes"]}
    assert routed["routes"] == total and by_role["gpu"]["routes"] == on_gpu > 0
    assert [by_role["cpu"]["routes"], by_role["coordinator"]["routes"]] == dealt
    assert sum(dealt) == total - on_gpu and min(dealt) > 0
    assert by_role["gpu"]["share"] == pytest.approx(on_gpu / total)
    assert routed["predicted_share"] == pytest.approx(expected["predicted_share"])
    # the server's metrics carry the same counts
    families = {f.name: f for f in routed_metrics(routed)}
    assert families["sparseinfer_routed_choices"].samples[0].value == total
    assert {tuple(s.labels.values()): s.value for s in families["sparseinfer_routed_choices_computed"].samples} == {
        ("gpu", "0"): on_gpu, ("cpu", "1"): dealt[0], ("coordinator", "2"): dealt[1]}
    assert families["sparseinfer_routed_share_predicted"].samples[0].value == pytest.approx(
        expected["predicted_share"])


@pytest.mark.parametrize("arch", ["qwen3moe", "qwen2moe"])
def test_the_torch_expert_path_gives_the_same_tokens(profiled, arch, no_leaks):
    """--weights f32: every process's experts are float32 copies computed in torch (the GPU
    worker's CUDA path, float16 there), routed on the CPU by the native kernel."""
    path, cfg, _ = profiled[arch]
    want, *_ = run(path)
    toks, _, held, _, stats, placed, seen = run(path, observe=True, weights="f32",
                                                vram_budget_gb=budget_gib(path, cfg, "f32", N_PLACED))
    assert toks == want
    assert placed["placed"] == N_PLACED and int(held["gpu"].sum()) == N_PLACED
    total, on_gpu, _ = routes_on(path, cfg, seen, placed["experts"])
    gpu = next(p for p in stats["routed"]["processes"] if p["role"] == "gpu")
    assert stats["routed"]["routes"] == total and gpu["routes"] == on_gpu
    assert stats["routed"]["dealt"] == []  # float copies in torch are split by ranges


@pytest.mark.parametrize("arch", ["qwen3moe", "qwen2moe"])
@pytest.mark.parametrize("fast", [False, True], ids=["exact", "fast"])
def test_a_continuous_batch_under_a_budget_decodes_each_sequence_as_alone(profiled, arch, fast, no_leaks):
    """The server's batches group tokens by expert in every process, each computing only the
    experts it owns: every row's logits equal its sequence's decoded alone, bit for bit."""
    path, cfg, _ = profiled[arch]
    prompts = [PROMPT, [9, 8, 7, 6], [20, 21, 22, 23, 24, 25]]
    opts = EngineOptions(cpu_workers=1, threads=2, fast=fast, gpu_device="cpu", kv_caches=2 * len(prompts) + 1,
                         vram_budget_gb=budget_gib(path, cfg, "gguf", N_PLACED))
    with Engine(path, opts) as eng:
        assert eng.expert_placement["placed"] == N_PLACED
        assert_batch_is_alone(eng.model, prompts)
        routed = eng.routed_work()
        gpu = next(p for p in routed["processes"] if p["role"] == "gpu")
        assert 0 < gpu["routes"] < routed["routes"]


def test_a_budget_over_every_expert_leaves_the_cpu_side_the_shared_expert(profiled, no_leaks):
    """qwen2moe: with every routed expert on the GPU worker the CPU side computes only its ranges
    of the shared expert, which is every token's."""
    path, cfg, _ = profiled["qwen2moe"]
    want, *_ = run(path)
    toks, plan, held, _, stats, placed, _ = run(path, vram_budget_gb=1.0)
    assert toks == want and held["gpu"].all() and not held["cpu"].any()
    assert placed["predicted_share"] == 1.0
    assert all(len(n) for n in plan.shards[1].neurons)  # the shared expert's range of every layer
    gpu = next(p for p in stats["routed"]["processes"] if p["role"] == "gpu")
    assert gpu["share"] == 1.0


@pytest.mark.parametrize("budget,profile,word", [
    (-1.0, "ok", "budget cannot be negative"),
    (1e-9, "ok", "holds no expert"),
    (1.0, "missing", "no routing profile"),
    (1.0, "neurons", "not a routing profile"),
])
def test_bad_budgets_and_profiles_are_one_line(tmp_path, budget, profile, word):
    path = write_tiny_arch(tmp_path / "m.gguf", "qwen3moe")
    cfg = read_config(path, open_gguf(path))
    if profile != "missing":
        unit, width = ("expert", cfg.n_experts) if profile == "ok" else ("neuron", cfg.n_ff)
        save_profile(Profile([np.ones(width, np.float32)] * cfg.n_layers, {"format": PROFILE_FORMAT, "unit": unit}),
                     profile_path(path))
    with pytest.raises(ValueError) as e:
        Engine(path, EngineOptions(cpu_workers=1, threads=2, vram_budget_gb=budget), plan_only=True)
    assert word in str(e.value) and "\n" not in str(e.value)


def test_expert_plan_partitions_every_experts_neurons():
    gpu = [np.array([1, 4]), np.array([], np.int64), np.arange(8)]
    plan = expert_plan(3, 64, gpu, 8, True, 2, 0.25, 16)
    gpu_shard, *cpu_side = plan.shards
    assert [s.role for s in plan.shards] == ["gpu", "cpu", "cpu", "coordinator"]
    assert gpu_shard.experts[0, [1, 4]].all() and gpu_shard.experts[0].sum() == 2
    assert [len(n) for n in gpu_shard.neurons] == [64, 0, 64]
    assert not gpu_shard.experts[:, 8].any()  # the shared expert stays with the CPU side
    for s in cpu_side:
        np.testing.assert_array_equal(s.experts, ~gpu_shard.experts)
        assert all(len(n) % 16 == 0 for n in s.neurons)
    # the CPU side's ranges cover each of their experts' 64 neurons once (check_partition ran)
    assert sum(len(s.neurons[1]) for s in cpu_side) == 64
    gpu_shard.experts[0, 2] = True  # expert 2 of layer 0 now owned twice
    with pytest.raises(AssertionError, match="layer 0, expert 2"):
        plan.check_partition()


def test_the_memory_plan_takes_the_gpu_workers_experts_out_of_ram(profiled):
    """On a CUDA device the GPU worker's experts are float16 copies in VRAM: the memory plan counts
    them there (a vram row) and that share of the experts' tensors no longer in RAM."""
    path, cfg, _ = profiled["qwen3moe"]
    store = TensorStore(path, open_gguf(path))
    names = [t.name for t in store.reader.tensors]
    common = dict(fast=True, weights="gguf", row_layout="gate+up", sparse=False, n_workers=2, ffn_processes=3)
    ram = plan_memory(store, cfg, names, **common)
    half = plan_memory(store, cfg, names, **common, gpu_experts=[0.5] * cfg.n_layers, vram=12345)
    experts = sum(int(store.by_name[n].n_bytes) for n in names if "_exps." in n)
    assert ram.vram == 0 and half.vram == 12345 and ("vram", 12345) in [(k, b) for k, b, _ in half.rows()]
    assert ram.copied + ram.mapped - (half.copied + half.mapped) == pytest.approx(experts / 2, abs=16)
    assert half.runtime > ram.runtime  # the GPU worker imports torch


def test_generate_reports_the_measured_share_beside_infos_prediction(profiled, no_leaks):
    """`info --vram-budget` predicts the GPU worker's share; `generate --vram-budget` places the same
    experts and prints the share it measured beside that prediction."""
    path, cfg, _ = profiled["qwen3moe"]
    budget = f"{budget_gib(path, cfg, 'gguf', N_PLACED):.9f}"
    cli = [sys.executable, "-m", "coordinator"]
    info = subprocess.run(cli + ["info", "-m", str(path), "--vram-budget", budget], capture_output=True, text=True,
                          timeout=300, cwd=REPO, env=repo_env())
    assert info.returncode == 0, info.stderr
    predicted = next(l for l in info.stdout.splitlines() if l.startswith("predicted share")).split()[2]
    gen = subprocess.run(cli + ["generate", "-m", str(path), "-p", "Hello there", "-n", "6", "--threads", "2",
                                "--vram-budget", budget], capture_output=True, text=True, timeout=300, cwd=REPO,
                         env=repo_env())
    assert gen.returncode == 0, gen.stderr
    assert "GPU worker " in gen.stderr and f"(predicted {predicted})" in gen.stderr
    bad = subprocess.run(cli + ["generate", "-m", str(path), "-p", "Hi", "-n", "2", "--vram-budget", "1e-9"],
                         capture_output=True, text=True, timeout=300, cwd=REPO, env=repo_env())
    assert bad.returncode != 0 and "holds no expert" in bad.stderr and "Traceback" not in bad.stderr
    assert len(bad.stderr.strip().splitlines()) == 1
    negative = subprocess.run(cli + ["info", "-m", str(path), "--vram-budget", "-1"], capture_output=True, text=True,
                              timeout=300, cwd=REPO, env=repo_env())
    assert negative.returncode != 0 and negative.stderr.strip() == "error: --vram-budget -1.0: a budget cannot be negative"
