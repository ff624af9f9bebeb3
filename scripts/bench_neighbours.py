"""Decode speed with busy neighbours: how the per-layer exchange copes with a shared machine.

For each count of busy-loop neighbour processes (`python -c "while True: pass"`, started here and
killed after), run a fresh engine once per sync policy, interleaved (the order alternates from
round to round), and decode: prefill a -p token prompt, then time -n greedy tokens. A policy is
forced through $SPARSEINFER_SYNC (protocol/doorbell.py), which the workers inherit: `static` is
the old rule (spin whenever the processes that compute have a core each, then sleep on the wake
pipe), `adaptive` the new one (the default). Prints tok/s per run, medians, each policy's ratio
to its own quiet speed and new/old ratios, all measured in this one run.

    PYTHONPATH=. python scripts/bench_neighbours.py -t 2 -p 16 -n 64 --rounds 2
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def child(args) -> None:
    """One run in this process: load, warm up, decode, print one JSON line."""
    import numpy as np

    from coordinator.runtime.engine import Engine, EngineOptions
    from coordinator.runtime.model_fetch import default_model_path
    from coordinator.tools import corpus

    with Engine(args.model or default_model_path(), EngineOptions(threads=args.threads)) as eng:
        prompt = eng.tokenizer.encode(corpus.load(None, "heldout"))[:args.p]
        for _ in eng.generate(prompt, 4, stop_at_eos=False):  # warm-up: caches, first wake-ups
            pass
        n = 0
        for _ in eng.generate(prompt, args.n, stop_at_eos=False):
            n += 1
        s = eng.stats()
        print(json.dumps(dict(tok_s=s["decode_tokens"] / s["decode_s"], tokens=s["decode_tokens"],
                              sync_us_median=float(np.median(s["sync_us"])),
                              sync_us_p99=float(np.percentile(s["sync_us"], 99)),
                              spin=eng.pool.spin, workers=len(eng.pool.workers),
                              contended=eng.pool.bell.governor.contended,
                              switches=eng.pool.bell.governor.switches)), flush=True)


def run_one(args, policy: str) -> dict:
    env = dict(os.environ, SPARSEINFER_SYNC=policy)
    env["PYTHONPATH"] = str(REPO) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    cmd = [sys.executable, __file__, "--child", "-t", str(args.threads), "-p", str(args.p), "-n", str(args.n)]
    if args.model:
        cmd += ["-m", args.model]
    r = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=args.timeout)
    if r.returncode != 0:
        raise SystemExit(f"run with {policy} failed:\n{r.stderr[-2000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def start_neighbours(k: int) -> list[subprocess.Popen]:
    return [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(k)]


def stop(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        p.kill()
    for p in procs:
        p.wait()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-m", "--model", default=None)
    ap.add_argument("-t", "--threads", type=int, default=2)
    ap.add_argument("-p", type=int, default=16, help="prompt tokens")
    ap.add_argument("-n", type=int, default=64, help="decoded tokens timed")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--neighbours", default="0,1,2", help="comma-separated counts of busy-loop processes")
    ap.add_argument("--policies", default="static,adaptive", help="comma-separated $SPARSEINFER_SYNC values")
    ap.add_argument("--timeout", type=float, default=600)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        return child(args)
    policies = args.policies.split(",")
    counts = [int(k) for k in args.neighbours.split(",")]
    print(f"uptime: {subprocess.run(['uptime'], capture_output=True, text=True).stdout.strip()}")
    print(f"cores {len(os.sched_getaffinity(0))}, -t {args.threads}, -p {args.p}, -n {args.n}, "
          f"{args.rounds} rounds, policies {policies}", flush=True)
    tok: dict[tuple[int, str], list[float]] = {}
    for rnd in range(args.rounds):
        for k in counts:
            order = policies if rnd % 2 == 0 else policies[::-1]
            neighbours = start_neighbours(k)
            try:
                time.sleep(0.5)  # let them reach full speed
                for pol in order:
                    r = run_one(args, pol)
                    tok.setdefault((k, pol), []).append(r["tok_s"])
                    print(f"round {rnd} neighbours {k} {pol:9s} {r['tok_s']:7.2f} tok/s  sync median "
                          f"{r['sync_us_median']:8.1f} us p99 {r['sync_us_p99']:9.1f} us  (spin {r['spin']}, "
                          f"{r['workers']} workers; coordinator went contended {r['switches']}x)", flush=True)
            finally:
                stop(neighbours)
    print(f"uptime: {subprocess.run(['uptime'], capture_output=True, text=True).stdout.strip()}")
    med = {key: statistics.median(v) for key, v in tok.items()}
    print("\nmedian decode tok/s (ratio to the same policy with no neighbour)")
    print("neighbours  " + "  ".join(f"{p:>20s}" for p in policies) +
          ("  new/old" if len(policies) == 2 else ""))
    for k in counts:
        cells = []
        for p in policies:
            quiet = med.get((0, p))
            ratio = f"({med[(k, p)] / quiet:4.0%})" if quiet else ""
            cells.append(f"{med[(k, p)]:12.2f} {ratio:>7s}")
        line = f"{k:10d}  " + "  ".join(f"{c:>20s}" for c in cells)
        if len(policies) == 2:
            line += f"  {med[(k, policies[1])] / med[(k, policies[0])]:6.2f}x"
        print(line)


if __name__ == "__main__":
    main()
