"""Lockstep decode steps (sparsecore/lockstep.py, coordinator/runtime/lockstep_decode.py): every layer of
a decoded token in one post, each process summing the others' shares itself. They give what the
per-layer posted steps give (exact arithmetic: up to summation order), a continuous batch's rows
bit for bit those of each sequence alone, thresholds and shard predictors as before; a worker
that dies mid-step ends the wait with its name, and a step the coordinator drops is dropped by
the worker too."""
from __future__ import annotations

import os
import re
import signal
import threading
import time

import numpy as np
import pytest

from coordinator.runtime.engine import Engine, EngineOptions
from coordinator.runtime.worker_pool import WorkerError
from sparsecore import kernels
from tests.conftest import hang_guard
from tests.fixtures.decoding import assert_batch_is_alone, greedy_decode
from tests.fixtures.tiny_arch import write_tiny_arch

PROMPTS = [[5, 9, 30, 31], [7, 8], [40, 41, 42, 43, 44, 45, 46]]


def test_residual_norm_sums_the_shares_in_order_then_normalizes():
    rng = np.random.default_rng(0)
    h = rng.standard_normal((3, 96), dtype=np.float32)
    shares = [rng.standard_normal((3, 96), dtype=np.float32) * 10 ** k for k in (0, 3, -2)]
    w = rng.standard_normal(96, dtype=np.float32)
    want_h = h + ((shares[0] + shares[1]) + shares[2])  # float32, in this order
    got_h = h.copy()
    x = kernels.residual_norm(got_h, shares, w, 1e-5)
    np.testing.assert_array_equal(got_h, want_h)
    ref = want_h.astype(np.float64)
    ref = ref / np.sqrt((ref ** 2).mean(axis=1, keepdims=True) + 1e-5) * w
    np.testing.assert_allclose(x, ref, rtol=2e-6, atol=2e-6)
    # the same shares in another order: the same floats only where addition happens to agree
    again = h.copy()
    kernels.residual_norm(again, shares, None, 1e-5)
    np.testing.assert_array_equal(again, want_h)
    with pytest.raises(ValueError):
        kernels.residual_norm(h.copy(), [shares[0][:2]], w, 1e-5)
    # a LayerNorm where the norm has a bias (falcon's FFN input and output norm)
    b = rng.standard_normal(96, dtype=np.float32)
    ln_h = h.copy()
    x = kernels.residual_norm(ln_h, shares, w, 1e-5, norm_bias=b)
    np.testing.assert_array_equal(ln_h, want_h)
    ref = want_h.astype(np.float64)
    ref = (ref - ref.mean(axis=1, keepdims=True)) / np.sqrt(ref.var(axis=1, keepdims=True) + 1e-5) * w + b
    np.testing.assert_allclose(x, ref, rtol=2e-6, atol=1e-5)


def _engine(path, fast: bool, lockstep: bool, **kw) -> Engine:
    # tiny layers never pay: split (and lock) at every size; and a busy test machine must not
    # send steps back to layers (adaptive_spin)
    eng = Engine(path, EngineOptions(threads=2, cpu_workers=1, fast=fast, kv_caches=8, adaptive_spin=False,
                                     decode_path="lockstep" if lockstep else "split", **kw))
    assert (eng.model.lockstep is not None) == lockstep and eng.model.split_attn is not None
    return eng


