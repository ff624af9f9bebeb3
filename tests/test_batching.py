"""The continuous-batching scheduler against a fake model (fast, deterministic): batching,
prompt caching, stop strings, cancellation, the bounded queue, engine failures."""
from __future__ import annotations

import queue
import re
import threading

import numpy as np
import pytest

from coordinator.runtime.batching import (DoneEvent, FailedEvent, Overloaded, Request, Scheduler, StopMatcher,
                                  TokenEvent)
from coordinator.runtime.sampling import SamplingParams
from coordinator.text.tokenizer import GGUFTokenizer
from sparsecore.gguf_file import open_gguf
from tests.fixtures.decoding import assert_batch_is_alone


class FakeCache:
    def __init__(self):
        self.pos = 0


class FakeModel:
    """Next token = (last token + 1) mod V, whatever came before; records what it was asked."""

    def __init__(self, vocab: int, max_ctx: int = 64, fail_at_step: int | None = None):
        self.vocab, self.max_ctx, self.fail_at_step = vocab, max_ctx, fail_at_step
        self.cache = FakeCache()
        self.forwarded: list[int] = []  # tokens run through forward (prefill)
        self.batches: list[int] = []  # sizes of decode_batch calls
        self.gate = threading.Event()
        self.gate.set()

    def new_cache(self):
        return FakeCache()

    def _logits(self, tok):
        out = np.zeros(self.vocab, np.float32)
        out[(tok + 1) % self.vocab] = 5.0
        return out

    def forward(self, ids, all_logits=False, cache=None):
        cache.pos += len(ids)
        self.forwarded += ids
        return np.stack([self._logits(t) for t in ids])

    def decode_batch(self, ids, caches):
        self.gate.wait()
        if self.fail_at_step is not None and len(self.batches) == self.fail_at_step:
            raise RuntimeError("worker 1 died")
        self.batches.append(len(ids))
        for c in caches:
            c.pos += 1
        return np.stack([self._logits(t) for t in ids])


class FakeEngine:
    def __init__(self, model, tokenizer):
        from coordinator.runtime.sparse_ffn import ExchangeStats

        self.model, self.tokenizer = model, tokenizer
        self.ffn = type("Ffn", (), {"stats": ExchangeStats()})()

    def check_workers(self):
        pass


@pytest.fixture(scope="module")
def tokenizer(tiny_model):
    return GGUFTokenizer.from_reader(open_gguf(tiny_model))


def _collect():
    q: queue.Queue = queue.Queue()
    return q, q.put


def _drain(q, timeout=10):
    events = []
    while True:
        ev = q.get(timeout=timeout)
        events.append(ev)
        if isinstance(ev, (DoneEvent, FailedEvent)):
            return events


def _eos_free(tokenizer, n=8, start=40):
    return [t for t in range(start, start + 3 * n) if t not in tokenizer.eos_ids][:n]


def test_stop_matcher_holds_back_a_possible_start_and_cuts_at_the_stop():
    m = StopMatcher(["lo w", "xyz"])
    assert m.push("he") == ("he", False)
    assert m.push("llo") == ("l", False)  # "lo" could be the start of "lo w"
    assert m.push(" wo") == ("", True)
    m = StopMatcher(["bc"])
    assert m.push("ab") == ("a", False)
    assert m.flush() == "b"
    assert StopMatcher([]).push("abc") == ("abc", False)


def test_sequences_decode_together_and_each_gets_its_own_tokens(tokenizer):
    model = FakeModel(tokenizer.vocab_size)
    sched = Scheduler(FakeEngine(model, tokenizer), parallel=4, queue=4)
    model.gate.clear()  # hold decoding until all four are admitted
    qs = []
    for start in (40, 50, 60, 70):
        q, put = _collect()
        sched.submit(Request([start, start + 1], 5, put, SamplingParams(0.0), stop_at_eos=False))
        qs.append((start, q))
    sched.start()
    try:
        model.gate.set()
        for start, q in qs:
            events = _drain(q)
            toks = [e.token for e in events if isinstance(e, TokenEvent)]
            assert toks == [start + 2 + i for i in range(5)]
            assert events[-1].reason == "length" and events[-1].completion_tokens == 5
        assert max(model.batches) == 4  # one pass for all four sequences
    finally:
        sched.stop()


