#!/usr/bin/env python3
"""Where a decoded token's time goes: the whole token (in lockstep, where the engine uses it, and
layer by layer), the coordinator alone (every layer's FFN replaced by zeros), the lm_head (on one
core, and split across processes when it is), and the per-layer FFN exchange, each a median over
repeated one-token steps (SmolLM2 by default).

    PYTHONPATH=. python3 scripts/profile_decode.py [-m MODEL] [-t 2] [--weights f32|f16] [-n 40]
"""
from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import torch

from coordinator.runtime.engine import Engine, EngineOptions
from coordinator.runtime.model_fetch import default_model_path
from coordinator.tools import observe


def median_ms(fn, n: int) -> float:
    fn()
    ts = []
    for _ in range(n):
        t = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t)
    return statistics.median(ts) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("-m", "--model", default=None)
    ap.add_argument("-t", "--threads", type=int, default=2)
    ap.add_argument("--weights", default="f32")
    ap.add_argument("--arith", default="fast", choices=["exact", "fast"], help="with --weights gguf")
    ap.add_argument("-n", type=int, default=40, help="one-token steps per measurement")
    args = ap.parse_args()
    with Engine(args.model or default_model_path(), EngineOptions(threads=args.threads, weights=args.weights,
                                                                              fast=args.arith == "fast")) as eng:
        m = eng.model
        ids = eng.tokenizer.encode("The history of the city of Paris begins")
        zero_ffn = lambda layer, x, pre, decode=False: torch.zeros_like(x)  # noqa: E731
        room = m.max_ctx - len(ids) - 1
        n = min(args.n, room // 2 - 1)

        def steps(ffn):
            m.ffn = ffn  # the model's FFN is an object passed in: swap it for this measurement
            m.cache.reset()
            m.forward(ids)
            return lambda: m.forward([5])

        lockstep = m.lockstep
        if lockstep is not None:  # every layer in one post (coordinator/runtime/lockstep_decode.py)
            locked = median_ms(steps(eng.ffn), n)
            locked_layers = np.median(eng.ffn.stats.lockstep_us[-n:]) / 1e3
            m.lockstep = None  # the rest of the profile: layer by layer, each step timed alone
        full = median_ms(steps(eng.ffn), n)
        m.lockstep = lockstep
        exchanges = np.array(eng.ffn.stats.round_trip_us[-n * eng.cfg.n_layers:])
        alone = median_ms(steps(zero_ffn), n)
        m.ffn = eng.ffn
        x = torch.randn(1, eng.cfg.hidden)
        with torch.inference_mode():
            split, eng.head.split = eng.head.split, None  # the whole head on this core
            head = median_ms(lambda: eng.head(x), 50)
            eng.head.split = split
        layers = eng.cfg.n_layers
        share = observe.worker_layout(eng)["coordinator_ffn_share"]
        print(f"{args.weights}, {args.threads} threads, coordinator FFN share {100 * share:.0f}%, "
              f"medians of {n} one-token steps")
        if lockstep is not None:
            print(f"  whole token in lockstep      {locked:7.2f} ms   its layers {locked_layers:.2f} ms "
                  f"(used; below: layer by layer)")
        print(f"  whole token                  {full:7.2f} ms")
        split = eng.ffn.stats.head_us
        head_note = (f"; split across processes {np.median(split) / 1e3:.2f} ms (used)" if split else "")
        print(f"  coordinator alone (FFN = 0)  {alone:7.2f} ms   lm_head on one core {head:.2f} ms{head_note}")
        print(f"  FFN exchanges                {layers} x {np.median(exchanges):.0f} us = "
              f"{layers * np.median(exchanges) / 1e3:.2f} ms")
        print(f"  not accounted for            {full - alone - layers * np.median(exchanges) / 1e3:7.2f} ms")
        attn = eng.ffn.stats.attn_us
        if attn:
            print(f"  attention heads split across processes: {layers} x {np.median(attn):.0f} us = "
                  f"{layers * np.median(attn) / 1e3:.2f} ms (in 'coordinator alone')")


if __name__ == "__main__":
    main()