@pytest.mark.parametrize("tensor_type", ["Q4_0", "Q4_K", "F16"])
@pytest.mark.parametrize("fast", [False, True], ids=["exact", "fast"])
@pytest.mark.parametrize("n_kv", [2, 1], ids=["whole-kv-heads", "one-kv-head"])
def test_lockstep_gives_what_the_per_layer_steps_give(tiny_model_factory, tensor_type, fast, n_kv, no_leaks):
    """One KV head (Gemma 3 270M's shape): its query heads split, both processes computing it."""
    # K-quant blocks are 256 wide: two shares' output columns need a hidden size of 512
    wide = dict(hidden=512, n_ff=512) if tensor_type == "Q4_K" else {}
    path = tiny_model_factory(tensor_type=tensor_type, seed=4, n_heads=4, n_kv_heads=n_kv, **wide)
    with _engine(path, fast, lockstep=False) as layered:
        want = [greedy_decode(layered, p) for p in PROMPTS]
        assert not layered.ffn.stats.lockstep_us
    with _engine(path, fast, lockstep=True) as locked:
        got = [greedy_decode(locked, p) for p in PROMPTS]
        assert len(locked.ffn.stats.lockstep_us) == 6 * len(PROMPTS)
    for (wt, wl), (gt, gl) in zip(want, got):
        # the same floats: both paths norm the FFN input in the same kernel (model.ffn_input_norm)
        # and add the shares in slot order; with torch's norm on one side, fast mode's 8-bit
        # activations rounded apart (AVX2, Q4_K: 0.059)
        np.testing.assert_array_equal(gl, wl)
        assert gt == wt


@pytest.mark.parametrize("fast", [False, True], ids=["exact", "fast"])
@pytest.mark.parametrize("arch", ["falcon", "falcon40b"])
def test_lockstep_parallel_blocks_give_what_the_per_layer_steps_give(tmp_path, arch, fast, no_leaks):
    """Falcon: LayerNorms, and parallel blocks, whose FFN input lockstep norms from the residual
    before the attention phase (at the previous layer's last exchange) as the per-layer path
    does before the attention step: the same floats, every decoded token in one post, and a
    batch's rows those of each sequence alone."""
    path = write_tiny_arch(tmp_path / f"{arch}.gguf", arch)
    with _engine(path, fast, lockstep=False) as layered:
        want = [greedy_decode(layered, p) for p in PROMPTS]
    with _engine(path, fast, lockstep=True) as locked:
        got = [greedy_decode(locked, p) for p in PROMPTS]
        assert len(locked.ffn.stats.lockstep_us) == 6 * len(PROMPTS)
        assert_batch_is_alone(locked.model, PROMPTS)
    for (wt, wl), (gt, gl) in zip(want, got):
        np.testing.assert_array_equal(gl, wl)
        assert gt == wt


@pytest.mark.parametrize("batch", [1, 3])
def test_a_decoded_step_in_lockstep_is_one_post_logits_included(tiny_model_factory, batch, no_leaks):
    """The lm_head's rows are split over the same processes: the step's last phase computes
    them, so decoding posts once per step (no separate head post), and the logits are those the
    per-layer path's split head gives."""
    path = tiny_model_factory(tensor_type="Q4_0", seed=6, n_heads=4, n_kv_heads=2)
    with _engine(path, False, lockstep=False) as layered:
        want = [greedy_decode(layered, p)[1] for p in PROMPTS[:batch]]
    with _engine(path, False, lockstep=True) as eng:
        m, bell, st = eng.model, eng.pool.bell, eng.ffn.stats
        assert m.lockstep.head_rows and m.lockstep.head_in_step(batch)
        caches = [m.new_cache() for _ in range(batch)]
        tokens = [int(np.argmax(m.forward(p, cache=c)[-1])) for p, c in zip(PROMPTS, caches)]
        posts, heads, got = bell.step, len(st.head_us), []
        for _ in range(6):
            logits = m.decode_batch(tokens, caches) if batch > 1 else m.forward(tokens, cache=caches[0])
            got.append(logits.copy())
            tokens = [int(t) for t in np.argmax(logits, axis=1)]
        assert bell.step - posts == 6 and len(st.head_us) == heads
    for b in range(batch):
        np.testing.assert_allclose(np.array([g[b] for g in got]), want[b], rtol=0, atol=1e-5)


