"""Compare teacher-forced next-token distributions: our engine, llama.cpp, transformers.

Held-out text: Python's own pydoc topics (values sorted by key, joined), tokenized once
with transformers' tokenizer; chunks of --chunk-len tokens taken consecutively from the
second half. Every source gets the same ids and starts each chunk from an empty cache.
Reported per pair: top-1 agreement and mean KL(p || q) with p the reference
(llama.cpp, else transformers), plus each source's next-token NLL. Then llama.cpp and our
engine decode the prompts of tests/fixtures/smollm2_reference.json greedily and the first
step where they leave the transformers oracle is printed with the oracle's top-2 margin.

llama.cpp (llama-cpp-python; build it with scripts/setup-bench) runs in a process of its own,
started with this script's environment as it was before anything was imported, minus every
OpenMP/BLAS threading variable: nothing our packages, torch or transformers do in this process
reaches it. It keeps its default model parameters (its repacked CPU kernels on).

Usage: python scripts/compare_llamacpp.py [--chunks 8] [--chunk-len 128] [--json out.json]
"""

from __future__ import annotations

import os

# The environment before anything (ours or a library's) could change it: llama.cpp starts from it.
BASE_ENV = dict(os.environ)

import argparse  # noqa: E402
import json  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

DEFAULT_MODEL = Path.home() / ".cache/sparseinfer/models/SmolLM2-135M-Instruct.Q4_1.gguf"
REFERENCE = REPO / "tests" / "fixtures" / "smollm2_reference.json"
SOURCES = ("llamacpp", "transformers", "ours")


# ---- held-out ids ------------------------------------------------------------------------

def heldout_text() -> str:
    from pydoc_data.topics import topics
    return "\n\n".join(v for _, v in sorted(topics.items()))


def load_hf_tokenizer(model: Path):
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(str(model.parent), gguf_file=model.name)


def load_tokenizer(model: Path):
    """transformers' tokenizer; without transformers, our GGUF tokenizer (tested to match it)."""
    try:
        return load_hf_tokenizer(model)
    except ImportError:
        from coordinator.text.tokenizer import GGUFTokenizer
        from sparsecore.gguf_file import open_gguf

        print("transformers is not installed: tokenizing with our GGUF tokenizer")
        tok = GGUFTokenizer.from_reader(open_gguf(model))

        class _NoSpecials:  # heldout_chunks calls encode(text, add_special_tokens=False)
            def encode(self, text, add_special_tokens=False):
                return tok.encode(text, add_bos=add_special_tokens, add_eos=False)

        return _NoSpecials()


def heldout_chunks(tok, n_chunks: int, chunk_len: int) -> list[list[int]]:
    """Consecutive chunks from the second half of the tokenized pydoc topics."""
    ids = tok.encode(heldout_text(), add_special_tokens=False)
    start = len(ids) // 2
    if start + n_chunks * chunk_len > len(ids):
        raise SystemExit(f"held-out half has {len(ids) - start} tokens, "
                         f"{n_chunks}x{chunk_len} requested")
    return [ids[start + i * chunk_len: start + (i + 1) * chunk_len] for i in range(n_chunks)]


# ---- logits per source (each: list of [chunk_len, vocab] float32) ------------------------

THREAD_ENV_PREFIXES = ("OMP_", "GOMP_", "KMP_", "MKL_", "OPENBLAS_", "GOTO_", "BLIS_", "VECLIB_")


def clean_env() -> dict:
    """This script's starting environment minus threading variables."""
    return {k: v for k, v in BASE_ENV.items() if not k.startswith(THREAD_ENV_PREFIXES)}


def in_clean_process(func: str, **kw):
    """Run `func` (a name in this module) with keyword arguments `kw` in a fresh interpreter
    with clean_env(); its result comes back through a temporary file (.npz or .json)."""
    with tempfile.TemporaryDirectory(prefix="compare-llamacpp-") as d:
        out = Path(d) / "result"
        subprocess.run([sys.executable, str(Path(__file__).resolve()), "--call", func, str(out)],
                       input=json.dumps(kw), text=True, env=clean_env(), cwd=str(REPO), check=True)
        if out.with_suffix(".npz").exists():
            with np.load(out.with_suffix(".npz")) as z:
                return [z[f"arr_{i}"] for i in range(len(z.files))]
        return json.loads(out.with_suffix(".json").read_text())


def _serve_call(func: str, out: str) -> None:
    kw = json.loads(sys.stdin.read())
    r = globals()[func](**kw)
    if isinstance(r, list) and r and isinstance(r[0], np.ndarray):
        np.savez(out + ".npz", *r)
    else:
        Path(out + ".json").write_text(json.dumps(r))


