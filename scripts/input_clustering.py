"""Could a permutation of a matrix's inputs, learned at calibration, group the inputs that are
active together, so that an input-major twin reads longer runs of adjacent channel rows and
skips whole groups of 32? Measured on a real model's activations (docs/SPARSITY.md, "Inputs
active together").

    python scripts/input_clustering.py [-m MODEL] [--level 0.5] [--chunks 8]

Runs the dense model over the calibration text (coordinator/tools/corpus.py) and keeps each
layer's inputs at the four input sites (attention's and the FFN's inputs, the attention output,
the FFN's hidden activation). At each site the threshold is the magnitude quantile equal to the
level, as `sparseinfer calibrate` sets it. The inputs' order is learned on the first half of the
tokens (inputs sorted by how often they are active) and judged on the second half, against the
file's order: the fraction of groups of 32 with an active input (each such group reads its rows'
scales) and the mean run of adjacent active inputs (scripts/bench_twin_reads.py: adjacent
channel rows read faster). Inputs active independently of each other at rate p give runs of
1 / (1 - p) and nearly every group active. Prints means over the layers; asserts nothing.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from coordinator.runtime.engine import Engine, EngineOptions  # noqa: E402
from coordinator.runtime.model_fetch import default_model_path  # noqa: E402
from coordinator.tools import corpus, observe  # noqa: E402


def clustering(active: np.ndarray) -> tuple[float, float]:
    """(fraction of groups of 32 with an active input, mean run of adjacent active inputs) of a
    (tokens, inputs) boolean array"""
    t, n = active.shape
    groups = active[:, :n // 32 * 32].reshape(t, -1, 32).any(axis=2).mean()
    starts = active & ~np.concatenate([np.zeros((t, 1), bool), active[:, :-1]], axis=1)
    return float(groups), float(active.sum() / max(int(starts.sum()), 1))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("-m", "--model", type=Path, default=None)
    ap.add_argument("--level", type=float, default=0.5, help="the fraction of inputs skipped")
    ap.add_argument("--chunks", type=int, default=8, help="chunks of 256 calibration tokens")
    a = ap.parse_args()
    path = a.model or default_model_path()
    with Engine(path, EngineOptions(threads=2)) as eng:
        cfg = observe.config(eng)
        ids = eng.tokenizer.encode(corpus.load(None, "calibration"))
        rows: dict[tuple[int, str], list[np.ndarray]] = {}
        observe.dense_run(eng, corpus.token_chunks(ids, 256, a.chunks),
                          lambda layer, x, *_: rows.setdefault((layer, "ffn_in"), []).append(x.copy()),
                          attention_observer=lambda layer, x, out: (
                              rows.setdefault((layer, "attn_in"), []).append(x.copy()),
                              rows.setdefault((layer, "attn_out"), []).append(out.copy())))
        gates = observe.GateActivity(eng)
        per_site: dict[str, list[tuple[float, ...]]] = {}
        for layer in range(cfg.n_layers):
            for site in ("attn_in", "attn_out", "ffn_in", "ffn_h"):
                x = np.concatenate(rows[(layer, "ffn_in" if site == "ffn_h" else site)])
                if site == "ffn_h":
                    x = gates.hidden(layer, x).numpy()
                mag = np.abs(x)
                active = mag > np.quantile(mag, a.level)
                learn, judge = active[:len(active) // 2], active[len(active) // 2:]
                order = np.argsort(-learn.mean(axis=0), kind="stable")
                per_site.setdefault(site, []).append((*clustering(judge), *clustering(judge[:, order]),
                                                      float(learn.mean(axis=0).std())))
    print(f"{path.name}, level {a.level:.2f} ({a.chunks} x 256 calibration tokens, order learned on the first "
          f"half, judged on the second), means over {cfg.n_layers} layers; independent inputs: runs of "
          f"{1 / a.level:.2f}")
    print("| site | groups active, file order | run, file order | groups active, sorted | run, sorted | "
          "std of inputs' activity |")
    print("|---|---|---|---|---|---|")
    for site, v in per_site.items():
        m = np.array(v).mean(axis=0)
        print(f"| {site} | {m[0]:.3f} | {m[1]:.2f} | {m[2]:.3f} | {m[3]:.2f} | {m[4]:.3f} |")


if __name__ == "__main__":
    main()
