"""`sparseinfer bench`: prompt processing and generation speed, dense and sparse, in one run.

Like llama-bench: ppN = evaluating an N-token prompt (prefill, always the dense path), tgN =
generating N tokens one forward at a time. Both modes run on the same engine and processes,
alternating rep by rep (the order flips every rep) so machine noise hits both alike; every
figure is a median over reps. Per decoded token it also reports the FFN time (the per-layer
worker exchanges, what the coordinator waits for), the per-layer synchronization overhead
(exchange time minus the slowest worker's compute), the weight bytes read, and the bandwidth
that implies next to the machine's own, measured here by a large reduction.
"""
from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field

import numpy as np


from . import observe


@dataclass
class Mode:
    """How FFN neurons are chosen while decoding: dense, CATS thresholds, or predictors."""
    name: str
    sparsity: float | None = None
    predictors: object | None = None

    def apply(self, engine) -> None:
        observe.set_sparsity_source(engine, self.sparsity, self.predictors)


@dataclass
class RunResult:
    prefill_s: float
    decode_s: float
    decode_tokens: int
    ids: list[int]
    ffn_us_per_token: float  # sum over layers of the exchange wall time, per decoded token
    sync_us: list[float] = field(default_factory=list)  # per-layer overheads while decoding
    active_fraction: float = 1.0  # FFN neurons computed per decoded token / n_ff
    twin_read: float = 1.0  # input sparsity: the share of the twinned matrices' bytes a decoded token read


def timed_run(engine, prompt: list[int], tg: int) -> RunResult:
    """Prefill `prompt`, then greedily decode until `tg` tokens exist (EOS does not stop it)."""
    t0 = time.perf_counter()
    it = observe.greedy(engine, prompt, tg)
    ids = [next(it)]
    t1 = time.perf_counter()
    meter = observe.FfnMeter(engine)
    observe.twin_counts(engine)  # zeroed: what the decoded tokens read
    ids += list(it)
    t2 = time.perf_counter()
    n_dec = len(ids) - 1
    read, held = observe.twin_counts(engine, n_dec)
    return RunResult(t1 - t0, t2 - t1, n_dec, ids, sum(meter.round_trip_us()) / max(1, n_dec),
                     meter.overhead_us(), meter.active_fraction(), read / max(1, held * n_dec) if held else 1.0)


def weight_bytes_per_token(engine, mode: Mode, active_fraction: float, twin_read: float = 1.0) -> float:
    """Weights a decoded token reads, as the kernels read them (each process its share once):
    the coordinator's (attention, norms, lm_head, an embedding row) and the FFN's; with input
    sparsity, the twinned matrices (attention and FFN) at the share of their bytes the twins read."""
    coord = observe.coordinator_bytes_per_token(engine)
    if mode.sparsity is not None and observe.sparse_method(engine) == "input":  # the FFN's rows as dense, less
        return coord + ffn_bytes_per_token(engine, Mode("dense"), 1.0) - observe.twinned_bytes(engine) * (1 - twin_read)
    return coord + ffn_bytes_per_token(engine, mode, active_fraction)


def ffn_bytes_per_token(engine, mode: Mode, active_fraction: float) -> float:
    """FFN weights the workers read per decoded token. Dense and predictor steps read the
    gate, up and down rows of computed neurons; threshold steps must read every gate row to
    decide, then up and down rows of the active ones. Predictors add their own fc1/fc2."""
    cfg = observe.config(engine)
    per_neuron = observe.ffn_neuron_bytes(engine)
    row = per_neuron / 3
    n = cfg.n_ff * cfg.n_layers * (cfg.n_experts_used if cfg.routed else 1)  # routed: the k experts' neurons
    if mode.sparsity is not None:
        return n * (row + 2 * row * active_fraction)
    b = n * per_neuron * active_fraction
    if mode.predictors is not None:
        p = mode.predictors
        b += sum(t.nbytes for t in p.fc2) + observe.fc1_readers(engine, p) * sum(t.nbytes for t in p.fc1)
    return b