def open_llama(model, **kw):
    """llama_cpp.Llama with its default model parameters (extra buffer types, i.e. repacked
    kernels, on). Only ever called inside a clean process (in_clean_process)."""
    from llama_cpp import Llama

    return Llama(str(model), verbose=False, **kw)


def _logits_llamacpp_here(model: str, chunks, threads: int):
    n = max(max(len(c) for c in chunks), 256)
    llm = open_llama(model, n_ctx=n, n_batch=n, n_ubatch=n, logits_all=True,
                     n_threads=threads, n_threads_batch=threads)
    out = []
    for c in chunks:
        llm.reset()
        llm.eval(c)
        out.append(np.array(llm.scores[: len(c)], dtype=np.float32))
    llm.close()
    return out


def logits_llamacpp(model: Path, chunks, threads: int):
    return in_clean_process("_logits_llamacpp_here", model=str(model), chunks=chunks, threads=threads)


def logits_transformers(model: Path, chunks, threads: int):
    import torch
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(threads)
    m = AutoModelForCausalLM.from_pretrained(str(model.parent), gguf_file=model.name,
                                             dtype=torch.float32).eval()
    with torch.inference_mode():
        return [m(input_ids=torch.tensor([c])).logits[0].float().numpy() for c in chunks]


def logits_ours(model: Path, chunks, threads: int, cpu_workers: int):
    from coordinator.runtime.engine import Engine, EngineOptions

    with Engine(model, EngineOptions(cpu_workers=cpu_workers, threads=threads)) as eng:
        return [np.asarray(eng.forward_logits(c), dtype=np.float32) for c in chunks]


# ---- greedy decoding of the reference prompts -------------------------------------------

def _greedy_llamacpp_here(model: str, prompts, n_new: int, threads: int):
    llm = open_llama(model, n_ctx=512, n_threads=threads, n_threads_batch=threads)
    n_vocab, out = llm.n_vocab(), []
    for pids in prompts:
        llm.reset()
        llm.eval(pids)
        ids = []
        for step in range(n_new):
            row = np.ctypeslib.as_array(llm._ctx.get_logits_ith(-1), shape=(n_vocab,))
            ids.append(int(np.argmax(row)))
            if step + 1 < n_new:
                llm.eval([ids[-1]])
        out.append(ids)
    llm.close()
    return out


def greedy_llamacpp(model: Path, prompts, n_new: int, threads: int):
    return in_clean_process("_greedy_llamacpp_here", model=str(model), prompts=prompts, n_new=n_new,
                            threads=threads)


def greedy_ours(model: Path, prompts, n_new: int, threads: int, cpu_workers: int):
    from coordinator.runtime.engine import Engine, EngineOptions
    from coordinator.runtime.sampling import SamplingParams

    with Engine(model, EngineOptions(cpu_workers=cpu_workers, threads=threads)) as eng:
        return [list(eng.generate(p, max_tokens=n_new, sampling=SamplingParams(temperature=0.0),
                                  stop_at_eos=False)) for p in prompts]


def greedy_check(args) -> dict:
    """First step where llama.cpp / ours leave the oracle's greedy ids, with its margin there."""
    ref = json.loads(REFERENCE.read_text())
    prompts = [p["prompt_ids"] for p in ref["prompts"]]
    n_new = ref["new_tokens"]
    runs = {"llamacpp": lambda: greedy_llamacpp(args.model, prompts, n_new, args.threads),
            "ours": lambda: greedy_ours(args.model, prompts, n_new, args.threads,
                                        args.cpu_workers)}
    out = {}
    for name in [s for s in args.sources if s in runs]:
        try:
            got = runs[name]()
        except Exception as e:
            print(f"greedy {name}: unavailable: {type(e).__name__}: {e}")
            continue
        out[name] = []
        for p, ids in zip(ref["prompts"], got):
            step = next((i for i, (a, b) in enumerate(zip(p["generated_ids"], ids)) if a != b),
                        None)
            row = dict(prompt=p["name"], first_divergence=step,
                       oracle_margin=None if step is None else p["margins"][step],
                       oracle_min_margin=p["min_margin"])
            out[name].append(row)
            where = "identical" if step is None else (
                f"differs from step {step} (oracle margin there {row['oracle_margin']:.4f})")
            print(f"greedy {name:9s} {p['name']:8s} {n_new} tokens: {where}")
    return out


# ---- metrics -----------------------------------------------------------------------------

def log_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    m = x.max(axis=-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(axis=-1, keepdims=True))


