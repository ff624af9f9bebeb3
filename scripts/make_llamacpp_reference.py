#!/usr/bin/env python3
"""llama.cpp as a second oracle, recorded: what llama.cpp (llama-cpp-python, scripts/setup-bench)
computes on files the tests write again byte for byte, so that the tests check against it on a
machine without llama.cpp (CI installs none: building it takes longer than the suite).

    python3 scripts/make_llamacpp_reference.py      # writes tests/fixtures/llama_cpp_reference.json

Recorded, each with the SHA-256 of the file llama.cpp read (a test first checks that the file it
writes now is that one):
  olmoe: the tiny OLMoE (tests/fixtures/tiny_arch.py) with llama.cpp's F32 KV cache: the largest
         difference of its logits from transformers' recorded ones, and whether its greedy
         tokens are transformers'; the copy llama.cpp reads says tokenizer.ggml.pre "default"
         (its vocabulary check refuses the tiny one's "gpt2"; ids are given directly);
  gpt-oss: the bench file `make_bench_model.py --shape tiny --arch gpt-oss` with the SmolLM2
         tokenizer: llama.cpp's 6 greedy tokens after [1, 2, 3].
  smallthinker: the tiny SmallThinker (tests/fixtures/tiny_smallthinker.py), sigmoid and softmax
         gating, F32 KV cache: its greedy tokens after the fixture's prompt, the smallest gap
         between the best and second logit of each greedy pick, and every position's logits
         (tests/fixtures/llama_cpp_reference_logits.npz, "smallthinker-<gating>"); there is no
         transformers class for it, so llama.cpp is its only oracle; and the bench file
         `make_bench_model.py --shape tiny --arch smallthinker` (Q8_0, SmolLM2 tokenizer):
         llama.cpp's 6 greedy tokens after [1, 2, 3] ("smallthinker-bench"); and the sigmoid
         model's other layer patterns (tiny_smallthinker.PATTERNS): their logits of its sequence
         ("smallthinker-patterns").
"""
from __future__ import annotations

import hashlib
import json
import sys
import tempfile
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
OUT = REPO / "tests/fixtures/llama_cpp_reference.json"
OUT_LOGITS = REPO / "tests/fixtures/llama_cpp_reference_logits.npz"
GPT_OSS_BENCH_ARGS = ["--shape", "tiny", "--arch", "gpt-oss", "--type", "q8_0", "--experts", "4", "--experts-used", "2",
                      "--expert-ff", "128", "--quiet"]
GPT_OSS_PROMPT, GPT_OSS_TOKENS = [1, 2, 3], 6
SMALLTHINKER_BENCH_ARGS = ["--shape", "tiny", "--arch", "smallthinker", "--type", "q8_0", "--layers", "5",
                           "--quiet"]


