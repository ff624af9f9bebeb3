"""Decoded tokens' attention split by heads across the coordinator and a CPU worker
(coordinator/runtime/attention_split.py, sparsecore/attn_shard.py, sparsecore/kv_pool.py): the same
tokens and (up to summation order) the same logits as one process computing every head, a
continuous batch's rows bit for bit those of each sequence alone, and a sequence whose cache is
not in the shared pool still decodes (on the coordinator alone). Prompts go through the same
native step in causal chunks: their logits match torch's attention path."""
from __future__ import annotations

import numpy as np
import pytest

from coordinator.runtime.engine import Engine, EngineOptions
from sparsecore.attn_shard import split_heads
from sparsecore.kernels import MAX_SMALL_BATCH
from sparsecore.kv_pool import KvPool, KvShape, supported
from tests.fixtures.decoding import assert_batch_is_alone, greedy_decode
from tests.fixtures.tiny_arch import write_tiny_arch

PROMPTS = [[5, 9, 30, 31], [7, 8], [40, 41, 42, 43, 44, 45, 46], [3]]


def test_heads_split_evenly_with_the_coordinator_taking_the_smaller_part():
    # split_heads(query heads, query heads per KV head, slots, fewest query heads a share holds)
    assert split_heads(4, 1, [0, -1], 1) == {0: (0, 2), -1: (2, 4)}
    assert split_heads(3, 1, [0, -1], 1) == {0: (0, 2), -1: (2, 3)}
    assert split_heads(8, 1, [0, 1, -1], 2) == {0: (0, 4), 1: (4, 6), -1: (6, 8)}
    assert split_heads(2, 1, [0, 1, 2, -1], 1) == {0: (0, 1), -1: (1, 2)}  # more processes than heads


def test_whole_kv_heads_where_there_are_two_else_one_kv_heads_queries_split():
    assert split_heads(8, 2, [0, -1], 1) == {0: (0, 4), -1: (4, 8)}
    assert split_heads(6, 2, [0, -1], 1) == {0: (0, 4), -1: (4, 6)}  # 3 KV heads: whole, uneven
    assert split_heads(8, 4, [0, 1, -1], 1) == {0: (0, 4), -1: (4, 8)}  # 2 KV heads, 3 processes
    assert split_heads(4, 4, [0, -1], 1) == {0: (0, 2), -1: (2, 4)}  # one KV head (Gemma 3 270M)
    assert split_heads(4, 4, [0, 1, -1], 1) == {0: (0, 2), 1: (2, 3), -1: (3, 4)}


def test_no_split_without_two_shares():
    assert split_heads(1, 1, [0, -1], 1) == {}
    assert split_heads(4, 1, [-1], 1) == {}  # no worker
    assert split_heads(4, 1, [0, -1], 4) == {}  # one unit of heads: the output's blocks forbid a cut
    assert split_heads(6, 1, [0, -1], 4) == {}  # heads not a whole number of units


def _engine(path, fast: bool, split: bool, kv_caches: int = 8) -> Engine:
    # tiny layers never pay for the exchange: split at every size ("split")
    eng = Engine(path, EngineOptions(threads=2, cpu_workers=1, fast=fast, split_attention=split,
                                     kv_caches=kv_caches, decode_path="split" if split else "auto"))
    if split:
        assert eng.model.split_attn is not None and eng.model.lockstep is None
        assert eng.decode_plan.path.value == "split attention" and eng.decode_plan.split_min_bytes == (0, 0)
    return eng


