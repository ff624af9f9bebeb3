"""Prefill and greedy-decode speed, time to first token and memory: our engine vs llama.cpp.

Fair by construction (issue 14):
- llama.cpp (llama-cpp-python; build it with scripts/setup-bench) runs in a process of its
  own, started with this script's environment as it was before anything was imported, minus
  every OpenMP/BLAS threading variable (OMP_*, GOMP_*, KMP_*, MKL_*, OPENBLAS_*). It keeps its
  default model parameters: its repacked (extra buffer type) CPU kernels are on.
- Our engine runs the same way: one process per --weights format (plus its worker processes),
  from the same clean environment; it sets its own thread/wait policy inside itself.
- Same GGUF file, same prompt ids, same thread count; all processes load first, one at a
  time, then timed runs alternate between them (A B A B ..., the order flipping every rep)
  and the table shows medians. Prefill = evaluating --pp prompt tokens up to the first token;
  decode = the next --tg - 1 tokens, one forward each, greedy.

Reported per side: pp and tg tok/s and their ratios ours/llama.cpp; load (process start until
the model is ready: interpreter, imports, model, workers) and cold TTFT (process start until
the first token of the prompt: load + the first prefill); peak resident memory, the sum of
VmHWM over the process and all its descendants (ours: coordinator + workers; theirs: its one
process), and PSS summed at the end (shared pages counted once); the machine's read bandwidth,
measured by `sparseinfer bench`'s reduction in a clean process of its own.

Our engine runs dense, at each --sparsity level named (calibrated thresholds), and with a PWRI
file's own predictors (llama.cpp cannot load those: give it the dense file with --llama-model).
Usage: scripts/bench_vs_llamacpp.py [--model M] [--pp 128] [--tg 64] [--reps 3] [--sparsity 0.5 ...]
"""

from __future__ import annotations

import os

# The environment before anything (ours or a library's) could change it: children start from it.
BASE_ENV = dict(os.environ)

import argparse  # noqa: E402
import json  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
from protocol.messages import WEIGHT_FORMATS  # noqa: E402  (light: no torch)

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_limits import (MemoryLimit, busy_cores, cpu_name, drop_caches, machine_busy_s,  # noqa: E402
                          tree_cpu_s, tree_memory, tree_read_bytes)

DEFAULT_MODEL = Path.home() / ".cache/sparseinfer/models/SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_WEIGHTS = "gguf-fast"  # what `sparseinfer` runs by default (--weights gguf --arith fast)
THREAD_ENV_PREFIXES = ("OMP_", "GOMP_", "KMP_", "MKL_", "OPENBLAS_", "GOTO_", "BLIS_", "VECLIB_")
REPLY = "@@bench "  # prefix of a child's protocol lines on its private stdout


def clean_env() -> dict:
    """The environment every benchmarked process starts from: the one this script was started
    with, minus threading variables, so neither side inherits a policy meant for the other."""
    return {k: v for k, v in BASE_ENV.items() if not k.startswith(THREAD_ENV_PREFIXES)}


# ---- children: one benchmarked process each ------------------------------------------------

class _Channel:
    """The child's end: protocol lines go to the original stdout, which nothing else may write
    (fd 1 is pointed at stderr, so library prints cannot corrupt the protocol)."""

    def __init__(self):
        self.out = os.fdopen(os.dup(1), "w", buffering=1)
        os.dup2(2, 1)
        sys.stdout = sys.stderr

    def send(self, **msg):
        self.out.write(REPLY + json.dumps(msg) + "\n")

    def commands(self):
        for line in sys.stdin:
            if line.strip():
                yield json.loads(line)


class LlamaCppSide:
    def __init__(self, model: str, threads: int, n_ctx: int, n_batch: int, repack: bool = True):
        import numpy as np
        import llama_cpp.llama as binding
        from llama_cpp import Llama

        self.np = np
        if not repack:  # its weights the file's mapped pages only (llama.cpp's --no-repack)
            defaults = binding.llama_cpp.llama_model_default_params

            def plain_mmap():
                p = defaults()
                p.use_extra_bufts = False
                return p
            binding.llama_cpp.llama_model_default_params = plain_mmap
        self.llm = Llama(model, verbose=False, n_ctx=n_ctx, n_batch=n_batch, n_ubatch=n_batch,
                         n_threads=threads, n_threads_batch=threads)
        self.n_vocab = self.llm.n_vocab()
        self.modes = ["llama.cpp" if repack else "llama.cpp no-repack"]

    def _argmax_last(self) -> int:
        # logits_all=False: llama-cpp-python keeps no scores; read the last row directly
        row = self.llm._ctx.get_logits_ith(-1)
        return int(self.np.argmax(self.np.ctypeslib.as_array(row, shape=(self.n_vocab,))))

    def run(self, mode: str, prompt: list[int], tg: int) -> dict:
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


