"""Speculative decoding against plain decoding, on one engine in one run: three kinds of task,
each decoded greedily with speculation (--spec, default ngram as on the command line) and
without, the two interleaved round by round (the order alternating), so both see the same
machine. Prints per run the decode speed (tokens after the first over the wall time from the
first token to the last: drafting and checking included), acceptance and tokens per target
step, then per task the median speeds' ratio and whether the greedy text was identical.

Tasks: `rewrite` (a paragraph given back with one change: most of the reply repeats the
prompt), `code` (a class whose methods repeat its identifiers) and `free` (a free-form answer:
little repeats, speculation should back off and cost nothing).

    PYTHONPATH=. python scripts/bench_speculative.py [-m MODEL] [-n 128] [--rounds 3] [--json]

Done-means of issue 44 on SmolLM2 (default options): rewrite >= 1.8x with identical text, free
>= 0.97x. Timings mean something on a quiet machine only (the script prints the load average).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

PARAGRAPH = ("The old lighthouse stood on the northern cliff for more than a century. Every night its keeper "
             "climbed the spiral stairs, trimmed the wick, and watched the beam sweep across the dark water. "
             "Ships passing the rocks relied on its light to find the narrow channel into the harbor, and the "
             "fishermen of the village said that no boat had been lost while the keeper kept his watch.")
CODE = '''class InventoryManager:
    def __init__(self):
        self.items = {}
        self.item_prices = {}

    def add_item(self, item_name, quantity, price):
        if item_name in self.items:
            self.items[item_name] += quantity
        else:
            self.items[item_name] = quantity
        self.item_prices[item_name] = price

    def remove_item(self, item_name, quantity):
'''
TASKS = {
    "rewrite": ("chat", "Rewrite the following paragraph, replacing the word 'keeper' with 'guardian'. Keep "
                        f"everything else exactly the same.\n\n{PARAGRAPH}"),
    "code": ("raw", CODE),
    "free": ("chat", "Write a short story about a robot who learns to paint."),
}


def run(eng, ids, n, speculate):
    """(tokens, decode tok/s, the run's speculation counts or None)."""
    toks, t_first = [], None
    for tok in eng.generate(ids, n, speculate=speculate):
        if t_first is None:
            t_first = time.perf_counter()
        toks.append(tok)
    dt = time.perf_counter() - t_first
    return toks, (len(toks) - 1) / dt if dt > 0 else float("nan"), eng.stats()["spec"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("-m", "--model", default=None, help="GGUF (default: SmolLM2)")
    ap.add_argument("-n", type=int, default=128, help="tokens per run")
    ap.add_argument("--rounds", type=int, default=3, help="runs of each mode per task, interleaved")
    ap.add_argument("-t", "--threads", type=int, default=None)
    ap.add_argument("--tasks", default=",".join(TASKS), help="comma-separated: " + ", ".join(TASKS))
    ap.add_argument("--spec", default="ngram", choices=["ngram", "draft"],
                    help="the speculation to measure (default ngram, the command line's default)")
    ap.add_argument("--draft-model", default=None, help="with --spec draft: the drafting GGUF")
    ap.add_argument("--json", action="store_true", help="one JSON object at the end")
    args = ap.parse_args()
    from coordinator.runtime.engine import Engine, EngineOptions
    from coordinator.runtime.model_fetch import default_model_path

    tasks = [t for t in args.tasks.split(",") if t]
    for t in tasks:
        if t not in TASKS:
            sys.exit(f"error: unknown task {t!r}: choose from {', '.join(TASKS)}")
    print(f"load average before: {' '.join(f'{x:.2f}' for x in os.getloadavg())}", flush=True)
    results = {}
    with Engine(args.model or default_model_path(), EngineOptions(threads=args.threads, spec=args.spec,
                                                                               draft_model=args.draft_model)) as eng:
        print(f"model {eng.path.name}, speculation {eng.opts.spec}, {args.n} tokens, {args.rounds} rounds", flush=True)
        for task in tasks:
            kind, text = TASKS[task]
            ids = eng.encode_chat([{"role": "user", "content": text}]) if kind == "chat" else eng.tokenizer.encode(text)
            run(eng, ids, 8, False)  # warm-up: caches, first wake-ups
            run(eng, ids, 16, True)
            speeds = {False: [], True: []}
            texts = {False: None, True: None}
            same, acc, tps = True, [], []
            for r in range(args.rounds):
                for sp in ((False, True) if r % 2 == 0 else (True, False)):
                    toks, tok_s, st = run(eng, ids, args.n, sp)
                    speeds[sp].append(tok_s)
                    if texts[sp] is None:
                        texts[sp] = toks
                    same = same and toks == (texts[False] if texts[False] is not None else toks)
                    extra = ""
                    if st is not None:
                        acc.append(st.acceptance)
                        tps.append(st.tokens_per_step)
                        extra = f"  acceptance {100 * st.acceptance:5.1f} %  {st.tokens_per_step:.2f} tok/step"
                    print(f"{task:8s} round {r + 1} {'spec ' if sp else 'plain'}  {len(toks):4d} tok  "
                          f"{tok_s:7.2f} tok/s{extra}", flush=True)
            same = same and texts[True] == texts[False]
            plain, spec = statistics.median(speeds[False]), statistics.median(speeds[True])
            results[task] = dict(plain_tok_s=plain, spec_tok_s=spec, ratio=spec / plain, identical=same,
                                 acceptance=statistics.median(acc) if acc else None,
                                 tokens_per_step=statistics.median(tps) if tps else None,
                                 text=eng.tokenizer.decode(texts[False]))
    print(f"load average after: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    for task, r in results.items():
        print(f"{task:8s} plain {r['plain_tok_s']:7.2f} tok/s  spec {r['spec_tok_s']:7.2f} tok/s  "
              f"ratio {r['ratio']:.2f}x  acceptance {100 * (r['acceptance'] or 0):.0f} %  "
              f"{r['tokens_per_step'] or 0:.2f} tok/step  greedy text {'identical' if r['identical'] else 'DIFFERS'}")
    goals = {"rewrite": 1.8, "free": 0.97}
    for task, want in goals.items():
        if task in results:
            r = results[task]
            ok = r["ratio"] >= want and (task != "rewrite" or r["identical"])
            print(f"goal {task}: >= {want}x{' with identical text' if task == 'rewrite' else ''}: "
                  f"{'met' if ok else 'NOT met'} ({r['ratio']:.2f}x)")
    if args.json:
        print(json.dumps({t: {k: v for k, v in r.items() if k != "text"} for t, r in results.items()}))


if __name__ == "__main__":
    main()