def test_a_constrained_sequence_follows_its_grammar_and_leaves_its_neighbours_alone(tokenizer):
    """Structured output inside the batch: the model's favourite next token (last + 1) is
    forbidden by a grammar of 4 lowercase letters, so the constrained sequence takes what the
    grammar allows and ends when it is complete ("stop"); the free sequences beside it decode
    exactly as they do alone; a second constrained one, beside them, gets the same as the first."""
    from coordinator.text.structured_output import Constraint, TokenTable, grammar_for
    table = TokenTable.of(tokenizer, tokenizer.vocab_size)
    grammar = grammar_for(regex="[a-z]{4}")
    model = FakeModel(tokenizer.vocab_size)
    sched = Scheduler(FakeEngine(model, tokenizer), parallel=4, queue=4)
    model.gate.clear()
    qs = []
    for start, constrained in ((40, True), (50, False), (60, True), (70, False)):
        q, put = _collect()
        sched.submit(Request([start, start + 1], 6, put, SamplingParams(0.0), stop_at_eos=False,
                             constraint=Constraint(table, grammar) if constrained else None))
        qs.append((start, constrained, q))
    sched.start()
    try:
        model.gate.set()
        texts = []
        for start, constrained, q in qs:
            events = _drain(q)
            toks = [e.token for e in events if isinstance(e, TokenEvent)]
            if constrained:
                text = "".join(e.text for e in events if isinstance(e, TokenEvent)) + events[-1].text
                assert re.fullmatch("[a-z]{4}", text), text
                assert events[-1].reason == "stop" and toks != [start + 2 + i for i in range(len(toks))]
                texts.append(text)
            else:
                assert toks == [start + 2 + i for i in range(6)] and events[-1].reason == "length"
        assert texts[0] == texts[1]
        assert max(model.batches) >= 3  # decoded together (a constrained one may end before the last is in)
    finally:
        sched.stop()


def test_a_conversation_that_goes_on_reuses_its_cached_prefix(tokenizer):
    model = FakeModel(tokenizer.vocab_size)
    sched = Scheduler(FakeEngine(model, tokenizer), parallel=2, queue=2).start()
    try:
        first = _eos_free(tokenizer, 6)
        q, put = _collect()
        sched.submit(Request(first, 3, put, SamplingParams(0.0), stop_at_eos=False))
        done = _drain(q)[-1]
        assert done.cached_tokens == 0
        generated = [first[-1] + 1, first[-1] + 2]  # the last sampled token never ran through the model
        follow = first + generated + [first[-1] + 3, 7, 8]
        model.forwarded.clear()
        q, put = _collect()
        sched.submit(Request(follow, 2, put, SamplingParams(0.0), stop_at_eos=False))
        done = _drain(q)[-1]
        assert done.cached_tokens == len(first) + len(generated)
        assert model.forwarded == follow[done.cached_tokens:]  # only the new tokens were prefilled
    finally:
        sched.stop()


def test_cancelled_sequence_leaves_within_a_step(tokenizer):
    model = FakeModel(tokenizer.vocab_size, max_ctx=4096)
    sched = Scheduler(FakeEngine(model, tokenizer), parallel=2, queue=2).start()
    try:
        q, put = _collect()
        req = Request(_eos_free(tokenizer, 3), 3000, put, SamplingParams(0.0), stop_at_eos=False)
        sched.submit(req)
        for _ in range(3):
            assert isinstance(q.get(timeout=10), TokenEvent)
        req.cancelled.set()
        seen = sched.steps
        events = _drain(q)
        assert events[-1].reason == "cancelled"
        assert sched.steps - seen <= 2 and events[-1].completion_tokens < 3000
        assert sched.busy_slots() == 0
    finally:
        sched.stop()


