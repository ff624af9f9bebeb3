"""Speculative decoding (coordinator/runtime/speculative.py): a sequence's drafted tokens checked
as rows of one decode step (Transformer.decode_runs) give plain decoding's greedy tokens, alone
and inside a continuous batch, with the rejected rows rolled back; the rejection sampler keeps
the sampling distribution; n-gram lookup and a draft model both draft."""
from __future__ import annotations

import queue

import numpy as np
import pytest

from coordinator.runtime.batching import DoneEvent, Request, Scheduler, TokenEvent
from coordinator.runtime.engine import Engine, EngineOptions
from coordinator.runtime.engine_options import OptionError
from coordinator.runtime.sampling import Sampler, SamplingParams
from coordinator.runtime.speculative import NgramIndex, Verifier

# a prompt that repeats itself: a tiny random model's greedy text loops, which n-grams draft
LOOP = [5, 9, 30, 31, 5, 9, 30, 31, 5, 9, 30]


def _engine(path, **kw) -> Engine:
    # every cache in the shared pool (as the server sizes it); tiny layers never pay for the split
    # or the lockstep, so force it, and keep a busy machine from sending steps back to layers
    kw.setdefault("spec", "ngram")
    return Engine(path, EngineOptions(threads=2, cpu_workers=1, kv_caches=8, adaptive_spin=False, **kw))


def _greedy(eng, prompt, n, speculate):
    return list(eng.generate(prompt, n, SamplingParams(), stop_at_eos=False, speculate=speculate))


@pytest.mark.parametrize("decode_path", ["lockstep", "split", "auto"])
@pytest.mark.parametrize("fast", [False, True], ids=["exact", "fast"])
def test_a_run_of_rows_equals_decoding_one_token_at_a_time_and_rolls_back(tiny_model_factory, decode_path, fast,
                                                                          no_leaks):
    """decode_runs: one sequence's 5 consecutive tokens beside another sequence's one, every row
    bit for bit what forward([t]) gives one at a time; moving the position back drops rows,
    and different tokens written over them give what a cache that never held them gives."""
    path = tiny_model_factory(tensor_type="Q4_0", seed=3)
    with _engine(path, fast=fast, decode_path=decode_path) as eng:
        m = eng.model
        a, b = [5, 9, 30, 31], [7, 8]
        run = [40, 41, 42, 43, 44]
        alone_c = m.new_cache()
        m.forward(a, cache=alone_c)
        alone = [m.forward([t], cache=alone_c)[0].copy() for t in run]
        other_c = m.new_cache()
        m.forward(b, cache=other_c)
        other = m.forward([60], cache=other_c)[0].copy()
        ca, cb = m.new_cache(), m.new_cache()
        m.forward(a, cache=ca)
        m.forward(b, cache=cb)
        got = m.decode_runs([(run, ca), ([60], cb)])
        assert got.shape[0] == 6 and ca.pos == len(a) + 5 and cb.pos == len(b) + 1
        for j in range(5):
            np.testing.assert_array_equal(got[j], alone[j])
        np.testing.assert_array_equal(got[5], other)
        # roll back the last 3 rows, then decode other tokens there
        ca.pos -= 3
        again = [m.forward([t], cache=ca)[0].copy() for t in (50, 51)]
        fresh = m.new_cache()
        m.forward(a, cache=fresh)
        for t in run[:2]:  # decoded, as the run's rows were (a prompt's arithmetic differs in the last bits)
            m.forward([t], cache=fresh)
        want = [m.forward([t], cache=fresh)[0].copy() for t in (50, 51)]
        for g, w in zip(again, want):
            np.testing.assert_array_equal(g, w)
        if decode_path == "lockstep":
            assert eng.ffn.stats.lockstep_us  # the rows went through the lockstep step


@pytest.mark.parametrize("tensor_type", ["Q4_0", "F16"])
def test_speculative_greedy_text_is_plain_decodings(tiny_model_factory, tensor_type, no_leaks):
    path = tiny_model_factory(tensor_type=tensor_type, seed=3)
    with _engine(path, decode_path="lockstep") as eng:
        assert eng.spec is not None and eng.spec.mode == "ngram"
        eng.spec.adaptive = False  # check every draft, so the test sees drafts whatever they cost
        plain = _greedy(eng, LOOP, 40, speculate=False)
        assert eng.stats()["spec"] is None
        spec = _greedy(eng, LOOP, 40, speculate=True)
        st = eng.stats()["spec"]
    assert spec == plain
    assert st.drafted > 0 and st.accepted > 0 and st.tokens == 39  # the first token: the prompt's
    assert st.tokens_per_step > 1.0  # fewer target steps than tokens


