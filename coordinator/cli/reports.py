"""What the commands print once their work is done, as lines: generate's speed figures, info's
configuration, memory plan and placement, calibrate's levels, perplexity, profile,
train-predictor's held-out table and bench's summary. No click and no engine here: the
commands echo what these return."""
from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

import numpy as np

MIB = 1 << 20


def generate_stats(s: dict) -> str:
    """generate's line of speed figures (Engine.stats)."""
    tps = s["decode_tokens"] / s["decode_s"] if s["decode_s"] else float("nan")
    pps = s["prompt_tokens"] / s["prefill_s"] if s["prefill_s"] else float("nan")
    # per-layer exchanges' overhead; a run decoded in lockstep (every layer in one post) has none
    sync = f" | sync median {np.median(s['sync_us']):.0f} us/layer" if s["sync_us"] else ""
    if s.get("spec") is not None and s["spec"].steps:  # speculative decoding's acceptance and tokens per step
        sync += f" | {s['spec'].line()}"
    return (f"[prompt {s['prompt_tokens']} tok, {pps:.1f} tok/s | decode {s['decode_tokens']} tok, "
            f"{tps:.2f} tok/s{sync}{routed_part(s.get('routed'))} | "
            f"{s['weights']} FFN weights {(sum(s['worker_weight_bytes']) + s['coordinator_ffn_bytes']) / 1e6:.0f} MB]")


def routed_part(routed: dict | None) -> str:
    """generate's words on a routed run under --vram-budget: the share of the routed (token,
    expert) choices the GPU worker computed, beside what placement predicted (info --vram-budget)."""
    if not routed or routed.get("predicted_share") is None or not routed["routes"]:
        return ""
    gpu = next((p for p in routed["processes"] if p["role"] == "gpu"), None)
    if gpu is None:
        return ""
    return (f" | GPU worker {100 * gpu['share']:.1f}% of {routed['routes']} routed choices "
            f"(predicted {100 * routed['predicted_share']:.1f}%)")


# ---- info ---------------------------------------------------------------------------------------

def info_json(cfg, types: dict, memory, plan: dict | None, dealers: int = 0) -> str:
    out = {"config": asdict(cfg), "tensor_types": dict(types), "experts_dealt_between": dealers,
           "memory": {**{k: b for k, b, _ in memory.rows()}, "total": memory.total, "must_fit": memory.anonymous,
                      "available": memory.available, "available_from": memory.available_from,
                      "processes": memory.processes, "cold": memory.cold}}
    if plan is not None:
        out["plan"] = plan
    return json.dumps(out, indent=2)


def info_lines(cfg, types: dict, memory, ctx, parallel, dealers: int = 0) -> list[str]:
    """The model's configuration, its tensor types, how a routed model's experts are split
    (`dealers`: the processes that deal them, 0 none) and the memory plan against what is free."""
    lines = [f"{k:18s} {v}" for k, v in asdict(cfg).items()]
    lines.append("tensor types       " + ", ".join(f"{k}: {v}" for k, v in types.items()))
    if cfg.routed:
        lines.append("experts            " + (
            f"dealt between {dealers} processes: each computes about {cfg.n_experts_used / dealers:g} of a token's "
            f"{cfg.n_experts_used} chosen experts whole" if dealers else
            "each process computes a range of every chosen expert's neurons"))
    lines.append(f"\nmemory plan (--ctx {ctx}, {memory.processes} processes"
                 f"{f', serve --parallel {parallel}' if parallel else ''}):")
    lines += ["  " + line for line in memory.lines()]
    fits = memory.available is None or memory.anonymous <= memory.available
    lines.append("  " + ("fits" if fits else f"fits with {memory.cold / 1e9:.2f} GB read from disk as tokens need it"
                         if memory.cold and memory.must_stay <= memory.available
                         else "does NOT fit: a run would be refused"))
    return lines


def placement_lines(plan: dict, vram_budget_gb: float) -> list[str]:
    """The placement for --vram-budget: GPU neurons, coverage, per layer and per worker."""
    total = plan["n_layers"] * plan["n_ff"]
    gpu = plan["workers"][0]
    lines = [f"\nplacement for --vram-budget {vram_budget_gb:g} GiB ({plan['vram_budget_bytes']} bytes; "
             f"{plan['neuron_bytes']} bytes per neuron as {plan['weights']} gate row + up row + down column; "
             f"GPU index: {plan['source']})",
             f"GPU neurons        {gpu['neurons']} of {total} ({100 * gpu['neurons'] / max(1, total):.1f}%)",
             f"expected coverage  {100 * plan['coverage']:.1f}% of expected activations on the GPU worker",
             "layer  gpu neurons  hot share  coverage"]
    for l in plan["layers"]:
        lines.append(f"{l['layer']:5d}  {l['gpu_neurons']:11d}  {100 * l['hot_share']:8.1f}%  "
                     f"{100 * l['coverage']:7.1f}%")
    lines.append("worker            neurons        MiB  expected activations/token  share")
    for w in plan["workers"]:
        name = f"{w['role']} worker {w['worker_id']}"
        lines.append(f"{name:16s} {w['neurons']:8d} {w['bytes'] / MIB:10.2f}  "
                     f"{w['expected_activations_per_token']:26.1f}  {100 * w['activation_share']:5.1f}%")
    return lines