@pytest.mark.parametrize("fast", [False, True], ids=["exact", "fast"])
@pytest.mark.parametrize("n_kv", [2, 1], ids=["whole-kv-heads", "one-kv-head"])
def test_lockstep_batch_rows_equal_decoding_alone_bit_for_bit(tiny_model_factory, fast, n_kv, no_leaks):
    path = tiny_model_factory(tensor_type="Q4_0", seed=5, n_heads=4, n_kv_heads=n_kv)
    with _engine(path, fast, lockstep=True) as eng:
        m = eng.model
        alone = []
        for p in PROMPTS:
            c = m.new_cache()
            m.forward(p, cache=c)
            alone.append([m.forward([t], cache=c)[0].copy() for t in (60, 61, 62)])
        n0 = len(eng.ffn.stats.lockstep_us)
        caches = [m.new_cache() for _ in PROMPTS]
        for p, c in zip(PROMPTS, caches):
            m.forward(p, cache=c)
        for step, t in enumerate((60, 61, 62)):
            got = m.decode_batch([t] * len(PROMPTS), caches)
            for b in range(len(PROMPTS)):
                np.testing.assert_array_equal(got[b], alone[b][step])
        assert len(eng.ffn.stats.lockstep_us) - n0 == 3  # each batch step was one lockstep step


def test_lockstep_applies_thresholds(tiny_model_factory, no_leaks):
    """CATS thresholds in lockstep: the same tokens and active fraction as the per-layer steps."""
    path = tiny_model_factory(tensor_type="Q4_0", seed=6, n_heads=4, n_kv_heads=2)
    results = []
    for lockstep in (False, True):
        with _engine(path, False, lockstep=lockstep) as eng:
            eng.ffn.set_thresholds([0.5] * eng.cfg.n_layers)
            st = eng.ffn.stats
            st.clear_counts()
            toks, rows = greedy_decode(eng, PROMPTS[0], steps=5)
            dense = sum(st.tokens.values()) * eng.cfg.n_ff
            results.append((toks, rows, sum(st.active.values()) / dense))
    (wt, wl, wf), (gt, gl, gf) = results
    assert 0.05 < gf < 0.95, "the thresholds should switch some neurons off"
    assert gt == wt and abs(gf - wf) < 0.02
    np.testing.assert_allclose(gl, wl, atol=2e-4, rtol=0)


def test_lockstep_with_predictors_in_the_shards(tiny_pwri, no_leaks):
    """A PowerInfer file: each process scores its own neurons inside the lockstep step."""
    path = tiny_pwri
    results = []
    for lockstep in (False, True):
        with _engine(path, False, lockstep=lockstep) as eng:
            assert eng.ffn.shard_predictors is not None
            toks, rows = greedy_decode(eng, [5, 6, 7], steps=4)
            results.append((toks, rows, len(eng.ffn.stats.lockstep_us)))
    (wt, wl, wn), (gt, gl, gn) = results
    assert wn == 0 and gn == 4
    assert gt == wt
    np.testing.assert_allclose(gl, wl, atol=2e-4, rtol=0)


def own_share_done(part, k: int, then) -> None:
    """Calls then(phase) once, when the process's part `part` has computed its share of phase k
    of a step (1: layer 0's attention, 2: its FFN, 3: layer 1's attention...) and before it
    announces it (Lockstep.announce_and_wait announces, then waits for the peers)."""
    from sparsecore.lockstep import PHASE_STRIDE

    real = part.announce_and_wait

    def wait(phase, peers, check):
        if phase % PHASE_STRIDE == k:
            part.announce_and_wait = real
            then(phase)
        return real(phase, peers, check)
    part.announce_and_wait = wait


def test_a_worker_killed_mid_step_ends_that_step_naming_it(tiny_model_factory, no_leaks):
    """The worker is killed inside a lockstep step (during the coordinator's own attention of
    layer 1, before it announces that share, so the worker can never post its FFN share of the
    layer) and is dead before the step goes on: the coordinator's wait for that share must end
    in this very step (a step count, not a clock) with a WorkerError naming the worker. A wait
    that no longer checks its peers would spin forever: the hang guard fails it."""
    path = tiny_model_factory(tensor_type="Q4_0", seed=7, n_heads=4, n_kv_heads=2, ctx=4096)
    with _engine(path, False, lockstep=True) as eng:
        m = eng.model
        c = m.new_cache()
        m.forward([5, 6], cache=c)
        m.forward([7], cache=c)
        assert len(eng.ffn.stats.lockstep_us) == 1  # a decode step runs in lockstep
        c.pos = 2
        victim = eng.pool.workers[0]
        kills = []

        def killed_meanwhile(phase):
            os.kill(victim.proc.pid, signal.SIGKILL)
            os.waitid(os.P_PID, victim.proc.pid, os.WEXITED | os.WNOWAIT)  # dead, left for the pool to reap
            kills.append(victim.proc.pid)

        own_share_done(m.lockstep.own, 3, killed_meanwhile)  # layer 1's attention share
        with hang_guard("the step whose worker died"):
            with pytest.raises(WorkerError, match=re.escape(f"{victim.label} died: ")):
                m.forward([7], cache=c)
        assert kills == [victim.proc.pid]  # the kill landed inside that (lockstep) step


