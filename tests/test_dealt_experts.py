"""Dealt experts (sparsecore/experts.py ExpertsLayer `deal`, moe_step.c moe_token, coordinator/
runtime/placement.py deal_experts): the CPU's processes hold every expert whole and each computes
every dealers-th of a token's chosen experts, in order of probability, instead of a range of
each. The shares must sum to the whole layer, each choice computed once, counted by the process
that computed it, a batch's rows as each token alone; the engine deals where the layouts are
shared through the layout cache, and its tokens stay transformers' (tests/test_moe.py runs
the oracle on both splits)."""
from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

from coordinator.runtime.engine import Engine, EngineOptions, routed_shares
from coordinator.runtime.placement import WorkerShard, Plan, deal_experts
from sparsecore.config import read_config
from sparsecore.experts import ExpertsLayer, deal_flags, dealt
from sparsecore.gguf_file import open_gguf
from sparsecore.kernels import FfnScratch
from sparsecore.tensors import TensorStore
from tests.conftest import REPO
from tests.fixtures.child_env import repo_env
from tests.fixtures.tiny_arch import N_EXPERTS, N_FF_EXPERT, N_USED, write_tiny_arch

TOKENS = 12


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    d = tmp_path_factory.mktemp("dealt")
    return {arch: write_tiny_arch(d / f"tiny-{arch}.gguf", arch) for arch in ("qwen3moe", "qwen2moe")}


def layers(path, fast: bool, shares):
    """Layer 0's ExpertsLayer for each (own range, deal) of `shares`."""
    store = TensorStore(path, open_gguf(path))
    cfg = read_config(path, store.reader)
    return cfg, [ExpertsLayer(store, 0, own, fast, FfnScratch(cfg.hidden, len(own)), cfg, deal=deal)
                 for own, deal in shares]


def inputs(cfg, n: int = TOKENS) -> np.ndarray:
    return np.random.default_rng(7).standard_normal((n, cfg.hidden)).astype(np.float32)


@pytest.mark.parametrize("arch", ["qwen3moe", "qwen2moe"])
@pytest.mark.parametrize("fast", [False, True], ids=["exact", "fast"])
def test_two_dealt_shares_sum_to_the_whole_layer_each_choice_once(models, arch, fast):
    """Each token's 2 chosen experts: the first to phase 0, the second to phase 1, whole; the
    shared expert (qwen2moe) still by the ranges. The shares' sum is the undivided layer."""
    half = N_FF_EXPERT // 2
    cfg, (whole, p0, p1) = layers(models[arch], fast, [(range(0, N_FF_EXPERT), None),
                                                       (range(0, half), (0, 2)), (range(half, N_FF_EXPERT), (1, 2))])
    x = inputs(cfg)
    ids, _ = whole.route(x)
    for t in range(TOKENS):
        outs = [np.empty(cfg.hidden, np.float32) for _ in range(3)]
        n = [layer.token_into(x[t], cfg.activation, None, None, out) for layer, out in zip((whole, p0, p1), outs)]
        np.testing.assert_allclose(outs[1] + outs[2], outs[0], rtol=1e-4, atol=1e-4 if fast else 1e-5)
        assert n[1] + n[2] == n[0]  # dense: every neuron of each chosen expert, once
    # each process counted the choices it computed: the first of each token's, the second
    for phase, layer in enumerate((p0, p1)):
        np.testing.assert_array_equal(layer.counts, np.bincount(ids[:, phase], minlength=N_EXPERTS))
    np.testing.assert_array_equal(p0.counts + p1.counts, whole.counts)
    # a token reads half the experts whole, not a range of each
    assert p0.nbytes == p1.nbytes and p0.own == p1.own == range(0, N_FF_EXPERT)
    if arch == "qwen2moe":  # twice the neurons of an expert, by the ranges
        assert (p0.shared.own, p1.shared.own) == (range(0, N_FF_EXPERT), range(N_FF_EXPERT, 2 * N_FF_EXPERT))