def expert_placement_lines(plan: dict, vram_budget_gb: float) -> list[str]:
    """A routed model's placement for --vram-budget: the most-routed experts, whole, and the
    share of routed work the profile says they take."""
    total = len(plan["layers"])
    lines = [f"\nexpert placement for --vram-budget {vram_budget_gb:g} GiB ({plan['vram_budget_bytes']} bytes; "
             f"{plan['expert_bytes']} bytes per expert "
             f"{'as float copies on CUDA' if plan.get('device') == 'cuda' else 'on the CPU'}; profile of "
             f"{plan['profile_tokens']} tokens)",
             f"experts placed     {plan['placed']} ({total} layers)",
             f"predicted share    {100 * plan['predicted_share']:.1f}% of the routed work on the GPU worker",
             "layer  experts  share of the layer's routes"]
    for i, (n, share) in enumerate(plan["layers"]):
        lines.append(f"{i:5d}  {n:7d}  {100 * share:6.1f}%")
    return lines


# ---- sparsity: calibrate, perplexity, profile, train-predictor ---------------------------------

def calibration_lines(path, table: dict) -> list[str]:
    lines = [f"wrote {path} ({table['tokens']} calibration tokens, levels {', '.join(table['levels'])})"]
    q = table.get("quality")
    if q:
        method = "CATS" if q.get("method") == "cats" else "input sparsity"
        lines.append(f"held-out perplexity over {q['tokens']} tokens: dense {q['dense']:.3f}; {method} "
                     + ", ".join(f"{k} {v['ppl']:.3f} ({100 * (v['ppl'] / q['dense'] - 1):+.1f} %)"
                                 for k, v in sorted(q["levels"].items())))
    return lines


def speed_line(sp: dict) -> str:
    return (f"decode on this machine ({sp['cpu']}, {sp['isa']}): dense {sp['dense_tok_s']:.1f} tok/s; "
            + ", ".join(f"{k} {v:.2f}x" for k, v in sp["levels"].items()))


def perplexity_line(r: dict, sparsity, pred, weights: str, arith: str, n_chunks: int, chunk_len: int) -> str:
    mode = ("dense" if sparsity is None else f"sparsity {sparsity:.2f}") if pred is None else f"predictor {pred.path}"
    arith = f" ({arith} arithmetic)" if weights == "gguf" else ""
    return (f"{mode}, {weights} weights{arith}: perplexity {r['ppl']:.4f} over {r['tokens']} tokens "
            f"({n_chunks} x {chunk_len}), {r['unit']} {100 * r['active_fraction']:.1f}%")


def profile_written(prof, npz, png) -> str:
    mean = float(np.mean(np.concatenate(prof.freqs)))
    what = "routing" if prof.meta.get("unit") == "expert" else "activation"
    return f"wrote {npz} and {png} ({prof.meta.get('tokens', '?')} tokens, mean {what} frequency {mean:.3f})"


def predictor_lines(p, out, rank: int, dtype: str, relu: bool, sparsity: float, data_s: float,
                    train_s: float) -> list[str]:
    """train-predictor's held-out recall and precision per layer, and what it wrote."""
    lines = [f"held-out ({p.info['heldout_tokens']} tokens; trained on {p.info['train_tokens']}, "
             f"threshold chosen on {p.info['val_tokens']}):",
             f"{'layer':>5s} {'recall':>7s} {'precision':>9s} {'predicted':>9s} {'true':>6s}"]
    for i, m in enumerate(p.heldout):
        lines.append(f"{i:5d} {m['recall']:7.3f} {m['precision']:9.3f} {m['predicted_active']:9.3f} "
                     f"{m['true_active']:6.3f}")
    m = p.mean()
    lines.append(f"{'mean':>5s} {m['recall']:7.3f} {m['precision']:9.3f} {m['predicted_active']:9.3f} "
                 f"{m['true_active']:6.3f}")
    rule = "relu(gate x) > 0" if relu else f"CATS thresholds at sparsity {sparsity:.2f}"
    thr_note = ("per-layer thresholds (sparseinfer.predictor.thresholds)" if p.per_layer
                else f"powerinfer.sparse_threshold {p.sparse_threshold:g}")
    lines.append(f"wrote {out} (rank {rank}, {dtype}, targets {rule}, {thr_note}; "
                 f"data {data_s:.0f}s, training {train_s:.0f}s)")
    return lines


# ---- bench --------------------------------------------------------------------------------------

def bench_lines(summary: dict, table: str, reps: int) -> list[str]:
    """bench's summary: the processes, the decode path, the pp/tg table and the ratios to dense."""
    coord = summary["coordinator_ffn_share"]
    lines = [f"{Path(summary['model']).name}: {len(summary['devices'])} workers ({', '.join(summary['devices'])})"
             + (f" + the coordinator computing {100 * coord:.0f}% of FFN neurons" if coord else "")
             + f", {reps} reps, medians; machine read bandwidth {summary['read_bandwidth_gb_s']:.1f} GB/s",
             f"decode path: {summary['decode_path']}", table]
    for name, r in summary["ratios_vs_dense"].items():
        ffn = "" if r["ffn_time"] is None else f"FFN time per token {r['ffn_time']:.2f}x, "
        lines.append(f"{name} / dense: decode {r['tg']:.2f}x tok/s, {ffn}prefill {r['pp']:.2f}x tok/s")
    return lines