def test_a_draft_model_drafts_and_the_text_stays_plain_decodings(tiny_model_factory, no_leaks):
    """The draft model: the same file (its drafts are the target's own greedy tokens: all kept)
    and another model of the same vocabulary (some rejected); greedy text plain decoding's."""
    path = tiny_model_factory(tensor_type="Q4_0", seed=3)
    other = tiny_model_factory(tensor_type="Q4_0", seed=5)
    with _engine(path, spec="off") as eng:
        plain = _greedy(eng, LOOP, 24, speculate=False)
    for draft, all_kept in ((path, True), (other, False)):
        with _engine(path, spec="draft", draft_model=str(draft)) as eng:
            eng.spec.adaptive = False
            got = _greedy(eng, LOOP, 24, speculate=True)
            st = eng.stats()["spec"]
        assert got == plain
        assert st.drafted > 0
        assert (st.accepted == st.drafted) == all_kept


def test_speculation_inside_a_continuous_batch_gives_each_sequence_its_plain_text(tiny_model_factory, no_leaks):
    path = tiny_model_factory(tensor_type="Q4_0", seed=3)
    prompts = [LOOP, [7, 8, 7, 8, 7], [40, 41, 42, 43, 44, 45, 46], [11, 12, 13, 11, 12]]
    with _engine(path, spec="off") as eng:
        want = [_greedy(eng, p, 20, speculate=False) for p in prompts]
    with _engine(path, decode_path="lockstep") as eng:
        eng.spec.adaptive = False
        sched = Scheduler(eng, parallel=4).start()
        try:
            qs = []
            for p in prompts:
                q: queue.Queue = queue.Queue()
                sched.submit(Request(list(p), 20, q.put, stop_at_eos=False))
                qs.append(q)
            got = []
            for q in qs:
                toks = []
                while True:
                    ev = q.get(timeout=60)
                    if isinstance(ev, TokenEvent):
                        toks.append(ev.token)
                    else:
                        assert isinstance(ev, DoneEvent) and ev.completion_tokens == 20, ev
                        break
                got.append(toks)
        finally:
            sched.stop()
        st = eng.spec.stats
    assert got == want
    assert st.drafted > 0 and st.tokens == 20 * len(prompts) - len(prompts)  # the first token: the prompt's
    assert sched.steps < st.tokens  # some steps gave a sequence several tokens


@pytest.mark.parametrize("q_kind", ["point", "draft"])
def test_rejection_sampling_keeps_the_sampling_distribution(q_kind):
    """A token checked against a draft (a point mass, as n-grams draft, or a draft model's own
    distribution) is distributed as plain sampling's p: temperature, top-k and the rest."""
    rng = np.random.default_rng(0)
    V, n = 6, 40_000
    logits = np.array([2.0, 1.5, 0.3, 0.0, -1.0, -3.0], np.float32)
    params = SamplingParams(temperature=0.9, top_k=5, seed=7)
    p = Sampler(params).probabilities(logits)
    q = rng.dirichlet(np.ones(V) * 0.5)
    sampler = Sampler(params)
    counts = np.zeros(V)
    kept = 0
    for i in range(n):
        d = int(rng.choice(V, p=q)) if q_kind == "draft" else 1
        v = Verifier(sampler, d, q if q_kind == "draft" else None)
        tok = v(logits, [])
        counts[tok] += 1
        kept += v.accepted
    freq = counts / n
    # each frequency within 4.5 standard errors of p; a token top-k drops never appears
    assert np.all(np.abs(freq - p) <= 4.5 * np.sqrt(p * (1 - p) / n) + 1e-12), (freq, p)
    assert counts[5] == 0
    if q_kind == "point":  # a point mass is kept with probability p(d)
        assert abs(kept / n - p[1]) < 0.01


def test_greedy_verification_keeps_a_draft_exactly_when_it_is_the_argmax():
    logits = np.array([0.1, 3.0, 0.2], np.float32)
    for d, kept in ((1, True), (0, False)):
        v = Verifier(Sampler(SamplingParams()), d, None)
        assert v(logits, []) == 1 and v.accepted == kept