def test_a_step_the_coordinator_drops_is_dropped_by_the_worker(tiny_model_factory, no_leaks):
    """Ctrl-C inside a lockstep step (here: an exception in the coordinator's attention of layer
    1): the worker waits for a share that never comes, until the next step is posted; it drops
    the old one and the next step's logits are what a fresh run gives."""
    path = tiny_model_factory(tensor_type="Q4_0", seed=8, n_heads=4, n_kv_heads=2)
    with _engine(path, False, lockstep=True) as eng:
        m = eng.model
        c = m.new_cache()
        m.forward([5, 6, 7], cache=c)
        want = m.forward([9], cache=c)[0].copy()
        c.pos -= 1

        def interrupted(phase):
            raise KeyboardInterrupt

        own_share_done(m.lockstep.own, 3, interrupted)  # layer 1's attention share, never announced
        with pytest.raises(KeyboardInterrupt):
            m.forward([9], cache=c)
        time.sleep(0.1)  # the worker is now waiting for layer 1's share from us
        worker = eng.pool.workers[0].proc
        watchdog = threading.Timer(20, worker.kill)  # a worker that kept waiting: fail, do not hang
        watchdog.start()
        try:
            got = m.forward([9], cache=c)[0]
        finally:
            watchdog.cancel()
        np.testing.assert_array_equal(got, want)
        assert worker.poll() is None


def test_the_wait_for_a_peer_ends_on_its_share_a_later_step_or_a_check():
    """Lockstep.announce_and_wait alone, on a real segment (a part of no layers: the wait needs
    none): it raises this process's phase word; a peer at this phase, or past it within the step,
    ends the wait at once; a peer already in a later step means this step was dropped
    (Abandoned); a peer behind is waited for, with `check` called meanwhile (it raises to stop
    the wait). The shares a finished wait sums are the run's (the engine tests above)."""
    from protocol.shm_layout import SLOT_PHASE, SharedBuffers, ShmLayout
    from sparsecore.lockstep import PHASE_STRIDE, Abandoned, Lockstep

    buf = SharedBuffers.create(ShmLayout(hidden=32, n_ff=32, max_tokens=4, n_slots=2, n_layers=1))
    try:
        part = Lockstep(buf, 1, [], (0, 0), {}, "silu", [], 1e-5)
        phase = 7 * PHASE_STRIDE + 3
        calls = []

        def check():
            calls.append(1)
            raise Abandoned("stop")

        for peer in (phase, phase + 1):  # there, or one phase on within the same step
            buf.slots[0, SLOT_PHASE] = peer
            buf.slots[1, SLOT_PHASE] = 0
            part.announce_and_wait(phase, [0], check)
            assert buf.slots[1, SLOT_PHASE] == phase and calls == []
        buf.slots[0, SLOT_PHASE] = 8 * PHASE_STRIDE + 1  # the peer went on to the next step
        with pytest.raises(Abandoned, match=f"phase {phase}"):
            part.announce_and_wait(phase, [0], check)
        assert calls == []  # dropped on sight, not after a check
        buf.slots[0, SLOT_PHASE] = phase - 1
        with pytest.raises(Abandoned, match="stop"):
            part.announce_and_wait(phase, [0], check)
        assert calls == [1]
    finally:
        buf.close()