def read_bandwidth_gbs(threads: int, mib: int = 512, reps: int = 5) -> float:
    """The machine's memory read bandwidth as torch sees it: GB/s summing a `mib` MiB array
    (far larger than any cache) with `threads` threads, best of `reps`. (torch imported here
    only: a benchmarked engine's process otherwise holds what `generate` holds.)"""
    import torch

    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        a = torch.ones(mib * (1 << 20) // 4)
        float(a.sum())  # fault the pages in
        best = float("inf")
        for _ in range(reps):
            t0 = time.perf_counter()
            float(a.sum())
            best = min(best, time.perf_counter() - t0)
        return a.numel() * 4 / best / 1e9
    finally:
        torch.set_num_threads(old)


def _p99(xs: list[float]) -> float:
    return float(np.percentile(xs, 99)) if xs else float("nan")


def bench(engine, prompt: list[int], tg: int, modes: list[Mode], reps: int = 3, warmup: int = 1,
          progress=None) -> dict:
    """Run every mode `reps` times, interleaved; return a JSON-ready summary."""
    runs: dict[str, list[RunResult]] = {m.name: [] for m in modes}
    try:
        for m in modes:
            m.apply(engine)
            for _ in range(warmup):
                timed_run(engine, prompt, tg)
        for rep in range(reps):
            for m in (modes if rep % 2 == 0 else modes[::-1]):
                m.apply(engine)
                runs[m.name].append(timed_run(engine, prompt, tg))
                if progress:
                    progress(1)
    finally:
        modes[0].apply(engine)
    out = {}
    for m in modes:
        rs = runs[m.name]
        med = lambda f: statistics.median(f(r) for r in rs)
        sync = [u for r in rs for u in r.sync_us]
        active = med(lambda r: r.active_fraction)
        tg_tok_s = med(lambda r: r.decode_tokens / r.decode_s)
        weights = weight_bytes_per_token(engine, m, active, med(lambda r: r.twin_read))
        out[m.name] = dict(
            pp_tok_s=med(lambda r: len(prompt) / r.prefill_s), tg_tok_s=tg_tok_s,
            ffn_ms_per_token=med(lambda r: r.ffn_us_per_token) / 1e3,
            sync_us_median=statistics.median(sync) if sync else float("nan"), sync_us_p99=_p99(sync),
            sync_exchanges=len(sync), active_fraction=active,
            weight_mb_per_token=weights / 1e6, achieved_gb_s=weights * tg_tok_s / 1e9,
            ids=rs[-1].ids)
    return out


def ratios(results: dict, base: str) -> dict:
    """Each mode against `base`: speed ratios (>1 = faster) and FFN time ratio (<1 = less time;
    None where either mode timed no FFN exchange: decoding in lockstep has none, its layers' FFN
    runs inside one whole-token step)."""
    b = results[base]
    return {name: dict(pp=r["pp_tok_s"] / b["pp_tok_s"], tg=r["tg_tok_s"] / b["tg_tok_s"],
                       ffn_time=r["ffn_ms_per_token"] / b["ffn_ms_per_token"]
                       if r["ffn_ms_per_token"] > 0 and b["ffn_ms_per_token"] > 0 else None)
            for name, r in results.items() if name != base}


def _ms(v: float) -> str:
    return f"{v:.2f}" if v > 0 else "-"  # 0: no exchange timed (lockstep)


def format_table(results: dict, pp: int, tg: int) -> str:
    head = (f"| {'mode':14s} | {'test':6s} | {'tok/s':>8s} | {'FFN ms/tok':>10s} | {'sync us med':>11s} | "
            f"{'p99':>7s} | {'active':>6s} | {'MB/tok':>7s} | {'GB/s':>5s} |")
    lines = [head, "|" + "|".join("-" * (len(c) + 0) for c in head.split("|")[1:-1]) + "|"]
    for name, r in results.items():
        lines.append(f"| {name:14s} | {'pp' + str(pp):6s} | {r['pp_tok_s']:8.1f} | {'':>10s} | {'':>11s} | "
                     f"{'':>7s} | {'':>6s} | {'':>7s} | {'':>5s} |")
        lines.append(f"| {name:14s} | {'tg' + str(tg):6s} | {r['tg_tok_s']:8.1f} | {_ms(r['ffn_ms_per_token']):>10s} | "
                     f"{r['sync_us_median']:11.1f} | {r['sync_us_p99']:7.1f} | {100 * r['active_fraction']:5.1f}% | "
                     f"{r['weight_mb_per_token']:7.1f} | {r['achieved_gb_s']:5.2f} |")
    return "\n".join(lines)