def test_ngram_lookup_proposes_what_followed_the_latest_earlier_match():
    ix = NgramIndex()
    ix.extend([1, 2, 3, 4, 5, 9, 2, 3, 4, 7, 8, 2, 3])
    assert ix.propose(3) == [4, 7, 8]  # "2 3" last seen before the end at index 6
    ix.extend([1, 2, 3, 4, 5, 9, 2, 3, 4, 7, 8, 2, 3, 4, 5])
    assert ix.propose(2) == [9, 2]  # "2 3 4 5", the longest suffix seen before
    assert NgramIndex().propose(4) == []
    fresh = NgramIndex()
    fresh.extend([1, 2, 3, 6])
    assert fresh.propose(4) == []  # no earlier "3 6", "2 3 6"


def test_an_engine_whose_attention_takes_torch_does_not_speculate(tiny_model, no_leaks):
    """Float weights: a run of rows would go through other blocked products than one row."""
    with _engine(tiny_model, weights="f32") as eng:
        assert eng.spec is None
        plain = _greedy(eng, LOOP, 6, speculate=True)
        assert eng.stats()["spec"] is None and len(plain) == 6


def test_the_command_line_and_the_python_api_speculate_by_default(tiny_model, no_leaks):
    import sparseinfer
    from tests.fixtures.openai_server import run_cli

    r = run_cli(["generate", "-m", str(tiny_model), "-t", "2", "-p", "a b c a b c a b c", "-n", "12", "--ignore-eos"])
    assert r.returncode == 0, r.stderr
    assert "spec:" in r.stderr and "acceptance" in r.stderr  # the stats line
    off = run_cli(["generate", "-m", str(tiny_model), "-t", "2", "-p", "a b c", "-n", "4", "--spec", "off"])
    assert off.returncode == 0 and "spec:" not in off.stderr
    with sparseinfer.LLM(tiny_model, threads=2) as llm:
        llm.generate("a b c a b c a b c", max_tokens=6, ignore_eos=True)
        assert llm.stats()["spec"] is not None and llm.stats()["spec"].tokens == 5


def test_speculation_options_are_checked_in_one_line(tiny_model):
    with pytest.raises(OptionError, match="spec 'fast': choose one of off, ngram, draft"):
        EngineOptions(spec="fast").validate()
    with pytest.raises(OptionError, match="draft model"):
        EngineOptions(spec="draft").validate()
    with pytest.raises(OptionError, match="draft model"):
        EngineOptions(spec="ngram", draft_model=str(tiny_model)).validate()


PARAGRAPH = ("The old lighthouse stood on the northern cliff for more than a century. Every night its keeper "
             "climbed the spiral stairs, trimmed the wick, and watched the beam sweep across the dark water.")


@pytest.mark.smollm2
def test_smollm2_rewrite_speculates_and_keeps_plain_decodings_text(smollm2_path, no_leaks):
    """The default engine on a rewrite (its reply repeats the prompt): drafts kept, fewer target
    steps than tokens, the greedy text plain decoding's, alone and beside a second stream."""
    with Engine(smollm2_path, EngineOptions(kv_caches=4, spec="ngram")) as eng:
        ids = eng.encode_chat([{"role": "user", "content": "Rewrite this paragraph, changing 'keeper' to "
                                                           f"'guardian':\n\n{PARAGRAPH}"}])
        other = eng.encode_chat([{"role": "user", "content": "Name three colours."}])
        plain = list(eng.generate(ids, 48, speculate=False))
        plain_other = list(eng.generate(other, 24, speculate=False))
        spec = list(eng.generate(ids, 48))
        st = eng.stats()["spec"]
        assert spec == plain
        assert st.accepted > 10 and st.tokens_per_step > 1.5
        eng.spec.adaptive = False
        sched = Scheduler(eng, parallel=2).start()
        try:
            qs = [queue.Queue(), queue.Queue()]
            sched.submit(Request(list(ids), 48, qs[0].put))
            sched.submit(Request(list(other), 24, qs[1].put))
            got = []
            for q in qs:
                toks = []
                while not isinstance(ev := q.get(timeout=120), DoneEvent):
                    toks.append(ev.token)
                got.append(toks)
        finally:
            sched.stop()
    eos = set(eng.tokenizer.eos_ids)
    assert got == [[t for t in plain if t not in eos], [t for t in plain_other if t not in eos]]
