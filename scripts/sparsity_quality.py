"""Quality of the two sparsity methods at the weight bytes a decoded token reads.

For a model calibrated by `sparseinfer calibrate` (with its quality pass): per level, input
sparsity's held-out perplexity (the calibration file's: emulated in float32, against the
emulation's dense) and CATS's (measured here by the engine in its default arithmetic, against
its dense), each beside the bytes of weights a decoded token reads at that level, worked out
from the file's tensor sizes and the fractions measured on the same held-out text:
  input: every twinned matrix (sparsecore/input_sparsity.py) reads its scales and its active
         inputs' columns; matrices of types without twins, the lm_head and norms in full;
  cats:  attention, gate and the lm_head in full; up, and down where its type has a twin
         (neuron-major), for the active neurons only.

Usage: python scripts/sparsity_quality.py -m MODEL [--levels 0.1 0.2 ...] [--chunks 8] [--json out]
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from coordinator.runtime.engine import Engine, EngineOptions  # noqa: E402
from coordinator.runtime.model_files import thresholds_path  # noqa: E402
from coordinator.tools import corpus  # noqa: E402
from coordinator.tools.perplexity import perplexity  # noqa: E402
from protocol.shm_layout import INPUT_SITES  # noqa: E402
from sparsecore.kernels import input_major_type  # noqa: E402

SITE_OF = {"attn_q": "attn_in", "attn_k": "attn_in", "attn_v": "attn_in", "attn_output": "attn_out",
           "ffn_gate": "ffn_in", "ffn_up": "ffn_in", "ffn_down": "ffn_h", "head": "head_in"}
HEAD_EXACT = 512  # rows the lm_head's candidates read again exactly (2 processes x HEAD_CANDIDATES)
# Bytes of a block of 32 inputs' scales per row against the block's bytes (what a twin reads
# once per block with an active input): Q4_0 2 of 18, Q4_1 4 of 20, Q8_0 2 of 34
SCALE_SHARE = {2: 2 / 18, 3: 4 / 20, 8: 2 / 34}


def tensor_bytes(store, n_layers: int) -> tuple[dict, int]:
    """({(layer, kind): (bytes, type)}, with the lm_head as (-1, "head"))."""
    per = {}
    for i in range(n_layers):
        for kind in SITE_OF:
            name = f"blk.{i}.{kind}.weight"
            if store.has(name):
                t = store.by_name[name]
                per[(i, kind)] = (int(t.n_bytes), int(t.tensor_type))
    head = store.by_name["output.weight" if store.has("output.weight") else "token_embd.weight"]
    per[(-1, "head")] = (int(head.n_bytes), int(head.tensor_type))
    return per, 0


def input_bytes(per: dict, other: int, kept: dict, n_vocab: int) -> float:
    b = other
    for (_, kind), (n, t) in per.items():
        if input_major_type(t) and t in SCALE_SHARE and kept.get(SITE_OF[kind], 1.0) < 1.0:
            s = SCALE_SHARE[t]
            b += n * (s + (1 - s) * kept[SITE_OF[kind]])
            if kind == "head":
                b += n * HEAD_EXACT / n_vocab
        else:
            b += n
    return b


def cats_bytes(per: dict, other: int, active: float) -> float:
    b = other
    for (_, kind), (n, t) in per.items():
        skips = kind == "ffn_up" or (kind == "ffn_down" and input_major_type(t))
        b += n * active if skips else n
    return b


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-m", "--model", type=Path, required=True)
    ap.add_argument("--levels", type=float, nargs="*", default=None, help="default: the calibrated ones")
    ap.add_argument("--chunks", type=int, default=8, help="held-out windows of --chunk-len tokens (calibrate's)")
    ap.add_argument("--chunk-len", type=int, default=256)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    table = json.loads(thresholds_path(args.model).read_text())
    q = table.get("quality")
    if not q:
        sys.exit(f"{thresholds_path(args.model)}: no quality entry: run `sparseinfer calibrate -m {args.model}`")
    levels = args.levels or sorted(float(k) for k in q["levels"])
    rows = []
    with Engine(args.model, EngineOptions(threads=args.threads, interleave=False, sparse_method="cats")) as eng:
        per, other = tensor_bytes(eng.store, eng.cfg.n_layers)
        dense_bytes = other + sum(n for n, _ in per.values())
        held = corpus.token_chunks(eng.tokenizer.encode(corpus.load(None, "heldout")), args.chunk_len, args.chunks)
        base = perplexity(eng, held)
        rows.append(dict(method="dense", level=0.0, ppl=base["ppl"], rel=0.0, read=0.0, mb=dense_bytes / 1e6))
        for s in levels:
            key = f"{s:.2f}"
            if key in q["levels"]:
                v = q["levels"][key]
                b = input_bytes(per, other, v["kept"], eng.store.shape("output.weight" if eng.store.has(
                    "output.weight") else "token_embd.weight")[0])
                rows.append(dict(method="input", level=s, ppl=v["ppl"], rel=v["ppl"] / q["dense"] - 1,
                                 read=1 - sum(v["kept"][k] for k in INPUT_SITES) / len(INPUT_SITES), mb=b / 1e6))
            eng.set_sparsity(s)
            r = perplexity(eng, held)
            eng.set_sparsity(None)
            rows.append(dict(method="cats", level=s, ppl=r["ppl"], rel=r["ppl"] / base["ppl"] - 1,
                             read=1 - r["active_fraction"], mb=cats_bytes(per, other, r["active_fraction"]) / 1e6))
    print(f"{args.model.name}: held-out perplexity over {q['tokens']} tokens ({args.chunks} x {args.chunk_len}); "
          f"input sparsity emulated (dense {q['dense']:.3f}), CATS measured (dense {base['ppl']:.3f})")
    print("| method | level | skipped | MB read per token | vs dense bytes | perplexity | vs its dense |")
    print("|---|---|---|---|---|---|---|")
    for r in sorted(rows, key=lambda r: -r["mb"]):
        print(f"| {r['method']} | {r['level']:.2f} | {100 * r['read']:.0f} % | {r['mb']:.1f} | "
              f"{r['mb'] / rows[0]['mb']:.2f}x | {r['ppl']:.3f} | {100 * r['rel']:+.1f} % |")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
