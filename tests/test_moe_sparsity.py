"""CATS sparsity inside routed experts (sparsecore/experts.py ExpertsLayer, moe_step.c moe_token):
each chosen expert skips the neurons whose |act(gate_e x)| is at or below that expert's own
threshold, calibrated per (layer, expert) by `sparseinfer calibrate` (coordinator/tools/
calibrate.py expert_levels) and carried to every process in shared memory.

The oracle is a float64 numpy emulation of the tiny qwen3moe model's routed FFN (tests/fixtures/
tiny_arch.py: 8 experts, 2 chosen, 64 neurons each, F32 weights): route as the engine routes,
then per chosen expert h = silu(gate_e x) * (up_e x) with the inactive neurons zeroed, summed
through down_e times the route's weight. Exact arithmetic: within float32 rounding."""
from __future__ import annotations

import json

import numpy as np
import pytest

from coordinator.runtime.engine import Engine, EngineOptions
from coordinator.runtime.model_files import save_thresholds, thresholds_path
from sparsecore.config import read_config
from sparsecore.gguf_file import open_gguf
from sparsecore.kernels import FileMatrix
from sparsecore.experts import ExpertsLayer, route
from sparsecore.shard import FfnShard
from sparsecore.tensors import TensorStore
from tests.fixtures.tiny_arch import N_EXPERTS, N_FF_EXPERT, write_tiny_arch

LEVEL = 0.5


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return write_tiny_arch(tmp_path_factory.mktemp("moe_sparsity") / "tiny-qwen3moe.gguf", "qwen3moe")


class Emulation:
    """The routed FFN of each layer in float64 over the file's values, thresholds per expert."""

    def __init__(self, path):
        reader = open_gguf(path)
        self.cfg = cfg = read_config(path, reader)
        self.store = store = TensorStore(path, reader)
        self.router = [FileMatrix(store.info(f"blk.{i}.ffn_gate_inp.weight")) for i in range(cfg.n_layers)]
        self.w = [[[FileMatrix(store.expert(f"blk.{i}.ffn_{n}_exps.weight", e)).dequantize().astype(np.float64)
                    for n in ("gate", "up", "down")] for e in range(cfg.n_experts)] for i in range(cfg.n_layers)]

    def gates(self, layer: int, e: int, x: np.ndarray) -> np.ndarray:
        """|silu(gate_e x)| for rows x, float64."""
        g = x.astype(np.float64) @ self.w[layer][e][0].T
        return np.abs(g / (1 + np.exp(-g)))

    def ffn(self, layer: int, x: np.ndarray, thr) -> tuple[np.ndarray, int]:
        """(y (T, hidden) float32, active neurons) for FFN inputs x (T, hidden); thr: None (dense)
        or per expert (E,)."""
        ids, weights = route(self.router[layer], x, self.cfg.n_experts_used, self.cfg.expert_norm)
        y, n = np.zeros(x.shape, np.float64), 0
        for t, row in enumerate(x.astype(np.float64)):
            for e, w in zip(ids[t], weights[t]):
                gate, up, down = self.w[layer][e]
                g = gate @ row
                a = g / (1 + np.exp(-g))
                keep = np.ones_like(a, bool) if thr is None else np.abs(a) > thr[e]
                y[t] += float(w) * (down @ (a * (up @ row) * keep))
                n += int(keep.sum())
        return y.astype(np.float32), n


@pytest.fixture(scope="module")
def emulation(model):
    return Emulation(model)


def _skewed(emu: Emulation, xs: list[np.ndarray]) -> np.ndarray:
    """Thresholds per (layer, expert) far apart: each expert's median |act| on the rows xs[layer]
    routed to it, times 0.4 or 2.5 by turns (some experts nearly dense, others nearly empty)."""
    out = np.zeros((emu.cfg.n_layers, emu.cfg.n_experts), np.float32)
    for i in range(emu.cfg.n_layers):
        for e in range(emu.cfg.n_experts):
            out[i, e] = np.median(emu.gates(i, e, xs[i])) * (0.4 if e % 2 else 2.5)
    return out


@pytest.fixture(scope="module")
def shard(model):
    cfg = read_config(model, open_gguf(model))
    return FfnShard.load(model, [np.arange(N_FF_EXPERT)] * cfg.n_layers, weights="gguf", fast=False)


def _inputs(n: int, seed: int = 0) -> np.ndarray:
    from tests.fixtures.tiny_arch import HIDDEN

    return np.random.default_rng(seed).standard_normal((n, HIDDEN)).astype(np.float32)