def test_the_queue_is_bounded(tokenizer):
    model = FakeModel(tokenizer.vocab_size)
    sched = Scheduler(FakeEngine(model, tokenizer), parallel=1, queue=1)  # not started: nothing is admitted
    sched.slots[0].req = object()  # the one slot is busy
    sched.check_room()  # room in the queue: no refusal
    sched.submit(Request([40], 1, lambda e: None))
    with pytest.raises(Overloaded):  # what a request would get, said before it is prepared
        sched.check_room()
    with pytest.raises(Overloaded):
        sched.submit(Request([41], 1, lambda e: None))
    with pytest.raises(ValueError, match="context"):
        Scheduler(FakeEngine(model, tokenizer), parallel=1).submit(Request([40] * 60, 10, lambda e: None))


def test_engine_failure_fails_every_request_and_later_ones(tokenizer):
    model = FakeModel(tokenizer.vocab_size, fail_at_step=2)
    model.gate.clear()  # no decode step until both are in: else the first could fail the engine alone
    sched = Scheduler(FakeEngine(model, tokenizer), parallel=2, queue=2).start()
    try:
        qs = []
        for start in (40, 50):
            q, put = _collect()
            sched.submit(Request([start], 10, put, SamplingParams(0.0), stop_at_eos=False))
            qs.append(q)
        model.gate.set()
        for q in qs:
            assert isinstance(_drain(q)[-1], FailedEvent)
        assert "worker 1 died" in sched.error
        with pytest.raises(RuntimeError, match="worker 1 died"):
            sched.submit(Request([40], 1, lambda e: None))
    finally:
        sched.stop()


def test_eos_ends_a_sequence_with_stop(tokenizer):
    eos = min(tokenizer.eos_ids)
    model = FakeModel(tokenizer.vocab_size)
    sched = Scheduler(FakeEngine(model, tokenizer), parallel=1, queue=1).start()
    try:
        q, put = _collect()
        sched.submit(Request([eos - 3], 10, put, SamplingParams(0.0)))
        events = _drain(q)
        assert [e.token for e in events if isinstance(e, TokenEvent)] == [eos - 2, eos - 1]
        assert events[-1].reason == "stop" and events[-1].completion_tokens == 2
    finally:
        sched.stop()


@pytest.mark.parametrize("tensor_type", ["Q4_0", "Q4_K", "F16"])
@pytest.mark.parametrize("fast", [False, True], ids=["exact", "fast"])
def test_decode_batch_rows_equal_decoding_alone_bit_for_bit(tiny_model_factory, tensor_type, fast, no_leaks):
    """The real engine: a continuous batch's logits are, row for row, exactly those of each
    sequence decoded alone (batched attention, FFN exchange and split head included), so a
    greedy request gives the same tokens alone and inside a batch."""
    from coordinator.runtime.engine import Engine, EngineOptions

    path = tiny_model_factory(tensor_type=tensor_type, seed=3)
    prompts = [[5, 9, 30, 31], [7, 8], [40, 41, 42, 43, 44, 45, 46], [3], [11, 12, 13]]
    # every cache in the shared pool, as the server sizes it (--parallel + 1): a private cache's
    # attention cannot be split across the processes, so it would be summed otherwise
    with Engine(path, EngineOptions(threads=2, cpu_workers=1, fast=fast, kv_caches=2 * len(prompts) + 1)) as eng:
        assert_batch_is_alone(eng.model, prompts)


def test_exchange_timings_stay_bounded():
    from coordinator.runtime.sparse_ffn import ExchangeStats

    st = ExchangeStats()
    st.round_trip_us.extend(range(250))
    st.trim(keep=100)
    assert st.round_trip_us == list(range(150, 250))
    st.trim(keep=100)  # below twice the bound: nothing to do
    assert len(st.round_trip_us) == 100