def thresholds(kind: str):
    """A step's CATS thresholds: none (dense), one for every expert, or one per expert, some dense (< 0)."""
    return {"dense": None, "one": 0.02, "each": np.linspace(-0.01, 0.05, N_EXPERTS).astype(np.float32)}[kind]


@pytest.mark.parametrize("kind", ["dense", "one", "each"])
@pytest.mark.parametrize("fast", [False, True], ids=["exact", "fast"])
@pytest.mark.parametrize("deal", [None, (0, 2), (1, 2)], ids=["whole", "phase0", "phase1"])
def test_a_batch_row_is_the_token_alone_bit_for_bit(models, fast, deal, kind):
    """batch_into (moe_step.c moe_batch) groups the tokens by expert and computes only the choices
    this process computes: each row is what token_into gives that token, bit for bit (continuous
    batching must not change a reply), dense or at each expert's threshold; the route counts
    grow alike; a prompt's step gives the same share within rounding."""
    half = N_FF_EXPERT // 2
    own = range(0, N_FF_EXPERT) if deal is None else range(half * deal[0], half * (deal[0] + 1))
    x, thr = inputs(read_config(models["qwen3moe"], open_gguf(models["qwen3moe"])), 5), thresholds(kind)
    (cfg, (alone_layer,)), (_, (batch_layer,)) = (layers(models["qwen3moe"], fast, [(own, deal)]) for _ in range(2))
    alone = np.empty_like(x)
    n_alone = sum(alone_layer.token_into(x[t], cfg.activation, None, thr, alone[t]) for t in range(len(x)))
    together = np.full_like(x, np.nan)
    n_together = batch_layer.batch_into(x, cfg.activation, None, thr, together)
    np.testing.assert_array_equal(together, alone)
    assert n_together == n_alone > 0 and (kind == "dense") == (n_alone == len(x) * N_FF_EXPERT * (1 if deal else 2))
    np.testing.assert_array_equal(batch_layer.counts, alone_layer.counts)
    prompt, _ = batch_layer.step(x, cfg.activation, None, thr)
    np.testing.assert_allclose(prompt, alone, rtol=1e-3, atol=1e-3)


def test_the_deal_rule_and_its_flags():
    """dealt(): of each token's owned choices, every dealers-th from phase (moe_token's rule);
    experts another process owns whole (the GPU worker's) are not counted in the turns."""
    ids = np.array([[3, 1, 0, 2], [0, 1, 2, 3]])
    owned = np.array([True, False, True, True])
    np.testing.assert_array_equal(dealt(ids, owned, (0, 2)), [[True, False, False, True], [True, False, False, True]])
    np.testing.assert_array_equal(dealt(ids, owned, (1, 2)), [[False, False, True, False], [False, False, True, False]])
    np.testing.assert_array_equal(dealt(ids, owned, None), owned[ids])
    assert deal_flags(None) == 0 and deal_flags((1, 3)) == (1 << 8) | (3 << 16)
    for bad in ((2, 2), (-1, 2), (0, 256)):
        with pytest.raises(ValueError, match="dealers"):
            deal_flags(bad)


def test_the_cpu_processes_deal_the_gpu_worker_keeps_its_experts():
    """deal_experts: phases in slot order over the CPU's processes that hold neurons; one such
    process, or none, deals nothing."""
    held, empty = [np.arange(4, dtype=np.int32)], [np.zeros(0, np.int32)]
    plan = Plan(1, 4, [WorkerShard("gpu", 0, held), WorkerShard("cpu", 1, held), WorkerShard("cpu", 2, empty),
                       WorkerShard("coordinator", 3, held)])
    assert deal_experts(plan) == {1: (0, 2), 3: (1, 2)}
    assert deal_experts(Plan(1, 4, [WorkerShard("gpu", 0, held), WorkerShard("cpu", 1, held)])) == {}