def test_a_token_skips_each_chosen_experts_inactive_neurons_at_its_own_threshold(shard, emulation):
    """token_into at per-expert thresholds is the emulation's output and count; one threshold for
    every expert (the layer's mean of them) gives another output: the per-expert row is used."""
    xs = _inputs(12)
    thr = _skewed(emulation, [xs] * emulation.cfg.n_layers)
    for layer, w in shard.layers.items():
        assert isinstance(w, ExpertsLayer)
        one = np.full(N_EXPERTS, thr[layer].mean(), np.float32)
        for x in xs:
            out = np.empty_like(x)
            n = w.token_into(x, "silu", None, thr[layer], out)
            want, n_want = emulation.ffn(layer, x[None], thr[layer])
            np.testing.assert_allclose(out, want[0], rtol=0, atol=2e-5 * np.abs(want).max())
            assert n == n_want < 2 * N_FF_EXPERT
            single, _ = emulation.ffn(layer, x[None], one)
            assert np.abs(single - want).max() > 1e-2 * np.abs(want).max()
            dense = np.empty_like(x)
            assert w.token_into(x, "silu", None, None, dense) == 2 * N_FF_EXPERT
            np.testing.assert_allclose(dense, emulation.ffn(layer, x[None], None)[0][0], rtol=0,
                                       atol=2e-5 * np.abs(want).max())


@pytest.mark.parametrize("fast", [False, True], ids=["exact", "fast"])
def test_batch_rows_equal_the_lone_token_bit_for_bit(model, emulation, fast, isa):
    """A continuous batch (tokens grouped by expert, each expert's tokens through ffn_batch at its
    threshold) gives each row what the token alone gets, at every instruction set level; a
    scalar threshold is every expert's."""
    cfg = emulation.cfg
    sh = FfnShard.load(model, [np.arange(N_FF_EXPERT)] * cfg.n_layers, weights="gguf", fast=fast,
                       row_layout="gate" if fast else "")
    xs = _inputs(7, seed=1)
    thr = _skewed(emulation, [xs] * cfg.n_layers)
    for layer, w in sh.layers.items():
        for t in (thr[layer], float(thr[layer].mean())):
            batch = np.empty_like(xs)
            n = w.batch_into(xs, "silu", None, t, batch)
            alone = np.empty_like(xs)
            m = sum(w.token_into(x, "silu", None, t, alone[i]) for i, x in enumerate(xs))
            np.testing.assert_array_equal(batch, alone)
            assert n == m


def test_a_prompt_step_thresholds_each_expert_as_the_emulation(shard, emulation):
    """The prompt path (ExpertsLayer.step: numpy GEMMs over more than MAX_SMALL_BATCH tokens) at
    per-expert thresholds."""
    xs = _inputs(20, seed=2)
    thr = _skewed(emulation, [xs] * emulation.cfg.n_layers)
    for layer, w in shard.layers.items():
        y, n = w.step(xs, "silu", None, thr[layer])
        want, n_want = emulation.ffn(layer, xs, thr[layer])
        np.testing.assert_allclose(y, want, rtol=0, atol=2e-5 * np.abs(want).max())
        assert n == n_want


def test_bad_expert_thresholds_are_one_line(shard):
    w = shard.layers[0]
    x = _inputs(1)[0]
    with pytest.raises(ValueError, match="one contiguous float32 per expert"):
        w.token_into(x, "silu", None, np.zeros(3, np.float32), np.empty_like(x))


@pytest.fixture(scope="module")
def calibrated(model, emulation):
    """The tiny model calibrated on random token windows (seeded), its thresholds file beside it."""
    from coordinator.tools.calibrate import calibrate

    rng = np.random.default_rng(0)
    with Engine(model, EngineOptions(cpu_workers=1, threads=2, fast=False)) as eng:
        chunks = [rng.integers(3, 200, 32).tolist() for _ in range(8)]
        table = calibrate(eng, chunks, levels=(0.3, LEVEL, 0.7))
        held, seen = [rng.integers(3, 200, 32).tolist() for _ in range(4)], {}

        def keep(layer, x, *_):
            seen.setdefault(layer, []).append(x.copy())
        eng.ffn.observer = keep
        for c in held:
            eng.forward_logits(c)
        eng.ffn.observer = None
    save_thresholds(model, table)
    return table, {i: np.concatenate(v) for i, v in seen.items()}