@pytest.mark.parametrize("tensor_type", ["Q4_0", "Q8_0", "F16", "F32"])
@pytest.mark.parametrize("fast", [False, True], ids=["exact", "fast"])
@pytest.mark.parametrize("n_kv", [2, 1], ids=["whole-kv-heads", "one-kv-head"])
def test_split_heads_give_what_one_process_gives(tiny_model_factory, tensor_type, fast, n_kv, no_leaks):
    """Two KV heads: one each. One KV head (Gemma 3 270M's shape): its query heads split, both
    processes computing its keys and values into the shared cache."""
    path = tiny_model_factory(tensor_type=tensor_type, seed=4, n_heads=4, n_kv_heads=n_kv)
    with _engine(path, fast, split=False) as whole:
        assert whole.model.split_attn is None
        want = [greedy_decode(whole, p) for p in PROMPTS]
    with _engine(path, fast, split=True) as split:
        calls = len(split.ffn.stats.attn_us)
        got = [greedy_decode(split, p) for p in PROMPTS]
        # every one-token step of every layer went through the exchange, and the prompts, up to
        # MAX_SMALL_BATCH tokens an exchange
        steps = len(PROMPTS) * 6 + sum(-(-len(p) // MAX_SMALL_BATCH) for p in PROMPTS)
        assert len(split.ffn.stats.attn_us) - calls == steps * split.cfg.n_layers
    # The same products; only the two shares' sum adds in another order (~1e-7 in a layer's
    # output). Fast arithmetic quantizes the next layer's input to 8 bits, where such a
    # difference can flip a rounding: a few 1e-3 of the logits' range after some steps.
    tol = 1e-2 if fast else 2e-4
    for (t_want, l_want), (t_got, l_got) in zip(want, got):
        assert t_got == t_want
        np.testing.assert_allclose(l_got, l_want, rtol=0, atol=tol * max(1.0, np.abs(l_want).max()))


@pytest.mark.parametrize("split", [True, False], ids=["split", "one-process"])
@pytest.mark.parametrize("fast", [False, True], ids=["exact", "fast"])
def test_prompt_chunks_attend_causally_as_torch_does(tiny_model_factory, fast, split, no_leaks):
    """A 37-token prompt (chunks of 16, 16 and 5 tokens, each token attending to every earlier
    one, in its chunk too) after 3 tokens already in the cache: every position's logits are
    torch's attention path's (an implementation of its own), and so are the cache's contents."""
    path = tiny_model_factory(tensor_type="Q4_0", seed=6, n_heads=4, n_kv_heads=2)
    prompt = [(7 * i + 3) % 90 + 2 for i in range(37)]
    with _engine(path, fast, split=split) as eng:
        m = eng.model
        runs = {}
        for native in (True, False):
            saved = m.native
            if not native:
                m.native = [None] * len(saved)  # the torch path: SDPA over the cache
            try:
                c = m.new_cache()
                m.forward([11, 12, 13], cache=c)
                runs[native] = (m.forward(prompt, all_logits=True, cache=c).copy(),
                                c.k[:, :, :40].copy(), c.pos)
            finally:
                m.native = saved
            del c
    (got, k_got, pos_got), (want, k_want, pos_want) = runs[True], runs[False]
    assert pos_got == pos_want == 40
    tol = 1e-2 if fast else 2e-4
    np.testing.assert_allclose(got, want, rtol=0, atol=tol * max(1.0, np.abs(want).max()))
    np.testing.assert_allclose(k_got, k_want, rtol=0, atol=tol * max(1.0, np.abs(k_want).max()))


@pytest.mark.parametrize("arch", ["falcon", "falcon40b"])
def test_falcon_split_gives_what_its_native_step_gives(tmp_path, arch, no_leaks):
    """Falcon's LayerNorms and parallel blocks, its one KV head (7B: the query heads split, both
    processes computing it) or two (40B's layout, its attention normed by attn_norm_2): split
    across the processes, the tokens of the native step on the coordinator alone and its logits
    up to the shares' summation order; a continuous batch's rows those of each sequence alone."""
    path = write_tiny_arch(tmp_path / f"{arch}.gguf", arch)
    with _engine(path, False, split=False) as whole:
        assert whole.decode_plan.path.value == "native" and all(s is not None for s in whole.model.native)
        want = [greedy_decode(whole, p) for p in PROMPTS]
    with _engine(path, False, split=True) as split:
        calls = len(split.ffn.stats.attn_us)
        got = [greedy_decode(split, p) for p in PROMPTS]
        assert len(split.ffn.stats.attn_us) - calls >= len(PROMPTS) * 6 * split.cfg.n_layers
        assert_batch_is_alone(split.model, PROMPTS)
    for (t_want, l_want), (t_got, l_got) in zip(want, got):
        assert t_got == t_want
        np.testing.assert_allclose(l_got, l_want, rtol=0, atol=2e-4 * max(1.0, np.abs(l_want).max()))


@pytest.mark.parametrize("fast", [False, True], ids=["exact", "fast"])
def test_split_batch_rows_equal_decoding_alone_bit_for_bit(tiny_model_factory, fast, no_leaks):
    path = tiny_model_factory(tensor_type="Q4_0", seed=5, n_heads=4, n_kv_heads=2)
    with _engine(path, fast, split=True) as eng:
        m = eng.model
        alone = []
        for p in PROMPTS:
            c = m.new_cache()
            assert c.index is not None
            m.forward(p, cache=c)
            alone.append([m.forward([t], cache=c)[0].copy() for t in (60, 61, 62)])
            del c  # its place in the pool goes back
        caches = [m.new_cache() for _ in PROMPTS]
        assert all(c.index is not None for c in caches)
        for p, c in zip(PROMPTS, caches):
            m.forward(p, cache=c)
        calls = len(eng.ffn.stats.attn_us)
        for step, t in enumerate((60, 61, 62)):
            got = m.decode_batch([t] * len(PROMPTS), caches)
            for b in range(len(PROMPTS)):
                np.testing.assert_array_equal(got[b], alone[b][step])
        assert len(eng.ffn.stats.attn_us) - calls == 3 * eng.cfg.n_layers  # one exchange a layer per step


def test_a_cache_outside_the_pool_decodes_on_the_coordinator(tiny_model_factory, no_leaks):
    path = tiny_model_factory(tensor_type="Q4_0", seed=6, n_heads=4, n_kv_heads=2)
    with _engine(path, fast=False, split=True, kv_caches=1) as eng:
        m = eng.model
        assert m.cache.index == 0  # the engine's own cache holds the only place
        want = greedy_decode(eng, PROMPTS[0])  # a new cache: private, so not split
        c = m.new_cache()
        assert c.index is None
        calls = len(eng.ffn.stats.attn_us)
        m.cache.pos = 0
        m.forward(PROMPTS[0])
        rows = []
        logits = None
        for t in want[0]:
            logits = m.forward([t])[0].copy()
            rows.append(logits)
        # the pool's cache: split, the prompt (one chunk) and every decoded token
        assert len(eng.ffn.stats.attn_us) - calls == (len(want[0]) + 1) * eng.cfg.n_layers
        np.testing.assert_allclose(np.array(rows), want[1], rtol=0, atol=2e-4 * max(1.0, np.abs(want[1]).max()))
        # a batch mixing a pooled and a private cache decodes too, every head on the coordinator
        calls = len(eng.ffn.stats.attn_us)
        m.forward(PROMPTS[1], cache=c)
        m.decode_batch([60, 61], [m.cache, c])
        assert len(eng.ffn.stats.attn_us) == calls


def test_attention_stays_on_the_coordinator_when_not_split(tiny_model_factory, no_leaks):
    path = tiny_model_factory(tensor_type="Q4_0", seed=6, n_heads=4, n_kv_heads=2)
    with _engine(path, fast=False, split=False) as eng:
        assert eng.kv_pool is None and eng.model.cache.index is None
        greedy_decode(eng, PROMPTS[0], 2)
        assert eng.ffn.stats.attn_us == []


def test_a_step_is_split_only_when_the_work_it_halves_pays_for_the_exchange():
    from types import SimpleNamespace

    from coordinator.runtime.attention_split import SplitAttention
    from coordinator.runtime.decode_plan import MIN_SPLIT_BYTES, MIN_SPLIT_BYTES_BATCH

    small = SimpleNamespace(every_token=False, weight_bytes=550_000, kv_bytes_per_pos=1536,
                            min_bytes=(MIN_SPLIT_BYTES, MIN_SPLIT_BYTES_BATCH), max_tokens=16)
    pays = lambda sa, *pos: SplitAttention.pays(sa, np.array(pos, np.int64))  # noqa: E731
    assert not pays(small, 10)  # SmolLM2-sized layer, short context: the exchange costs more
    assert pays(small, 1200)  # its cache grew past the weights
    assert pays(small, 120, 130, 140, 150)  # a batch: every sequence's cache splits too
    large = SimpleNamespace(**{**vars(small), "weight_bytes": 5_300_000, "kv_bytes_per_pos": 2048})
    assert pays(large, 0)  # a 1.1B-sized layer always pays
    # a prompt's chunk: each token's products cost the weights' bytes, so SmolLM2's pay from 2
    prompt = lambda sa, *pos: SplitAttention.pays(sa, np.array(pos, np.int64), prompt=True)  # noqa: E731
    assert prompt(small, 0, 1) and not pays(small, 0, 1)
    tiny = SimpleNamespace(**{**vars(small), "weight_bytes": 9_000, "kv_bytes_per_pos": 256})
    assert not prompt(tiny, *range(16))  # a test model's layer: never
    assert not pays(SimpleNamespace(**{**vars(large), "max_tokens": 7}), *range(8))  # more rows than shared memory holds
    # input sparsity (only the shares carry twins) and lockstep engines (a step that falls back
    # to the layers must compute what lockstep does): every decoded step splits, one token or a
    # batch's, within what shared memory holds; prompts still by their work
    every = SimpleNamespace(**{**vars(tiny), "every_token": True})
    assert pays(every, 3) and pays(every, 3, 4) and not prompt(every, 3, 4)
    assert not pays(SimpleNamespace(**{**vars(every), "max_tokens": 1}), 3, 4)


@pytest.mark.skipif(not supported(), reason="no memfd on this system")
def test_the_pool_hands_out_the_lowest_free_cache():
    """A cache's written pages stay resident in every process that wrote them: handing out the
    lowest free cache (not the next of a rotation) keeps only as many caches' pages as are in
    use at once."""
    pool = KvPool.create(KvShape(4, 1, 1, 8, 8, 8))
    try:
        a, b, c = pool.take(), pool.take(), pool.take()
        assert (a, b, c) == (0, 1, 2)
        pool.give_back(b)
        pool.give_back(a)
        assert pool.take() == 0 and pool.take() == 1 and pool.take() == 3 and pool.take() is None
    finally:
        pool.close()
