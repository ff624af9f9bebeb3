"""coordinator.runtime.placement under a VRAM budget: greedy optimality, the budget, coverage, CPU shard
balance by expected activations, and the <model>.generated.gpuidx cache (PowerInfer's layout)."""
from __future__ import annotations

import itertools

import numpy as np
import pytest
from gguf import GGMLQuantizationType

from coordinator.runtime.model_files import (
    Profile, gpuidx_path, profile_path, read_gpuidx, save_profile, write_gguf, write_gpuidx,
)
from coordinator.runtime.placement import (
    balance_by_load, budget_plan, choose_hot, neuron_bytes, plan_summary, plan_under_budget, static_plan,
)
from sparsecore.gguf_file import field_value, open_gguf


def _rand_freqs(seed, n_layers, n_ff, skew=1.5):
    rng = np.random.default_rng(seed)
    return [(rng.pareto(skew, n_ff) / 10).clip(0, 1).astype(np.float32) for _ in range(n_layers)]


@pytest.mark.parametrize("fmt", ["f32", "int8"])
def test_neuron_bytes_is_three_rows_as_the_worker_stores_them(fmt):
    import torch

    from sparsecore.ffn import quantize_rows, rows_nbytes

    assert neuron_bytes(576) == 3 * 576 * 4  # float32 by default
    assert neuron_bytes(576, "int8") == 3 * (576 + 4)  # int8 values + a float32 scale per row
    rows = quantize_rows(torch.randn(5, 576), fmt)  # what LayerWeights keeps for 5 neurons' gate rows
    assert neuron_bytes(576, fmt) == 3 * rows_nbytes(rows) // 5


@pytest.mark.parametrize("seed", range(6))
def test_greedy_is_optimal_against_brute_force(seed):
    rng = np.random.default_rng(seed)
    freqs = [rng.choice([0.0, 0.1, 0.25, 0.5, 0.9, 1.0], size=4).astype(np.float32) for _ in range(3)]
    flat = np.concatenate(freqs).astype(np.float64)
    nb = 100
    for budget in range(0, nb * len(flat) + 1, 70):
        hot = choose_hot(freqs, nb, budget)
        got = float(sum(f.astype(np.float64)[h].sum() for f, h in zip(freqs, hot)))
        k = budget // nb
        best = max(sum(flat[list(c)]) for c in itertools.combinations(range(len(flat)), min(k, len(flat))))
        assert got == pytest.approx(best)