def test_calibrate_writes_per_expert_thresholds_that_meet_the_level_on_held_out_tokens(model, emulation,
                                                                                         calibrated):
    table, held = calibrated
    stored = json.loads(thresholds_path(model).read_text())
    assert set(stored["expert_levels"]) == {"0.30", "0.50", "0.70"} and "input_levels" not in stored
    cfg = emulation.cfg
    for key, s in (("0.30", 0.3), ("0.50", 0.5), ("0.70", 0.7)):
        per = np.asarray(stored["expert_levels"][key], np.float32)
        assert per.shape == (cfg.n_layers, N_EXPERTS)
        assert (per[:, 1:] != per[:, :1]).any()  # experts' own thresholds, not one per layer
        for layer in range(cfg.n_layers):
            x = held[layer]
            ids = route(emulation.router[layer], x, cfg.n_experts_used, cfg.expert_norm)[0]
            off = total = 0
            for e in range(N_EXPERTS):
                rows = np.flatnonzero((ids == e).any(axis=1))
                mags = emulation.gates(layer, e, x[rows])
                off, total = off + int((mags <= per[layer, e]).sum()), total + mags.size
            assert abs(off / total - s) < 0.08, (key, layer, off / total)


@pytest.mark.parametrize("path", ["auto", "lockstep"])
def test_the_engine_decodes_each_expert_at_its_threshold_as_the_emulation(model, emulation, calibrated, tmp_path,
                                                                          path, no_leaks):
    """A worker and the coordinator each hold half of every expert's neurons and read the
    per-expert thresholds from shared memory: a decoded token's logits are those of the model
    with the emulated FFN at the same thresholds, and not those at one threshold a layer."""
    _, held = calibrated
    stored = json.loads(thresholds_path(model).read_text())
    skew = _skewed(emulation, [held[i] for i in range(emulation.cfg.n_layers)])
    stored["expert_levels"][f"{LEVEL:.2f}"] = skew.tolist()
    tfile = tmp_path / "skewed.thresholds.json"
    tfile.write_text(json.dumps(stored))
    opts = EngineOptions(cpu_workers=1, threads=2, fast=False, sparsity=LEVEL, sparse_method="cats",
                         thresholds_file=str(tfile), decode_path=path, kv_caches=2,
                         adaptive_spin=False if path == "lockstep" else None)
    ids = [5, 17, 40, 9, 23, 61]
    with Engine(model, opts) as eng:
        assert (eng.pool.buffers.expert_thresholds == skew).all()
        eng.reset()
        eng.model.forward(ids[:-1])
        got = eng.model.forward(ids[-1:])[-1]  # a decoded token: the experts at their thresholds
        if path == "lockstep":
            assert len(eng.ffn.stats.lockstep_us) == 1
        want, one = [], np.asarray(stored["levels"][f"{LEVEL:.2f}"], np.float32)
        for thr in (skew, np.repeat(one[:, None], N_EXPERTS, axis=1)):
            eng.reset()
            eng.model.forward(ids[:-1])
            real = eng.model.ffn
            eng.model.ffn = lambda layer, x, before, decode=None, thr=thr: emulation.ffn(layer, x, thr[layer])[0]
            try:
                want.append(eng.model.forward(ids[-1:])[-1])
            finally:
                eng.model.ffn = real
        eng.set_sparsity(None)
        assert (eng.pool.buffers.expert_thresholds == -1).all()
    scale = np.abs(want[0]).max()
    np.testing.assert_allclose(got, want[0], rtol=0, atol=1e-4 * scale)
    assert np.abs(got - want[1]).max() > 1e-2 * scale


@pytest.fixture(scope="module")
def q8_model(tmp_path_factory, tiny_model):
    """A tiny qwen3moe in Q8_0 (the bench file's writer): types with input-major twins."""
    from tests.conftest import run_make_bench_model

    out = tmp_path_factory.mktemp("moe_q8") / "moe-q8.gguf"
    run_make_bench_model(["--shape", "tiny", "--layers", "2", "--quiet", "--tokenizer-from", str(tiny_model), "-o",
                          str(out), "--type", "q8_0", "--arch", "qwen3moe"])
    return out


