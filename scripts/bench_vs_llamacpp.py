"""Prefill and greedy-decode speed: our engine vs llama.cpp (llama-cpp-python), same GGUF.

Both are loaded once; timed runs alternate between them (the order flips every rep) and
the table shows medians. Prefill = evaluating --pp prompt tokens up to the first
token; decode = the next --tg - 1 tokens, one forward each, greedy.

Our engine runs dense and at each --sparsity level (default 0.2, the operating point), with
each --weights format (default f32, the exact one; f16 halves the bytes a token reads).

Usage: python scripts/bench_vs_llamacpp.py [--threads 2] [--pp 128] [--tg 64] [--reps 3] [--sparsity 0.2 0.5]
                                           [--weights f32 f16]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from protocol.messages import WEIGHT_FORMATS  # noqa: E402  (after the path insert)

DEFAULT_MODEL = Path.home() / ".cache/sparseinfer/models/SmolLM2-135M-Instruct.Q4_1.gguf"


class LlamaCppRunner:
    name = "llama.cpp"

    def __init__(self, model: Path, threads: int, pp: int, tg: int, extra_bufts: bool):
        from compare_llamacpp import open_llama

        nb = max(pp, 512)
        self.llm = open_llama(model, extra_bufts, n_ctx=pp + tg + 16, n_batch=nb, n_ubatch=nb,
                              n_threads=threads, n_threads_batch=threads)
        self.n_vocab = self.llm.n_vocab()

    def _argmax_last(self) -> int:
        # logits_all=False: llama-cpp-python keeps no scores; read the last row directly
        row = self.llm._ctx.get_logits_ith(-1)
        return int(np.argmax(np.ctypeslib.as_array(row, shape=(self.n_vocab,))))

    def run(self, prompt: list[int], tg: int) -> dict:
        """(prefill seconds, decode seconds, generated ids), greedy argmax."""
        llm = self.llm
        llm.reset()
        t0 = time.perf_counter()
        llm.eval(prompt)
        ids = [self._argmax_last()]
        t1 = time.perf_counter()
        for _ in range(tg - 1):
            llm.eval([ids[-1]])
            ids.append(self._argmax_last())
        t2 = time.perf_counter()
        return dict(prefill_s=t1 - t0, decode_s=t2 - t1, ids=ids)

    def close(self):
        self.llm.close()


class OursRunner:
    """Our engine in one mode (dense, or sparse at a calibrated level); runners may share an engine."""

    def __init__(self, eng, sparsity: float | None, label: str = ""):
        from coordinator.tools.bench import Mode

        self.eng = eng
        self.mode = Mode("dense") if sparsity is None else Mode(f"sparse {sparsity:.2f}", sparsity=sparsity)
        self.name = f"ours {label}{self.mode.name}"
        self.sync_us = {"decode": []}  # per-layer exchange overheads, timed runs only

    def run(self, prompt: list[int], tg: int) -> dict:
        from coordinator.tools.bench import timed_run

        self.mode.apply(self.eng)
        r = timed_run(self.eng, prompt, tg)
        self.sync_us["decode"] += r.sync_us
        return dict(prefill_s=r.prefill_s, decode_s=r.decode_s, ids=r.ids, active_fraction=r.active_fraction)

    def close(self):
        pass  # the engine is closed by whoever opened it


def busy_cores(seconds: float = 1.0) -> float | None:
    """Cores kept busy by other processes while we sit idle (Linux /proc/stat), else None."""
    def sample():
        with open("/proc/stat") as f:
            v = [int(x) for x in f.readline().split()[1:]]
        return sum(v), v[3] + v[4]  # total, idle + iowait
    try:
        t0, i0 = sample()
        time.sleep(seconds)
        t1, i1 = sample()
    except OSError:
        return None
    return (os.cpu_count() or 1) * (1 - (i1 - i0) / max(1, t1 - t0))


def prompt_ids(model: Path, pp: int) -> list[int]:
    """pp tokens of English text from pydoc topics, by our GGUF tokenizer (tested to match
    transformers'), so the benchmark needs no transformers."""
    from compare_llamacpp import heldout_chunks
    from coordinator.tokenizer import GGUFTokenizer
    from sparsecore.gguf_file import open_gguf

    tok = GGUFTokenizer.from_reader(open_gguf(model))

    class _NoSpecials:  # heldout_chunks calls encode(text, add_special_tokens=False)
        def encode(self, text, add_special_tokens=False):
            return tok.encode(text, add_bos=add_special_tokens, add_eos=False)

    return heldout_chunks(_NoSpecials(), 1, pp)[0]


def bench(runners, prompt, tg: int, reps: int, warmup: int) -> dict:
    for r in runners:
        for _ in range(warmup):
            r.run(prompt, tg)
        if isinstance(r, OursRunner):
            r.sync_us = {"decode": []}  # keep only the timed runs' exchanges
    runs = {r.name: [] for r in runners}
    for rep in range(reps):
        for r in (runners if rep % 2 == 0 else runners[::-1]):
            runs[r.name].append(r.run(prompt, tg))
    return runs


def summarize(runs, pp: int, tg: int) -> dict:
    out = {}
    for name, rs in runs.items():
        pre = statistics.median(r["prefill_s"] for r in rs)
        dec = statistics.median(r["decode_s"] for r in rs)
        out[name] = dict(prefill_s=pre, decode_s=dec, pp_tok_s=pp / pre,
                         tg_tok_s=(tg - 1) / dec, ids=rs[-1]["ids"],
                         all_prefill_s=[r["prefill_s"] for r in rs],
                         all_decode_s=[r["decode_s"] for r in rs])
        if "active_fraction" in rs[-1]:
            out[name]["active_fraction"] = statistics.median(r["active_fraction"] for r in rs)
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path, default=DEFAULT_MODEL)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--cpu-workers", type=int, default=1, help="our engine's CPU workers")
    ap.add_argument("--pp", type=int, default=128, help="prompt tokens")
    ap.add_argument("--tg", type=int, default=64, help="generated tokens")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--sparsity", type=float, nargs="*", default=[0.2],
                    help="our sparse levels to run beside dense (calibrated thresholds; none: dense only)")
    ap.add_argument("--weights", nargs="+", default=["f32"], choices=WEIGHT_FORMATS,
                    help="our workers' weight formats, one engine each (f32: exact; f16: half the bytes)")
    ap.add_argument("--only", choices=["llamacpp", "ours"], help="benchmark one side only")
    ap.add_argument("--llama-extra-bufts", action="store_true",
                    help="let llama.cpp use its extra CPU buffer types (AMX, repack)")
    ap.add_argument("--json", type=Path, help="write the results here")
    args = ap.parse_args()
    if args.tg < 2:
        ap.error("--tg must be at least 2")

    prompt = prompt_ids(args.model, args.pp)
    busy_before = busy_cores()
    runners = []
    if args.only != "ours":
        runners.append(LlamaCppRunner(args.model, args.threads, args.pp, args.tg,
                                      args.llama_extra_bufts))
    engines = []
    if args.only != "llamacpp":
        from coordinator.engine import Engine, EngineOptions

        for w in args.weights:  # all open at once, so load from other processes hits each alike
            eng = Engine(args.model, EngineOptions(cpu_workers=args.cpu_workers, threads=args.threads,
                                                   ctx=args.pp + args.tg + 16, weights=w))
            engines.append(eng)
            label = "" if args.weights == ["f32"] else f"{w} "
            runners += [OursRunner(eng, None, label)] + [OursRunner(eng, s, label) for s in args.sparsity]
    try:
        runs = bench(runners, prompt, args.tg, args.reps, args.warmup)
        sync = {r.name: r.sync_us["decode"] for r in runners if isinstance(r, OursRunner)}
    finally:
        for r in runners:
            r.close()
        for eng in engines:
            eng.close()

    res = summarize(runs, args.pp, args.tg)
    busy = [None if b is None else round(b, 2) for b in (busy_before, busy_cores())]
    print(f"threads={args.threads} pp={args.pp} tg={args.tg} reps={args.reps} (medians); "
          f"cores busy with other work before/after: {busy}")
    spare = (os.cpu_count() or 1) - args.threads
    if any(b is not None and b > spare + 0.25 for b in busy):
        print("WARNING: other processes were using the cores; llama.cpp's OpenMP threads "
              "suffer most from that, so these numbers and the ratio are unreliable")
    print(f"{'':22s} {'pp tok/s':>10s} {'tg tok/s':>10s} {'prefill s':>10s} {'decode s':>10s}")
    for name, r in res.items():
        print(f"{name:22s} {r['pp_tok_s']:10.1f} {r['tg_tok_s']:10.1f} "
              f"{r['prefill_s']:10.3f} {r['decode_s']:10.3f}")
    result = dict(model=str(args.model), threads=args.threads, pp=args.pp, tg=args.tg,
                  reps=args.reps, cpu_workers=args.cpu_workers, weights=args.weights, busy_cores_other=busy,
                  cpu_count=os.cpu_count(), results=res)
    if "llama.cpp" in res:
        l = res["llama.cpp"]
        result["ratio_ours_over_llamacpp"] = {}
        for name, o in res.items():
            if name == "llama.cpp":
                continue
            ratio = dict(pp=o["pp_tok_s"] / l["pp_tok_s"], tg=o["tg_tok_s"] / l["tg_tok_s"])
            result["ratio_ours_over_llamacpp"][name] = ratio
            same = next((i for i, (a, b) in enumerate(zip(o["ids"], l["ids"])) if a != b), len(o["ids"]))
            print(f"{name}/llama.cpp: pp {ratio['pp']:.3f}x, tg {ratio['tg']:.3f}x; "
                  f"greedy ids agree for the first {same} of {len(o['ids'])} tokens")
    for name, us in sync.items():
        if us:
            result.setdefault("sync_us", {})[name] = dict(median=statistics.median(us),
                                                          p99=float(np.percentile(us, 99)), n=len(us))
            print(f"{name}: per-layer sync overhead while decoding: median {statistics.median(us):.1f} us, "
                  f"p99 {np.percentile(us, 99):.1f} us over {len(us)} exchanges")
    if args.json:
        args.json.write_text(json.dumps(result, indent=1) + "\n")
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
