#!/usr/bin/env python3
"""Decode speed of the worker weight formats end to end (SmolLM2 by default): one engine per
format, all open at once, generating in turns so that load from other processes hits each alike.
Prints per format the median decode tok/s and the median compute time of the slowest worker per
layer (round trip minus sync overhead), which isolates the FFN kernels from the ZMQ exchange.

    PYTHONPATH=. python3 scripts/bench_weights_e2e.py --rounds 4 -n 48 [--sparsity 0.2]

A variant may fix the coordinator's share of the FFN neurons and whether the lm_head's rows
are split too (FORMAT[:SHARE[:split|whole]]): `--formats f32:0,f32` compares the coordinator
computing none of them with its default share; `f32::whole,f32` the lm_head on one core with
the lm_head split.
"""
from __future__ import annotations

import argparse
import statistics

import numpy as np

from coordinator.runtime.engine import Engine, EngineOptions
from coordinator.runtime.model_fetch import default_model_path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("-m", "--model", default=None)
    ap.add_argument("--formats", default="f32,int8,f16", help="comma-separated FORMAT[:COORDINATOR_SHARE[:split|whole]]")
    ap.add_argument("--sparsity", type=float, default=None)
    ap.add_argument("-t", "--threads", type=int, default=2)
    ap.add_argument("-n", type=int, default=48, help="tokens per generation")
    ap.add_argument("--rounds", type=int, default=4)
    args = ap.parse_args()
    path = args.model or default_model_path()
    engines = {}
    for variant in args.formats.split(","):
        fmt, share, head = (variant.split(":") + ["", ""])[:3]
        engines[variant] = Engine(path, EngineOptions(threads=args.threads, sparsity=args.sparsity, weights=fmt,
                                                      coordinator_share=float(share) if share else None,
                                                      split_lm_head=head != "whole"))
    tps = {f: [] for f in engines}
    compute = {f: [] for f in engines}
    try:
        ids = next(iter(engines.values())).tokenizer.encode("The history of the city")
        for _ in range(args.rounds):
            for f, eng in engines.items():
                st = eng.ffn.stats
                list(eng.generate(ids, args.n, stop_at_eos=False))  # prefill, then decode
                s = eng.stats()
                tps[f].append(s["decode_tokens"] / s["decode_s"])
                n_dec = s["decode_tokens"] * eng.cfg.n_layers  # the decode steps are the last ones
                rt, ov = np.array(st.round_trip_us[-n_dec:]), np.array(st.overhead_us[-n_dec:])
                compute[f].append(float(np.median(rt - ov)))
    finally:
        for eng in engines.values():
            eng.close()
    base = statistics.median(tps[next(iter(tps))])
    mode = "dense" if args.sparsity is None else f"sparsity {args.sparsity}"
    print(f"{mode}, {args.threads} threads, {args.rounds} rounds x {args.n} tokens, medians")
    for f in engines:
        print(f"  {f:11s} decode {statistics.median(tps[f]):6.2f} tok/s ({statistics.median(tps[f]) / base:.2f}x)   "
              f"slowest worker FFN compute {statistics.median(compute[f]):7.1f} us/layer   "
              f"runs: {', '.join(f'{v:.1f}' for v in tps[f])}")


if __name__ == "__main__":
    main()