@pytest.mark.parametrize("fast", [False, True], ids=["exact", "fast"])
def test_experts_down_twins_skip_the_inactive_neurons_rows(q8_model, fast, isa):
    """With CATS's down twins (input_sparsity.attach "down": the engine's at a level) each chosen
    expert reads only its active neurons' down rows: the same output as down read whole (h is 0
    there), fewer channels read; with the word negative (dense) the twins are not read at all and
    the output is the twinless layer's bit for bit."""
    from protocol.shm_layout import INPUT_SITES
    from sparsecore.input_sparsity import attach

    cfg = read_config(q8_model, open_gguf(q8_model))
    load = lambda: FfnShard.load(q8_model, [np.arange(cfg.n_ff)] * cfg.n_layers, weights="gguf", fast=fast,
                                 row_layout="gate" if fast else "")
    plain, twinned = load(), load()
    words = np.full((cfg.n_layers, len(INPUT_SITES)), -1.0, np.float32)
    twins = attach(words, "down", twinned.layers, None)
    assert len(twins.matrices) == cfg.n_layers * cfg.n_experts
    xs = np.random.default_rng(3).standard_normal((4, cfg.hidden)).astype(np.float32)
    for layer in range(cfg.n_layers):
        a, b = plain.layers[layer], twinned.layers[layer]
        for x in xs:
            y0, y1 = np.empty_like(x), np.empty_like(x)
            a.token_into(x, cfg.activation, None, None, y0)
            b.token_into(x, cfg.activation, None, None, y1)
            np.testing.assert_array_equal(y0, y1)  # dense: the twins unread
            assert sum(m.twin_active for m in twins.matrices) == 0
            words[:, INPUT_SITES.index("ffn_h")] = 0.0  # CATS at a level: h == 0 skipped
            thr = np.full(cfg.n_experts, 0.05, np.float32)
            thr[::2] = 0.2
            n0 = a.token_into(x, cfg.activation, None, thr, y0)
            n1 = b.token_into(x, cfg.activation, None, thr, y1)
            words[:] = -1.0
            assert n0 == n1 < cfg.n_experts_used * cfg.n_ff
            np.testing.assert_allclose(y1, y0, rtol=0, atol=(2e-2 if fast else 1e-5) * np.abs(y0).max())
            active, _ = (sum(c) for c in zip(*(m.reset_twin_counts() for m in twins.matrices)))
            assert 0 < active <= n1  # the down rows of active neurons only


def test_calibrate_then_generate_decodes_a_routed_model_at_its_level(q8_model, no_leaks):
    """`sparseinfer calibrate` on a routed model stores CATS levels per expert and their held-out
    perplexity (an engine at each level); `generate` then decodes at the calibrated level by
    default (the quality budget huge: a random model), experts' down twins made at load."""
    import subprocess
    import sys

    from tests.conftest import REPO
    from tests.fixtures.child_env import repo_env

    run = lambda *a: subprocess.run([sys.executable, "-m", "coordinator", *a, "-m", str(q8_model), "-t", "2"],
                                    capture_output=True, text=True, timeout=300, cwd=REPO, env=repo_env())
    r = run("calibrate", "--levels", "0.5", "--chunks", "3", "--chunk-len", "48", "--quality-chunks", "2",
            "--no-speed-check")
    assert r.returncode == 0, r.stderr
    stored = json.loads(thresholds_path(q8_model).read_text())
    assert stored["quality"]["method"] == "cats" and set(stored["quality"]["levels"]) == {"0.50"}
    assert 0.3 < stored["quality"]["levels"]["0.50"]["active"] < 0.7
    assert np.shape(stored["expert_levels"]["0.50"]) == (2, read_config(q8_model, open_gguf(q8_model)).n_experts)
    assert "CATS 0.50" in r.stdout
    r = run("generate", "-p", "the quick brown fox", "-n", "4", "--quality-budget", "1000")
    assert r.returncode == 0, r.stderr
    assert "sparsity 0.50 (cats sparsity" in r.stderr


def test_expert_thresholds_of_another_shape_are_refused_in_one_line(model, calibrated, tmp_path):
    stored = json.loads(thresholds_path(model).read_text())
    stored["expert_levels"][f"{LEVEL:.2f}"] = [[0.1] * 3] * 2
    bad = tmp_path / "bad.thresholds.json"
    bad.write_text(json.dumps(stored))
    with pytest.raises(ValueError) as e:
        Engine(model, EngineOptions(cpu_workers=1, threads=2, fast=False, sparsity=LEVEL, sparse_method="cats",
                                    thresholds_file=str(bad)))
    assert "bad.thresholds.json" in str(e.value) and "calibrate again" in str(e.value) and "\n" not in str(e.value)