def test_routed_shares_sum_the_dealt_counts():
    """A GPU worker's experts counted by it alone, the rest split between two dealt processes: the
    routes are each expert's choices once."""
    counts = np.array([[[5, 0, 0]], [[0, 2, 1]], [[0, 3, 4]]])  # (slots, layers, experts)
    shards = [WorkerShard(r, i, []) for i, r in enumerate(("gpu", "cpu", "coordinator"))]
    out = routed_shares(counts, shards, dealt=[1, 2])
    assert out["routes"] == 15 and out["dealt"] == [1, 2]
    assert [p["routes"] for p in out["processes"]] == [5, 3, 7]
    assert routed_shares(counts, shards)["routes"] == 5 + 3 + 4  # by ranges: the largest count


def test_the_engine_deals_where_the_layouts_are_shared_and_not_where_they_are_copied(models, no_leaks, monkeypatch):
    """With the layout cache (the tests' own directory), everything held: the CPU worker and the
    coordinator deal; SPARSEINFER_EXPERT_SPLIT=ranges, or sparse decoding's twins (a copy per
    process), keep the ranges. The greedy tokens of both splits agree on this F32 file."""
    opts = EngineOptions(cpu_workers=1, threads=2, fast=False)
    with Engine(models["qwen3moe"], opts) as eng:
        computing = tuple(i for i, s in enumerate(eng.plan.shards) if s.role != "gpu" and any(map(len, s.neurons)))
        assert len(computing) == 2 and eng.dealt == computing
        dealt_tokens = list(eng.generate([1, 2, 3, 4], 8, stop_at_eos=False))
        assert eng.routed_work()["dealt"] == list(eng.dealt)
    monkeypatch.setenv("SPARSEINFER_EXPERT_SPLIT", "ranges")
    with Engine(models["qwen3moe"], opts) as eng:
        assert eng.dealt == ()
        assert list(eng.generate([1, 2, 3, 4], 8, stop_at_eos=False)) == dealt_tokens
    monkeypatch.setenv("SPARSEINFER_EXPERT_SPLIT", "whole")
    with pytest.raises(ValueError, match="SPARSEINFER_EXPERT_SPLIT='whole': dealt or ranges"):
        Engine(models["qwen3moe"], opts, plan_only=True)


@pytest.mark.parametrize("split", ["dealt", "ranges"])
def test_info_says_how_the_experts_are_split(models, split):
    """`sparseinfer info` says whether the processes deal the experts, as the engine would."""
    env = {**repo_env(), "SPARSEINFER_EXPERT_SPLIT": split}
    run = lambda *more: subprocess.run([sys.executable, "-m", "coordinator", "info", "-m", str(models["qwen3moe"]),  # noqa: E731
                                        "-t", "2", *more], capture_output=True, text=True, timeout=300, cwd=REPO,
                                       env=env)
    text, as_json = run(), run("--json")
    assert text.returncode == 0 == as_json.returncode, text.stderr + as_json.stderr
    line = next(l for l in text.stdout.splitlines() if l.startswith("experts "))
    if split == "dealt":
        assert f"dealt between 2 processes: each computes about {N_USED // 2} of a token's {N_USED}" in line
    else:
        assert "a range of every chosen expert's neurons" in line
    assert json.loads(as_json.stdout)["experts_dealt_between"] == (2 if split == "dealt" else 0)


def test_a_dealt_shard_has_one_scratch_for_every_layer(models):
    """FfnShard.load sizes its one scratch for whole experts where it deals: no layer makes its own."""
    from sparsecore.shard import FfnShard

    path = models["qwen3moe"]
    cfg = read_config(path, open_gguf(path))
    half = [np.arange(N_FF_EXPERT // 2, dtype=np.int64)] * cfg.n_layers
    shard = FfnShard.load(path, half, "cpu", "gguf", deal=(0, 2))
    scratches = {id(e.scratch) for w in shard.layers.values() for e in w.experts if e is not None}
    assert len(scratches) == 1
    assert next(e for e in shard.layers[0].experts if e is not None).scratch.n_own == N_FF_EXPERT