class OursSide:
    def __init__(self, model: str, threads: int, n_ctx: int, weights: str, cpu_workers: int,
                 sparsity: list[float], label: str, dense: bool = True, sparse_method: str = "input"):
        sys.path.insert(0, str(REPO))
        from coordinator.runtime.engine import Engine, EngineOptions
        from coordinator.tools.bench import Mode

        # "gguf-fast": the file's blocks with 8-bit activations (the engine's default, --weights gguf
        # --arith fast); "gguf": the same blocks with exact arithmetic (--arith exact)
        fast = weights == "gguf-fast"
        # An engine that only decodes densely holds its gate/up rows interleaved (fast mode's
        # faster layout, EngineOptions.interleave); one that switches to sparse steps keeps the
        # file's rows: `dense` False, a process of its own for the sparse levels.
        self.eng = Engine(model, EngineOptions(cpu_workers=cpu_workers, threads=threads, ctx=n_ctx,
                                               weights="gguf" if fast else weights, fast=fast,
                                               interleave=None if (dense and not sparsity) or sparse_method == "input"
                                               else False,
                                               # an engine for sparse levels starts at one: input
                                               # sparsity's twins are made at load
                                               sparsity=sparsity[0] if sparsity else None,
                                               sparse_method=sparse_method))
        own = self.eng.predictors  # a PWRI file's own fc1/fc2, else None
        # an engine whose twins do not fit in the memory it has decodes densely (it says so): its
        # sparse modes are named for what they run
        dropped = " (decoded densely: its twins do not fit)" if sparsity and self.eng.opts.sparsity is None else ""
        modes = ([Mode("dense")] if dense else []) + [Mode(f"sparse {s:.2f}{dropped}", sparsity=None if dropped else s)
                                                      for s in sparsity]
        if own is not None:
            modes.append(Mode("predictor", predictors=own))
        self.by_name = {f"ours {label}{m.name}": m for m in modes}
        self.modes = list(self.by_name)

    def run(self, mode: str, prompt: list[int], tg: int) -> dict:
        from coordinator.tools.bench import timed_run, weight_bytes_per_token

        m = self.by_name[mode]
        m.apply(self.eng)
        r = timed_run(self.eng, prompt, tg)
        # weights a decoded token reads, as the kernels read them (each process its share once)
        read = weight_bytes_per_token(self.eng, m, r.active_fraction, r.twin_read)
        return dict(prefill_s=r.prefill_s, decode_s=r.decode_s, ids=r.ids,
                    active_fraction=r.active_fraction, sync_us=r.sync_us, weight_bytes_read=read)

    def close(self):
        self.eng.close()


def bandwidth_child(threads: int) -> float:
    sys.path.insert(0, str(REPO))
    from coordinator.tools.bench import read_bandwidth_gbs
    return read_bandwidth_gbs(threads)


def serve(kind: str, cfg: dict) -> None:
    """A child's whole life: load, say ready, run what the parent asks, quit."""
    ch = _Channel()
    try:
        if kind == "bandwidth":
            ch.send(ok=True, gb_s=bandwidth_child(cfg["threads"]))
            return
        side = LlamaCppSide(**cfg) if kind == "llamacpp" else OursSide(**cfg)
    except Exception as e:
        ch.send(ok=False, error=f"{type(e).__name__}: {e}")
        raise
    ch.send(ok=True, modes=side.modes)
    try:
        for cmd in ch.commands():
            if cmd["op"] == "quit":
                break
            try:
                read0 = tree_read_bytes(os.getpid())
                reply = side.run(cmd["mode"], cmd["prompt"], cmd["tg"])
                reply["disk_read_bytes"] = tree_read_bytes(os.getpid()) - read0  # this tree's, from the disk
            except Exception as e:  # the parent names the side and the error, then stops
                ch.send(ok=False, error=f"{cmd['mode']}: {type(e).__name__}: {e}")
                raise
            ch.send(ok=True, **reply)
    finally:
        side.close()
        ch.send(ok=True, closed=True)