def sha256(path: Path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def olmoe(tmp: Path, llama_cpp) -> dict:
    import gguf

    from sparsecore.gguf_file import open_gguf
    from tests.fixtures.arch_oracle import REF, reference_logits
    from tests.fixtures.tiny_arch import write_tiny_arch
    from tests.fixtures.tiny_gguf import copy_fields, write_gguf

    src = write_tiny_arch(tmp / "o.gguf", "olmoe")
    reader = open_gguf(src)
    w = gguf.GGUFWriter(tmp / "l.gguf", "olmoe")
    copy_fields(reader, w, {"tokenizer.ggml.pre": "default"})
    for t in reader.tensors:
        w.add_tensor(t.name, np.asarray(t.data), raw_shape=list(reversed([int(d) for d in t.shape])),
                     raw_dtype=t.tensor_type)
    write_gguf(w)
    llm = llama_cpp.Llama(str(tmp / "l.gguf"), verbose=False, logits_all=True, n_ctx=64, n_threads=2, type_k=0,
                          type_v=0, flash_attn=False)
    case = REF["archs"]["olmoe"][0]
    ids = case["prompt_ids"] + case["generated_ids"]
    llm.eval(ids)
    got = np.array(llm.scores[:len(ids)], np.float32)
    return {"file_sha256": sha256(src), "max_abs_diff": float(np.abs(got - reference_logits("olmoe")).max()),
            "greedy_as_transformers": bool((got[len(case["prompt_ids"]) - 1:-1].argmax(1)
                                            == case["generated_ids"]).all())}


def bench_file(tmp: Path, llama_cpp, args: list[str], name: str) -> dict:
    """llama.cpp's greedy tokens after GPT_OSS_PROMPT on the bench file `args` write."""
    from scripts.make_bench_model import DEFAULT_TOKENIZER
    from tests.conftest import run_make_bench_model

    path = tmp / f"{name}.gguf"
    run_make_bench_model([*args, "--tokenizer-from", str(DEFAULT_TOKENIZER), "-o", str(path)])
    m = llama_cpp.Llama(str(path), n_ctx=64, n_threads=2, verbose=False, logits_all=True)
    m.eval(GPT_OSS_PROMPT)
    tokens = []
    for _ in range(GPT_OSS_TOKENS):
        tokens.append(int(np.argmax(m.scores[m.n_tokens - 1])))
        m.eval([tokens[-1]])
    return {"file_sha256": sha256(path), "prompt": GPT_OSS_PROMPT, "greedy": tokens}


def smallthinker(tmp: Path, llama_cpp, gating: str, logits: dict) -> dict:
    from tests.fixtures.tiny_smallthinker import N_GENERATED, PROMPT, write_tiny_smallthinker

    path = write_tiny_smallthinker(tmp / f"smallthinker-{gating}.gguf", gating)
    m = llama_cpp.Llama(str(path), n_ctx=64, n_threads=2, verbose=False, logits_all=True, type_k=0, type_v=0,
                        flash_attn=False)
    m.eval(PROMPT)
    tokens = []
    for _ in range(N_GENERATED):
        tokens.append(int(np.argmax(m.scores[m.n_tokens - 1])))
        m.eval([tokens[-1]])
    rows = np.array(m.scores[:m.n_tokens], np.float32)
    logits[f"smallthinker-{gating}"] = rows
    picks = np.sort(rows[len(PROMPT) - 1:-1], axis=1)
    return {"file_sha256": sha256(path), "prompt": PROMPT, "greedy": tokens,
            "min_margin": float((picks[:, -1] - picks[:, -2]).min())}


def smallthinker_patterns(tmp: Path, llama_cpp, ids: list[int], logits: dict) -> dict:
    """Each of the tiny SmallThinker's other layer patterns (sigmoid gating): llama.cpp's logits of
    `ids` and the SHA-256 of the file it read."""
    from tests.fixtures.tiny_smallthinker import PATTERNS, write_tiny_smallthinker

    out = {}
    for name, kw in PATTERNS.items():
        path = write_tiny_smallthinker(tmp / f"smallthinker-{name}.gguf", **kw)
        m = llama_cpp.Llama(str(path), n_ctx=64, n_threads=2, verbose=False, logits_all=True, type_k=0, type_v=0,
                            flash_attn=False)
        m.eval(ids)
        logits[f"smallthinker-{name}"] = np.array(m.scores[:len(ids)], np.float32)
        out[name] = {"file_sha256": sha256(path), "ids": ids}
    return out


def main() -> None:
    import llama_cpp

    logits: dict[str, np.ndarray] = {}
    with tempfile.TemporaryDirectory() as d:
        out = {"llama_cpp_python": llama_cpp.__version__, "olmoe": olmoe(Path(d), llama_cpp),
               "gpt-oss": bench_file(Path(d), llama_cpp, GPT_OSS_BENCH_ARGS, "gpt-oss"),
               "smallthinker": {g: smallthinker(Path(d), llama_cpp, g, logits) for g in ("sigmoid", "softmax")},
               "smallthinker-bench": bench_file(Path(d), llama_cpp, SMALLTHINKER_BENCH_ARGS, "smallthinker-bench")}
        sigmoid = out["smallthinker"]["sigmoid"]
        out["smallthinker-patterns"] = smallthinker_patterns(Path(d), llama_cpp, sigmoid["prompt"] + sigmoid["greedy"],
                                                             logits)
    OUT.write_text(json.dumps(out, indent=1) + "\n")
    np.savez_compressed(OUT_LOGITS, **logits)
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