def compare(p_logits, q_logits) -> dict:
    """Top-1 agreement and KL(p || q) over every position of every chunk."""
    agree, kl, margin, diff = [], [], [], 0.0
    for p, q in zip(p_logits, q_logits):
        diff = max(diff, float(np.abs(p - q).max()))
        lp, lq = log_softmax(p), log_softmax(q)
        agree.append(p.argmax(-1) == q.argmax(-1))
        kl.append((np.exp(lp) * (lp - lq)).sum(-1))
        top2 = np.sort(p, axis=-1)[:, -2:]
        margin.append(top2[:, 1] - top2[:, 0])
    agree, kl, margin = np.concatenate(agree), np.concatenate(kl), np.concatenate(margin)
    return dict(top1_agreement=float(agree.mean()),
                # p's top-1 minus top-2 logit where the top-1s differ: small = near-tie
                disagree_p_margins=[round(float(m), 4) for m in margin[~agree]],
                kl_mean=float(kl.mean()),
                kl_median=float(np.median(kl)), kl_max=float(kl.max()), max_abs_logit_diff=diff,
                positions=int(kl.size))


def next_token_nll(logits, chunks) -> float:
    """Mean negative log-likelihood of the actual next token (positions 0..L-2)."""
    nll = [-log_softmax(lg[:-1])[np.arange(len(c) - 1), c[1:]] for lg, c in zip(logits, chunks)]
    return float(np.concatenate(nll).mean())


# ---- main --------------------------------------------------------------------------------

def collect(args, chunks) -> tuple[dict, dict]:
    """Logits from every requested source; a failing source is reported, not fatal."""
    logits, notes = {}, {}
    runners = {
        "llamacpp": lambda: logits_llamacpp(args.model, chunks, args.threads),
        "transformers": lambda: logits_transformers(args.model, chunks, args.threads),
        "ours": lambda: logits_ours(args.model, chunks, args.threads, args.cpu_workers),
    }
    for name in args.sources:
        t0 = time.perf_counter()
        try:
            logits[name] = runners[name]()
            notes[name] = f"ok, {time.perf_counter() - t0:.1f}s"
        except Exception as e:  # report and go on with the other sources
            notes[name] = f"unavailable: {type(e).__name__}: {e}"
        print(f"{name:12s} {notes[name]}", flush=True)
    return logits, notes


def pairs(available) -> list[tuple[str, str]]:
    wanted = [("llamacpp", "ours"), ("llamacpp", "transformers"), ("transformers", "ours")]
    return [(p, q) for p, q in wanted if p in available and q in available]


def main():
    if len(sys.argv) == 4 and sys.argv[1] == "--call":  # in_clean_process's child
        return _serve_call(sys.argv[2], sys.argv[3])
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path, default=DEFAULT_MODEL)
    ap.add_argument("--chunks", type=int, default=8)
    ap.add_argument("--chunk-len", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--cpu-workers", type=int, default=1, help="our engine's CPU workers")
    ap.add_argument("--sources", default=",".join(SOURCES),
                    type=lambda s: [x for x in s.split(",") if x],
                    help="comma list of " + ",".join(SOURCES))
    ap.add_argument("--no-greedy", action="store_true",
                    help="skip greedy decoding of the reference fixture's prompts")
    ap.add_argument("--json", type=Path, help="write the results here")
    args = ap.parse_args()
    if bad := [s for s in args.sources if s not in SOURCES]:
        ap.error(f"unknown source(s) {bad}")

    chunks = heldout_chunks(load_tokenizer(args.model), args.chunks, args.chunk_len)
    print(f"{len(chunks)} chunks x {args.chunk_len} tokens from pydoc_data.topics (second half)")
    logits, notes = collect(args, chunks)

    result = dict(model=str(args.model), chunks=args.chunks, chunk_len=args.chunk_len,
                  threads=args.threads, sources=notes, pairs={},
                  nll={k: next_token_nll(v, chunks) for k, v in logits.items()})
    print(f"\n{'p (ref)':12s} {'q':12s} {'top1 agree':>10s} {'KL mean':>10s} "
          f"{'KL median':>10s} {'KL max':>10s} {'max|dlogit|':>11s}")
    for p, q in pairs(logits):
        r = result["pairs"][f"{p}|{q}"] = compare(logits[p], logits[q])
        print(f"{p:12s} {q:12s} {r['top1_agreement']:10.4f} {r['kl_mean']:10.2e} "
              f"{r['kl_median']:10.2e} {r['kl_max']:10.2e} {r['max_abs_logit_diff']:11.2e}")
    print("next-token NLL:", {k: round(v, 4) for k, v in result["nll"].items()})
    for k, r in result["pairs"].items():
        if r["disagree_p_margins"]:
            print(f"{k}: reference top-2 margins where top-1 differs: {r['disagree_p_margins']}")
    if not args.no_greedy and REFERENCE.exists():
        print()
        result["greedy"] = greedy_check(args)
    if args.json:
        args.json.write_text(json.dumps(result, indent=1) + "\n")
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