# ---- the parent: processes, memory, interleaving ---------------------------------------------

class Child:
    """A benchmarked process, driven over its stdin/stdout."""

    def __init__(self, kind: str, cfg: dict, timeout_s: float = 900, env: dict | None = None,
                 limit: MemoryLimit | None = None):
        self.kind, self.limit = kind, limit
        self.t_spawn = time.perf_counter()
        self.proc = subprocess.Popen([sys.executable, str(Path(__file__).resolve()), "--serve", kind,
                                      json.dumps(cfg)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     env={**clean_env(), **(env or {})}, text=True, cwd=str(REPO),
                                     preexec_fn=limit.join if limit else None)
        try:
            hello = self._read()
        except BaseException:  # it failed to load: gone before its caller cleans up after it
            self.proc.kill()
            self.proc.wait()
            raise
        self.load_s = time.perf_counter() - self.t_spawn
        self.hello = hello
        self.modes = hello.get("modes", [])
        self.first_prefill_s = None

    def _read(self) -> dict:
        while True:
            line = self.proc.stdout.readline()
            if not line:
                rc = self.proc.wait()
                raise RuntimeError(f"{self.kind} process ended (exit code {rc}) without answering")
            if line.startswith(REPLY):
                msg = json.loads(line[len(REPLY):])
                if not msg.get("ok"):
                    raise RuntimeError(f"{self.kind} process: {msg.get('error')}")
                return msg

    def run(self, mode: str, prompt: list[int], tg: int) -> dict:
        self.proc.stdin.write(json.dumps(dict(op="run", mode=mode, prompt=prompt, tg=tg)) + "\n")
        self.proc.stdin.flush()
        r = self._read()
        if self.first_prefill_s is None:
            self.first_prefill_s = r["prefill_s"]
        return r

    def memory(self) -> dict:
        return tree_memory(self.proc.pid)

    def close(self):
        if self.proc.poll() is None:
            try:
                self.proc.stdin.write(json.dumps(dict(op="quit")) + "\n")
                self.proc.stdin.flush()
                self.proc.wait(timeout=120)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait()


def measure_bandwidth(threads: int) -> float | None:
    try:
        c = Child("bandwidth", dict(threads=threads))
    except RuntimeError as e:
        print(f"read bandwidth: unavailable ({e})", file=sys.stderr)
        return None
    c.proc.wait()
    return c.hello["gb_s"]


def prompt_ids(model: Path, pp: int) -> list[int]:
    """pp tokens of English text from pydoc topics, by our GGUF tokenizer (tested to match
    transformers'), so the benchmark needs no transformers. (Imports no torch.)"""
    sys.path.insert(0, str(REPO))
    sys.path.insert(0, str(REPO / "scripts"))
    from compare_llamacpp import heldout_chunks
    from coordinator.text.tokenizer import GGUFTokenizer
    from sparsecore.gguf_file import open_gguf

    tok = GGUFTokenizer.from_reader(open_gguf(model))

    class _NoSpecials:  # heldout_chunks calls encode(text, add_special_tokens=False)
        def encode(self, text, add_special_tokens=False):
            return tok.encode(text, add_bos=add_special_tokens, add_eos=False)

    return heldout_chunks(_NoSpecials(), 1, pp)[0]


def timed(children: list[Child], c: Child, m: str, prompt, tg: int) -> dict:
    """One run of `m` on `c`, with what else used the cores meanwhile: `idle_sides_cores`, the
    cores the other benchmarked processes (which should be idle) used, and `other_cores`, the
    cores anything but `c` used (those, plus every other program on the machine)."""
    cpu0 = {x: tree_cpu_s(x.proc.pid) for x in children}
    busy0, t0 = machine_busy_s(), time.perf_counter()
    r = c.run(m, prompt, tg)
    wall = time.perf_counter() - t0
    busy = machine_busy_s() - busy0
    cpu = {x: tree_cpu_s(x.proc.pid) - cpu0[x] for x in children}
    r["idle_sides_cores"] = sum(v for x, v in cpu.items() if x is not c) / wall
    r["other_cores"] = max(0.0, busy - cpu[c]) / wall
    return r


def bench(children: list[Child], prompt, tg: int, reps: int, warmup: int,
          max_other_cores: float | None = None, retries: int = 3) -> dict:
    """Every (child, mode) pair `warmup` times, then `reps` interleaved rounds, order flipping.
    A timed run during which other work used more than `max_other_cores` cores is thrown away
    and run again (up to `retries` times, after a pause), so a shared machine's bursts of
    load do not land in one side's numbers only."""
    runners = [(c, m) for c in children for m in c.modes]
    for c, m in runners:
        for _ in range(warmup):
            c.run(m, prompt, tg)
    runs = {m: [] for _, m in runners}
    for rep in range(reps):
        for c, m in (runners if rep % 2 == 0 else runners[::-1]):
            r = timed(children, c, m, prompt, tg)
            tries = 0
            while max_other_cores is not None and r["other_cores"] > max_other_cores and tries < retries:
                tries += 1
                print(f"  {m}: {r['other_cores']:.2f} cores busy with other work during the run; "
                      f"running it again ({tries}/{retries})", file=sys.stderr, flush=True)
                time.sleep(5)
                r = timed(children, c, m, prompt, tg)
            r["retries"] = tries
            runs[m].append(r)
    return runs


def touched_bytes(model: Path) -> int:
    """Bytes of the tensors one dense decoded token touches, from the file itself: every tensor
    but the embedding table (one row of it; all of it where it is also the lm_head) and
    PowerInfer's predictors; of routed experts (ffn_*_exps) the k a token uses."""
    from sparsecore.config import read_config
    from sparsecore.gguf_file import open_gguf, tensor_nbytes

    reader = open_gguf(model, vocabulary=False)
    cfg, ts = read_config(model, reader), {t.name: t for t in reader.tensors}
    emb, k = ts.get("token_embd.weight"), cfg.n_experts_used / cfg.n_experts if cfg.routed else 1.0
    total = sum(int(tensor_nbytes(t) * (k if n.endswith("_exps.weight") else 1.0)) for n, t in ts.items()
                if n != "token_embd.weight" and not n.endswith(("fc1.weight", "fc2.weight")))
    if emb is not None:
        rows = int(emb.shape[1])
        total += tensor_nbytes(emb) if "output.weight" not in ts else tensor_nbytes(emb) // rows
    return total


def summarize(runs, pp: int, tg: int) -> dict:
    out = {}
    for name, rs in runs.items():
        pre = statistics.median(r["prefill_s"] for r in rs)
        dec = statistics.median(r["decode_s"] for r in rs)
        out[name] = dict(prefill_s=pre, decode_s=dec, pp_tok_s=pp / pre, tg_tok_s=(tg - 1) / dec,
                         ids=rs[-1]["ids"], all_prefill_s=[r["prefill_s"] for r in rs],
                         all_decode_s=[r["decode_s"] for r in rs])
        out[name]["other_cores"] = max(r["other_cores"] for r in rs)
        out[name]["retries"] = sum(r["retries"] for r in rs)
        out[name]["idle_sides_cores"] = max(r["idle_sides_cores"] for r in rs)
        out[name]["disk_read_bytes"] = statistics.median(r.get("disk_read_bytes", 0) for r in rs)
        if "active_fraction" in rs[-1]:
            out[name]["active_fraction"] = statistics.median(r["active_fraction"] for r in rs)
        if "weight_bytes_read" in rs[-1]:
            out[name]["weight_bytes_read"] = statistics.median(r["weight_bytes_read"] for r in rs)
        sync = [u for r in rs for u in r.get("sync_us", [])]
        if sync:
            sync.sort()
            p99 = sync[min(len(sync) - 1, int(0.99 * len(sync)))]
            out[name]["sync_us"] = dict(median=statistics.median(sync), p99=p99, n=len(sync))
    return out


def level_envs(isa: str | None, only: str | None) -> tuple[dict, dict, str]:
    """The environments that put each side at `isa` (None: this CPU's best), and a line naming
    the CPU and the levels both sides ran at."""
    if isa is None:
        import sparsecore.kernels as K  # noqa: E402  (after BASE_ENV: children start clean)
        return {}, {}, f"CPU {cpu_name()}: both sides at this CPU's best level (our kernels: {K.isa()})"
    build = REPO / ".bench" / f"llama-cpp-{isa}"
    if only != "ours" and not (build / "llama_cpp").is_dir():
        raise SystemExit(f"{build} has no llama.cpp build: run scripts/setup-bench --isa {isa}")
    ours = {"SPARSEINFER_ISA": {"avx2": "avx2", "avx-vnni": "avxvnni"}[isa]}
    path = os.pathsep.join(p for p in (str(build), BASE_ENV.get("PYTHONPATH", "")) if p)
    return ours, {"PYTHONPATH": path}, (f"CPU {cpu_name()}: both sides capped at {isa} (ours SPARSEINFER_ISA="
                                        f"{ours['SPARSEINFER_ISA']}, llama.cpp built by setup-bench --isa {isa})")


def limited(specs, args, prompt, max_other):
    """Each side alone in a cgroup of --mem-limit MB, the page cache dropped before it starts:
    load, warm up, its timed runs, its memory; then the next side. Returns bench()'s pieces."""
    children, runs, mem = [], {}, {}
    busy_before = busy_cores()
    for i, (kind, cfg, env) in enumerate(specs):
        drop_caches()
        limit = MemoryLimit(f"sparseinfer-bench-{os.getpid()}-{i}", args.mem_limit << 20)
        try:
            try:
                c = Child(kind, cfg, env=env, limit=limit)
            except RuntimeError as e:  # a side that refuses (or dies) under the limit is a result too
                print(f"{kind} under {args.mem_limit} MB: {e}", flush=True)
                continue
            try:
                runs.update(bench([c], prompt, args.tg, args.reps, args.warmup, max_other))
                mem[c] = {**c.memory(), "cgroup_peak": limit.peak()}
            finally:
                c.close()
            mem[c]["oom_kills"] = limit.oom_kills()
            children.append(c)
        finally:
            limit.remove()
    return children, runs, mem, busy_before, busy_cores()


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path, default=DEFAULT_MODEL)
    ap.add_argument("--llama-model", type=Path,
                    help="the file llama.cpp runs (default --model; give the dense file for a PWRI --model)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--cpu-workers", type=int, default=1, help="our engine's CPU workers")
    ap.add_argument("--pp", type=int, default=128, help="prompt tokens")
    ap.add_argument("--tg", type=int, default=64, help="generated tokens")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--sparsity", type=float, nargs="*", default=[],
                    help="our sparse levels to run beside dense (calibrated thresholds, e.g. --sparsity 0.5 0.7; default: dense only)")
    ap.add_argument("--sparse-method", choices=["input", "cats"], default="input",
                    help="how our sparse levels skip weights (EngineOptions.sparse_method)")
    ap.add_argument("--weights", nargs="+", default=[DEFAULT_WEIGHTS], choices=[*WEIGHT_FORMATS, "gguf-fast"],
                    help="our weight formats, one engine process each (gguf-fast: the engine's default, the "
                         "file's blocks with 8-bit activations; gguf: exact arithmetic; f32: float32 copies; "
                         "f16: half the bytes)")
    ap.add_argument("--only", choices=["llamacpp", "ours"], help="benchmark one side only")
    ap.add_argument("--max-other-cores", type=float, default=0.25,
                    help="redo a timed run (up to 3 times) if other work used more cores than this "
                         "meanwhile (negative: never)")
    ap.add_argument("--no-bandwidth", action="store_true", help="skip the read bandwidth measurement")
    ap.add_argument("--isa", choices=["avx2", "avx-vnni"],
                    help="both sides at this x86 level: ours capped there, llama.cpp from .bench/llama-cpp-ISA "
                         "(scripts/setup-bench --isa ISA)")
    ap.add_argument("--llamacpp-repack", choices=("on", "off"), default="on",
                    help="off: llama.cpp keeps its weights as the file's mapped pages only (its --no-repack: "
                         "no repacked copies in anonymous memory, which a memory limit may not hold)")
    ap.add_argument("--mem-limit", type=int, metavar="MB",
                    help="each side alone under a memory limit of MB (a cgroup made for it, the page cache "
                         "dropped first; root): the sides then run one after the other, not interleaved")
    ap.add_argument("--json", type=Path, help="write the results here")
    ap.add_argument("--serve", nargs=2, metavar=("KIND", "CONFIG"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.serve:
        return serve(args.serve[0], json.loads(args.serve[1]))
    if args.tg < 2:
        ap.error("--tg must be at least 2")
    llama_model = args.llama_model or args.model
    if args.only != "ours":
        with open(llama_model, "rb") as f:
            if f.read(4) == b"PWRI":
                ap.error(f"{llama_model} is a PowerInfer (PWRI) file llama.cpp cannot load: "
                         "pass the dense file of the same shape with --llama-model")

    ours_env, llama_env, level = level_envs(args.isa, args.only)
    prompt = prompt_ids(args.model, args.pp)
    n_ctx = args.pp + args.tg + 16
    specs = []  # (kind, config, environment) of each benchmarked process
    if args.only != "ours":
        specs.append(("llamacpp", dict(model=str(llama_model), threads=args.threads, n_ctx=n_ctx,
                                       n_batch=max(args.pp, 512), repack=args.llamacpp_repack == "on"), llama_env))
    if args.only != "llamacpp":
        for w in args.weights:
            label = "" if args.weights == [DEFAULT_WEIGHTS] else f"{w} "
            # fast mode: dense decoding in an engine of its own (interleaved rows), the sparse
            # levels and predictors in another (the file's rows)
            split = [([], True), (args.sparsity, False)] if w == "gguf-fast" and args.sparsity else \
                [(args.sparsity, True)]
            for levels, dense in split:
                specs.append(("ours", dict(model=str(args.model), threads=args.threads, n_ctx=n_ctx, weights=w,
                                           cpu_workers=args.cpu_workers, sparsity=levels, label=label, dense=dense,
                                           sparse_method=args.sparse_method), ours_env))
    max_other = None if args.max_other_cores < 0 else args.max_other_cores
    if args.mem_limit:
        children, runs, mem, busy_before, busy_after = limited(specs, args, prompt, max_other)
    else:
        children: list[Child] = []
        try:
            for kind, cfg, env in specs:  # loaded one at a time, so no load is slowed down by another
                children.append(Child(kind, cfg, env=env))
            busy_before = busy_cores()  # everything loaded and idle: should be ~0
            runs = bench(children, prompt, args.tg, args.reps, args.warmup, max_other)
            busy_after = busy_cores()
            mem = {c: c.memory() for c in children}
        finally:
            for c in children:
                c.close()
    if not runs:
        print(f"no side ran under {args.mem_limit} MB")
        return 1
    gb_s = None if args.no_bandwidth else measure_bandwidth(args.threads)

    res = summarize(runs, args.pp, args.tg)
    for c in children:
        for m in c.modes:
            res[m].update(load_s=c.load_s, ttft_cold_s=c.load_s + (c.first_prefill_s or 0.0),
                          peak_rss_bytes=mem[c]["peak_rss"], pss_bytes=mem[c]["pss"],
                          processes=mem[c]["processes"])
            if args.mem_limit:
                res[m].update(cgroup_peak_bytes=mem[c]["cgroup_peak"], oom_kills=mem[c]["oom_kills"])
    busy = [None if b is None else round(b, 2) for b in (busy_before, busy_after)]
    print(f"model {args.model} ({args.model.stat().st_size / 1e9:.3f} GB)"
          + (f"; llama.cpp runs {llama_model}" if llama_model != args.model else ""))
    print(level)
    print(f"threads={args.threads} pp={args.pp} tg={args.tg} reps={args.reps} (medians), each side in a "
          f"clean process of its own; cores busy with other work before/after: {busy}")
    spare = (os.cpu_count() or 1) - args.threads
    other = max(r["other_cores"] for r in res.values())
    idle = max(r["idle_sides_cores"] for r in res.values())
    print(f"during the timed runs, at worst: {other:.2f} cores used by anything but the side being "
          f"timed, {idle:.2f} of them by the other (idle) benchmarked processes")
    if other > spare + 0.25:
        print("WARNING: other processes were using the cores during timed runs; llama.cpp's OpenMP "
              "threads suffer most from that, so these numbers and the ratio are unreliable "
              "(per-side worst case in the 'other cores' column)")
    head = (f"| {'':22s} | {'pp tok/s':>8s} | {'tg tok/s':>8s} | {'prefill s':>9s} | {'decode s':>8s} | "
            f"{'load s':>6s} | {'TTFT s':>6s} | {'peak RSS GB':>11s} | {'PSS GB':>6s} | {'procs':>5s} | "
            f"{'other cores':>11s} |")
    print(head)
    print("|" + "|".join("-" * len(c) for c in head.split("|")[1:-1]) + "|")
    for name, r in res.items():
        print(f"| {name:22s} | {r['pp_tok_s']:8.1f} | {r['tg_tok_s']:8.2f} | {r['prefill_s']:9.3f} | "
              f"{r['decode_s']:8.3f} | {r['load_s']:6.2f} | {r['ttft_cold_s']:6.2f} | "
              f"{r['peak_rss_bytes'] / 1e9:11.3f} | {r['pss_bytes'] / 1e9:6.3f} | {r['processes']:5d} | "
              f"{r['other_cores']:11.2f} |")
    print("TTFT = process start to the first token of the pp-token prompt (load + first prefill); "
          "peak RSS = sum of VmHWM over the process and its descendants; PSS summed at the end; "
          "other cores = the worst run's cores used by anything else meanwhile")
    if gb_s is not None:
        print(f"machine read bandwidth ({args.threads} threads, clean process): {gb_s:.1f} GB/s")
    if args.mem_limit:
        print(f"each side alone under {args.mem_limit} MB (a cgroup of its own, page cache dropped first):")
        for name, r in res.items():
            print(f"{name}: {r['disk_read_bytes'] / 1e6:.1f} MB read from disk a run ({r['disk_read_bytes'] / args.tg / 1e6:.2f}"
                  f" MB a generated token), the group's peak {r['cgroup_peak_bytes'] / 1e6:.0f} MB (page cache "
                  f"included), OOM kills {r['oom_kills']}")
    touched = {"ours": touched_bytes(args.model), "llama.cpp": touched_bytes(llama_model)}
    for name, r in res.items():
        side = "llama.cpp" if name == "llama.cpp" else "ours"
        read = r.get("weight_bytes_read", touched[side])  # llama.cpp: what its file's token touches
        r["weight_bytes_touched"] = touched[side]
        extra = (f" = {read / touched[side]:.3f}x the {touched[side] / 1e6:.1f} MB of tensors a dense token touches"
                 if "weight_bytes_read" in r else " (the tensors a dense token touches)")
        print(f"{name}: {read / 1e6:.1f} MB of weights read per decoded token{extra}; at its tg "
              f"{read * r['tg_tok_s'] / 1e9:.1f} GB/s" + (f" of the machine's {gb_s:.1f}" if gb_s else ""))
    result = dict(model=str(args.model), llama_model=str(llama_model),
                  model_bytes=args.model.stat().st_size,
                  threads=args.threads, pp=args.pp, tg=args.tg, reps=args.reps, cpu_workers=args.cpu_workers,
                  weights=args.weights, isa=args.isa, level=level, busy_cores_other=busy, cpu_count=os.cpu_count(),
                  mem_limit_mb=args.mem_limit,
                  read_bandwidth_gb_s=gb_s, results=res)
    if "llama.cpp" in res:
        base = res["llama.cpp"]
        result["ratio_ours_over_llamacpp"] = {}
        for name, o in res.items():
            if name == "llama.cpp":
                continue
            ratio = dict(pp=o["pp_tok_s"] / base["pp_tok_s"], tg=o["tg_tok_s"] / base["tg_tok_s"],
                         ttft_cold=o["ttft_cold_s"] / base["ttft_cold_s"],
                         peak_rss=o["peak_rss_bytes"] / max(1, base["peak_rss_bytes"]),
                         pss=o["pss_bytes"] / max(1, base["pss_bytes"]))
            result["ratio_ours_over_llamacpp"][name] = ratio
            same = next((i for i, (a, b) in enumerate(zip(o["ids"], base["ids"])) if a != b), len(o["ids"]))
            extra = f", {100 * o['active_fraction']:.1f}% of FFN neurons computed" if "active_fraction" in o else ""
            print(f"{name}/llama.cpp: pp {ratio['pp']:.3f}x, tg {ratio['tg']:.3f}x, cold TTFT "
                  f"{ratio['ttft_cold']:.2f}x, peak RSS {ratio['peak_rss']:.2f}x (a page mapped by n processes "
                  f"counted n times), PSS {ratio['pss']:.2f}x (once); greedy ids agree for the "
                  f"first {same} of {len(o['ids'])} tokens{extra}")
    for name, r in res.items():
        if "sync_us" in r:
            s = r["sync_us"]
            print(f"{name}: per-layer sync overhead while decoding: median {s['median']:.1f} us, "
                  f"p99 {s['p99']:.1f} us over {s['n']} exchanges")
    if args.json:
        args.json.write_text(json.dumps(result, indent=1) + "\n")
        print(f"wrote {args.json}")


if __name__ == "__main__":
    sys.exit(main())