@pytest.mark.parametrize("budget", [0, 1, 6911, 6912, 6913, 10 * 6912 - 1, 10 * 6912, 123_456, 10**12])
def test_budget_is_respected_exactly(budget):
    freqs = _rand_freqs(1, 3, 50)
    nb = neuron_bytes(576)
    plan = budget_plan(freqs, nb, budget, 2)
    n_gpu = sum(len(x) for x in plan.shards[0].neurons)
    assert n_gpu * nb <= budget
    assert n_gpu == min(150, budget // nb)  # and nothing that fits is left out
    plan.check_partition()


def test_hot_neurons_are_the_globally_most_frequent():
    freqs = [np.array([0.9, 0.1, 0.5], np.float32), np.array([0.2, 0.95, 0.05], np.float32)]
    plan = budget_plan(freqs, 10, 30, 1)
    assert [x.tolist() for x in plan.shards[0].neurons] == [[0, 2], [1]]
    assert [x.tolist() for x in plan.shards[1].neurons] == [[1], [0, 2]]
    for x in plan.shards[0].neurons + plan.shards[1].neurons:
        assert x.dtype == np.int32


def test_coverage_and_bytes_in_summary():
    freqs = [np.array([0.9, 0.1, 0.5], np.float32), np.array([0.2, 0.95, 0.05], np.float32)]
    plan = budget_plan(freqs, 10, 30, 2)
    s = plan_summary(plan, freqs, 10)
    assert s["coverage"] == pytest.approx((0.9 + 0.5 + 0.95) / 2.7)
    assert s["layers"][0]["coverage"] == pytest.approx(1.4 / 1.5)
    assert s["layers"][1]["hot_share"] == pytest.approx(1 / 3)
    # cold: layer 0 {1: 0.1} -> worker 1; layer 1 {0: 0.2, 2: 0.05}, rotated start -> worker 2 gets 0.2
    assert [w["neurons"] for w in s["workers"]] == [3, 2, 1]
    assert s["gpu_bytes"] == 30 and [w["bytes"] for w in s["workers"]] == [30, 20, 10]
    assert s["workers"][1]["expected_activations_per_token"] == pytest.approx(0.15)
    # CPU workers may hold a neuron in more bytes than the GPU worker (f16's transposed down)
    s = plan_summary(plan, freqs, 10, cpu_neuron_bytes=15)
    assert s["gpu_bytes"] == 30 and [w["bytes"] for w in s["workers"]] == [30, 30, 15]
    assert sum(w["activation_share"] for w in s["workers"]) == pytest.approx(1.0)


def test_cpu_shards_balanced_by_expected_activations_beat_count_balance():
    n_ff, n_cpu = 2000, 3
    freqs = [np.sort(_rand_freqs(7, 1, n_ff, skew=0.8)[0])[::-1].copy()]  # skewed, hottest first
    nb = 1000
    plan = budget_plan(freqs, nb, 200 * nb, n_cpu)
    loads = [float(freqs[0][s.neurons[0]].sum()) for s in plan.shards[1:]]
    # count-balanced split of the same cold neurons (what static_plan does: contiguous, equal counts)
    cold = plan.shards[0].neurons[0]
    cold = np.setdiff1d(np.arange(n_ff), cold)
    count_loads = [float(freqs[0][c].sum()) for c in np.array_split(cold, n_cpu)]
    spread = max(loads) - min(loads)
    assert spread <= float(freqs[0][cold].max()) + 1e-6  # LPT bound: within one neuron's weight
    assert spread < 0.2 * (max(count_loads) - min(count_loads))


def test_balance_by_load_spreads_zero_weights_by_count():
    parts = balance_by_load(np.zeros(10), 3)
    assert sorted(len(p) for p in parts) == [3, 3, 4]
    assert np.array_equal(np.sort(np.concatenate(parts)), np.arange(10))


def test_budget_plan_needs_a_cpu_worker_for_cold_neurons():
    freqs = _rand_freqs(0, 2, 10)
    with pytest.raises(ValueError, match="CPU worker"):
        budget_plan(freqs, 10, 50, 0)
    plan = budget_plan(freqs, 10, 200, 0)  # everything fits
    assert [len(x) for x in plan.shards[0].neurons] == [10, 10]
    with pytest.raises(ValueError):
        budget_plan(freqs, 10, -1, 1)


def test_static_plan_unchanged():
    plan = static_plan(2, 10, 0.3, 2)
    assert [len(x) for x in plan.shards[0].neurons] == [3, 3]


# ---- the gpuidx cache ------------------------------------------------------------------------


def test_gpuidx_round_trip_in_powerinfer_layout(tmp_path):
    freqs = _rand_freqs(3, 4, 32)
    hot = choose_hot(freqs, 12, 12 * 40)
    path = write_gpuidx(tmp_path / "m.gguf.generated.gpuidx", hot,
                        {"model_bytes": 1234, "vram_budget": 480, "neuron_bytes": 12, "profile": "abc"})
    r = open_gguf(path)
    assert field_value(r, "general.architecture") == "generic.gpu_index"
    assert field_value(r, "generic.gpu_index.block_count") == 4
    assert field_value(r, "split.vram_capacity") == 40 * 12
    tensors = {t.name: t for t in r.tensors}
    assert len(tensors) == 2 * 4  # PowerInfer's loader checks n_tensors == 2 * n_layers
    for i in range(4):
        idx, bucket = tensors[f"blk.{i}.gpu_idx"], tensors[f"blk.{i}.gpu_bucket"]
        assert idx.tensor_type == GGMLQuantizationType.I32 and bucket.tensor_type == GGMLQuantizationType.I32
        assert np.array_equal(np.asarray(idx.data), hot[i].astype(np.int32))
        assert np.array_equal(np.asarray(bucket.data), np.flatnonzero(hot[i]))
    back, meta = read_gpuidx(path)
    assert all(np.array_equal(a, b) for a, b in zip(back, hot))
    assert meta["model_bytes"] == 1234 and meta["profile"] == "abc" and meta["vram_capacity"] == 480


def test_a_failed_write_leaves_the_old_file_and_no_partial_one(tmp_path):
    """Side files are written to a temporary name and renamed: a writer that fails midway (as a
    crash or Ctrl-C would) leaves the previous file as it was and no half file beside it."""
    hot = choose_hot(_rand_freqs(3, 2, 16), 12, 12 * 8)
    path = write_gpuidx(tmp_path / "m.gguf.generated.gpuidx", hot, {"neuron_bytes": 12})
    before = path.read_bytes()

    def half(w):
        w.add_block_count(2)
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        write_gguf(path, "generic.gpu_index", half)
    assert path.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == [path.name]


@pytest.fixture
def fake_model(tmp_path):
    model = tmp_path / "m.gguf"
    model.write_bytes(b"GGUF" + bytes(100))  # plan_under_budget only looks at its size and name
    freqs = _rand_freqs(5, 3, 40)
    save_profile(Profile(freqs, {"format": "sparseinfer-profile/1"}), profile_path(model))
    return model, freqs


def _gpu_sets(plan):
    return [x.tolist() for x in plan.shards[0].neurons]


def test_gpuidx_reuse_reset_disable(fake_model):
    model, freqs = fake_model
    nb = neuron_bytes(8)
    gb = 20 * nb / (1 << 30)
    cache = gpuidx_path(model)
    greedy = [np.flatnonzero(h).tolist() for h in choose_hot(freqs, nb, int(gb * (1 << 30)))]

    plan, _, src = plan_under_budget(model, 3, 40, 8, gb, 2, disable_gpu_index=True)
    assert not cache.exists() and src == "computed" and _gpu_sets(plan) == greedy

    plan, _, src = plan_under_budget(model, 3, 40, 8, gb, 2)
    assert cache.exists() and "cached in" in src and _gpu_sets(plan) == greedy

    # A cache that matches model, profile, budget and neuron size is used as it is: plant one
    # with a different (still valid) GPU set and the same metadata.
    _, meta = read_gpuidx(cache)
    planted = [np.zeros(40, bool) for _ in range(3)]
    planted[0][:20] = True
    write_gpuidx(cache, planted, {k: meta[k] for k in ("model_bytes", "profile", "vram_budget", "neuron_bytes", "model")})
    plan, _, src = plan_under_budget(model, 3, 40, 8, gb, 2)
    assert src.startswith("cached") and _gpu_sets(plan) == [list(range(20)), [], []]
    plan.check_partition()

    plan, _, _ = plan_under_budget(model, 3, 40, 8, gb, 2, disable_gpu_index=True)
    assert _gpu_sets(plan) == greedy  # ignored ...
    assert _gpu_sets(plan_under_budget(model, 3, 40, 8, gb, 2)[0]) == [list(range(20)), [], []]  # ... not removed

    plan, _, src = plan_under_budget(model, 3, 40, 8, gb, 2, reset_gpu_index=True)
    assert _gpu_sets(plan) == greedy and "cached in" in src
    assert [np.flatnonzero(h).tolist() for h in read_gpuidx(cache)[0]] == greedy

    # Another budget makes the cache stale: rebuilt, not reused.
    plan, _, src = plan_under_budget(model, 3, 40, 8, 2 * gb, 2)
    assert sum(len(x) for x in plan.shards[0].neurons) == 40 and "cached in" in src

    # A garbage cache file is rebuilt, not an error.
    cache.write_bytes(b"not a gguf")
    plan, _, src = plan_under_budget(model, 3, 40, 8, gb, 2)
    assert _gpu_sets(plan) == greedy


def test_missing_profile_names_the_command(tmp_path):
    model = tmp_path / "x.gguf"
    model.write_bytes(b"GGUF")
    with pytest.raises(ValueError, match="sparseinfer profile -m"):
        plan_under_budget(model, 2, 10, 8, 0.001, 1)


def test_profile_shape_mismatch_is_refused(fake_model):
    model, _ = fake_model
    with pytest.raises(ValueError, match="profile"):
        plan_under_budget(model, 4, 40, 8, 0.001, 1)
