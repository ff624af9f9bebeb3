#!/usr/bin/env python3
"""What constraining decoding to a grammar costs.

1. The libraries: for each of llguidance, xgrammar and outlines-core that is installed, the
   time to compile a nested JSON schema over this model's vocabulary, and the time per token to
   compute the allowed set, mask the logits and advance, walking a valid JSON reply token by
   token (the mask must allow each token: a check of the wiring, not only a timing).
2. Inside the continuous batch (llguidance, as the server uses it): the scheduler decodes 4
   sequences of `--tokens` tokens, with 0, 1 or 4 of them constrained to a JSON schema that
   cannot finish early, rounds interleaved; prints each mix's decode steps per second and its
   ratio to the unconstrained batch measured in the same run.

    python scripts/bench_structured_output.py [--model M] [--tokens 48] [--reps 3]
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string"}, "age": {"type": "integer", "minimum": 0},
    "city": {"type": "string", "enum": ["Rome", "Paris", "Berlin"]},
    "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 5},
    "address": {"type": "object", "properties": {"street": {"type": "string"},
                                                  "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                "required": ["street", "zip"], "additionalProperties": False}},
    "required": ["name", "age", "city", "tags", "address"], "additionalProperties": False}
REPLY = {"name": "Ada Lovelace", "age": 36, "city": "Paris", "tags": ["math", "poetry", "engines"],
         "address": {"street": "12 St James's Square", "zip": "10001"}}
LONG = {"type": "array", "items": {"type": "string"}, "minItems": 1000}  # never complete within the run


def _libraries(tk, n_vocab: int) -> None:
    ids = tk.encode(json.dumps(REPLY), add_bos=False, add_eos=False)
    logits = np.random.default_rng(0).standard_normal(n_vocab).astype(np.float32)
    toks = [tk.piece_bytes(i) for i in range(tk.vocab_size)]
    print(f"\n1. libraries: vocabulary {n_vocab}, a reply of {len(ids)} tokens")

    def report(name, setup_s, compile_s, per):
        print(f"  {name:14s} vocabulary {setup_s:5.2f} s  compile {1e3 * compile_s:6.1f} ms  per token median "
              f"{1e6 * statistics.median(per):6.0f} µs  mean {1e6 * statistics.mean(per):6.0f} µs  "
              f"max {1e6 * max(per):6.0f} µs")

    def per_token(step) -> list[float]:
        """Seconds of step(t) (mask, apply, check t is allowed, advance) for each token of the reply."""
        per = []
        for t in ids:
            a = time.perf_counter()
            step(t)
            per.append(time.perf_counter() - a)
        return per

    try:
        from coordinator.text.structured_output import Constraint, TokenTable, grammar_for
        t0 = time.perf_counter()
        table = TokenTable(tk, n_vocab)
        t1 = time.perf_counter()
        c = Constraint(table, grammar_for(json_schema=SCHEMA))
        t2 = time.perf_counter()
        def step(t):
            assert c.restrict(logits)[t] > -np.inf, t
            c.accept(t)
        report("llguidance", t1 - t0, t2 - t1, per_token(step))
    except ImportError:
        print("  llguidance: not installed")
    try:
        import torch
        import xgrammar as xgr
        t0 = time.perf_counter()
        info = xgr.TokenizerInfo(encoded_vocab=toks, vocab_type=xgr.VocabType.RAW, vocab_size=n_vocab,
                                 stop_token_ids=sorted(tk.eos_ids))
        compiler = xgr.GrammarCompiler(info)
        t1 = time.perf_counter()
        m = xgr.GrammarMatcher(compiler.compile_json_schema(json.dumps(SCHEMA)))
        mask = xgr.allocate_token_bitmask(1, n_vocab)
        t2 = time.perf_counter()
        lt = torch.from_numpy(logits)

        def step(t):
            m.fill_next_token_bitmask(mask)
            row = lt.clone().unsqueeze(0)
            xgr.apply_token_bitmask_inplace(row, mask)
            assert row[0, t] > -np.inf and m.accept_token(t), t
        report("xgrammar", t1 - t0, t2 - t1, per_token(step))
    except ImportError:
        print("  xgrammar: not installed")
    try:
        from outlines_core import Guide, Index, Vocabulary
        from outlines_core.json_schema import build_regex_from_schema
        t0 = time.perf_counter()
        eos = tk.eos_id
        d: dict[bytes, list[int]] = {}
        for i, b in enumerate(toks):
            if i != eos and not tk.is_special(i):
                d.setdefault(b, []).append(i)
        vocab = Vocabulary(eos, d)
        t1 = time.perf_counter()
        g = Guide(Index(build_regex_from_schema(json.dumps(SCHEMA)), vocab))
        t2 = time.perf_counter()
        def step(t):
            ok = np.zeros(n_vocab, bool)
            ok[g.get_tokens()] = True
            assert np.where(ok, logits, -np.inf)[t] > -np.inf, t
            g.advance(t)
        report("outlines-core", t1 - t0, t2 - t1, per_token(step))
    except ImportError:
        print("  outlines-core: not installed")


def _batch(engine, tokens: int, reps: int) -> None:
    from coordinator.runtime.batching import DoneEvent, FailedEvent, Request, Scheduler
    from coordinator.runtime.sampling import SamplingParams
    from coordinator.text.structured_output import Constraint, TokenTable, grammar_for
    table = TokenTable.of(engine.tokenizer, engine.model.cfg.vocab_size)
    grammar = grammar_for(json_schema=LONG)
    prompt = engine.tokenizer.encode("List some words as JSON:", add_bos=None)
    sched = Scheduler(engine, parallel=4).start()
    mixes = (0, 1, 4)
    rates: dict[int, list[float]] = {k: [] for k in mixes}
    try:
        for rep in range(reps + 1):  # the first round warms up and is not counted
            for k in mixes:
                ended: list = []
                all_done = threading.Event()

                def on_event(ev, ended=ended, all_done=all_done):  # on the scheduler's thread: never block it
                    if isinstance(ev, (DoneEvent, FailedEvent)):
                        ended.append(ev)
                        if len(ended) == 4:
                            all_done.set()
                steps0 = sched.steps
                t = time.perf_counter()
                for i in range(4):
                    sched.submit(Request(list(prompt), tokens, on_event, SamplingParams(), stop_at_eos=False,
                                         constraint=Constraint(table, grammar) if i < k else None))
                all_done.wait()
                dt = time.perf_counter() - t
                assert all(isinstance(e, DoneEvent) and e.reason == "length" for e in ended), ended
                if rep:
                    rates[k].append((sched.steps - steps0) / dt)
    finally:
        sched.stop()
    base = statistics.median(rates[0])
    print(f"\n2. a batch of 4 sequences, {tokens} tokens each, {reps} interleaved rounds (prefill included)")
    for k in mixes:
        r = statistics.median(rates[k])
        print(f"  {k} constrained: {r:6.1f} steps/s  {r / base:5.3f}x the unconstrained batch")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="a GGUF (default: SmolLM2, as `sparseinfer pull` fetches it)")
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args()
    from coordinator.runtime.engine import Engine, EngineOptions
    from coordinator.runtime.model_fetch import pull
    path = Path(a.model) if a.model else pull()
    engine = Engine(path, EngineOptions(threads=a.threads))
    try:
        print(f"model {path.name}")
        _libraries(engine.tokenizer, engine.model.cfg.vocab_size)
        _batch(engine, a.tokens, a.reps)
    finally:
        engine.close()


if __name__ == "__main__":
    main()
