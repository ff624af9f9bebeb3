"""OLMoE (gguf arch `olmoe`): llama's attention with RMSNorms of Q and K over every head at once
(attn_q_norm n_heads x head_dim wide, attn_k_norm n_kv x head_dim), and routed experts without
renormalizing the top k. tests/test_moe.py runs the tiny model against transformers'
OlmoeForCausalLM on every path (coordinator and worker, split attention, lockstep, a worker
alone); here: the native step's full-width norm against float64 (whole, and in shares of the
heads, each of which must normalize over every head), the metadata errors, and llama.cpp's
reading of the same file as a second oracle.
"""
from __future__ import annotations

import hashlib

import numpy as np
import pytest

from sparsecore import kernels as K
from sparsecore.config import read_config
from sparsecore.errors import ModelFileError
from sparsecore.gguf_file import open_gguf
from tests.fixtures.arch_oracle import LLAMA_CPP_REF, REF, reference_logits
from tests.fixtures.tiny_arch import write_tiny_arch
from tests.fixtures.tiny_gguf import copy_fields, write_gguf
from tests.fixtures.attention_ref import Layer, f32_matrix, rope_ref


class FullNormLayer(Layer):
    """Layer with olmoe's Q/K norms: one RMSNorm over all n_heads x hd values of Q, one over K's."""

    def __init__(self, *shape, seed: int, bias: bool = False):
        super().__init__(*shape, seed=seed)
        # Q | K | V biases in the file's row order (transformers' attention_bias: added before the norms)
        self.bias = self.rng.uniform(-1, 1, (self.n_heads + 2 * self.n_kv) * self.hd).astype(np.float32) \
            if bias else None
        # heads of different sizes (as trained models' are): the RMS over some heads is then far
        # from the RMS over all of them
        self.wq[: self.hidden // 2] *= 3
        self.wk[: self.n_kv * self.hd // 2] *= 3
        self.q_norm = self.rng.uniform(0.5, 1.5, self.n_heads * self.hd).astype(np.float32)
        self.k_norm = self.rng.uniform(0.5, 1.5, self.n_kv * self.hd).astype(np.float32)

    def step(self, kc, vc) -> K.AttentionStep:
        return K.AttentionStep(f32_matrix(self.wq, "q"), self.q_rows, f32_matrix(self.wk, "k"), self.k_rows,
                               f32_matrix(self.wv, "v"), f32_matrix(np.eye(self.hidden), "o"), self.norm, 1e-6,
                               self.n_heads, self.n_kv, self.hd, self.d, self.cos, self.sin, kc, vc, fast=False,
                               extras=K.AttentionExtras(q_norm=self.q_norm, k_norm=self.k_norm, qk_norm_full=True,
                                                        bias=self.bias))

    def reference(self, h, pos, kc, vc, per_share: tuple[int, int] | None = None):
        """The attention output in float64; `per_share` (h0, h1): what a share that normalized
        only its own heads' Q (and their KV heads' K) would compute there (the wrong answer)."""
        hd, d, g = self.hd, self.d, self.n_heads // self.n_kv
        x = h.astype(np.float64)
        x = x / np.sqrt(np.mean(x * x) + 1e-6) * self.norm
        q = self.wq[self.q_rows].astype(np.float64) @ x
        k = self.wk[self.k_rows].astype(np.float64) @ x
        v = self.wv.astype(np.float64) @ x
        if self.bias is not None:
            nq, nk = self.n_heads * hd, self.n_kv * hd
            q, k, v = q + self.bias[self.q_rows], k + self.bias[nq + self.k_rows], v + self.bias[nq + nk:]
        v = v.reshape(self.n_kv, hd)
        rms = lambda a: a / np.sqrt(np.mean(a * a) + 1e-6)  # noqa: E731
        if per_share is None:
            q, k = rms(q) * self.q_norm, rms(k) * self.k_norm
        else:
            (a, b), (ka, kb) = per_share, (per_share[0] // g, -(-per_share[1] // g))
            q[a * hd:b * hd] = rms(q[a * hd:b * hd]) * self.q_norm[a * hd:b * hd]
            k[ka * hd:kb * hd] = rms(k[ka * hd:kb * hd]) * self.k_norm[ka * hd:kb * hd]
        c, s = self.cos[pos].astype(np.float64), self.sin[pos].astype(np.float64)
        q, k = rope_ref(q.reshape(self.n_heads, hd), d, c, s), rope_ref(k.reshape(self.n_kv, hd), d, c, s)
        keys = np.concatenate([kc[:, :pos].astype(np.float64), k[:, None]], axis=1)
        vals = np.concatenate([vc[:, :pos].astype(np.float64), v[:, None]], axis=1)
        out = np.empty((self.n_heads, hd))
        for i in range(self.n_heads):
            sc = keys[i // g] @ q[i] / np.sqrt(hd)
            e = np.exp(sc - sc.max())
            out[i] = (e / e.sum()) @ vals[i // g]
        return out.reshape(-1)


@pytest.mark.parametrize("bias", [False, True], ids=["", "bias"])
@pytest.mark.parametrize("shape", [(4, 4, 16, 16), (8, 2, 64, 64), (6, 3, 32, 32)], ids=str)
def test_full_width_qk_norms_whole_and_in_shares_of_the_heads(isa, shape, bias):
    """The native step normalizes Q over every head and K over every KV head (float64 reference);
    a share of the heads (attn_part, as a worker computes it: keep_output_columns) computes
    every head's Q and K for the norm and returns its own heads' output, and the shares add up
    to the whole. A share that normalized its own heads alone would be far off. Q/K/V biases
    (transformers' attention_bias) come before the norms, in a share too."""
    L = FullNormLayer(*shape, seed=3, bias=bias)
    pos = 37
    _, kc, vc = L.caches(pos)
    h = L.rng.standard_normal(L.hidden).astype(np.float32)
    want = L.reference(h, pos, kc, vc)
    scale = np.abs(want).max()
    got = h.copy()
    L.step(kc.copy(), vc.copy())(got, pos)
    assert np.abs(got.astype(np.float64) - h - want).max() <= 1e-4 * scale
    g = L.n_heads // L.n_kv
    cut = (L.n_heads // 2) // g * g or L.n_heads // 2  # whole KV heads where there are two or more
    total = np.zeros(L.hidden)
    for h0, h1 in ((0, cut), (cut, L.n_heads)):
        kcs, vcs = kc.copy(), vc.copy()
        step = L.step(kcs, vcs)
        step.keep_output_columns(h0, h1)
        out = np.zeros((1, L.hidden), np.float32)
        step.part(h[None].copy(), np.array([pos], np.int64), np.array([kcs.ctypes.data], np.int64),
                  np.array([vcs.ctypes.data], np.int64), h0, h1, out)
        cols = slice(h0 * L.hd, h1 * L.hd)
        assert np.abs(out[0, cols] - want[cols]).max() <= 1e-4 * scale, (h0, h1)
        wrong = L.reference(h, pos, kc, vc, per_share=(h0, h1))
        assert np.abs(wrong[cols] - want[cols]).max() > 1e-2 * scale  # the test can tell them apart
        total += out[0]
    assert np.abs(total - want).max() <= 1e-4 * scale


def test_a_full_width_record_is_checked():
    L = FullNormLayer(4, 2, 16, 16, seed=1)
    _, kc, vc = L.caches(0)
    L.q_norm = L.q_norm[:16]  # one head's width: olmoe's norm spans all four
    with pytest.raises(ValueError, match="q_norm"):
        L.step(kc, vc)
    L.q_norm, L.k_norm = np.ones(64, np.float32), L.k_norm[:16]
    with pytest.raises(ValueError, match="k_norm"):
        L.step(kc, vc)
    with pytest.raises(ValueError, match="without q_norm"):
        K.AttentionExtras(qk_norm_full=True).record(L.hidden, 4, 2, 16)
    L = FullNormLayer(4, 2, 16, 16, seed=1)
    assert L.step(kc, vc).extra["qk_norm_full"][0] == 1


def _rewrite(src, dst, tensors=None, fields=None):
    """A copy of the GGUF at src with some tensors replaced (None: dropped) or fields changed."""
    import gguf

    reader = open_gguf(src)
    w = gguf.GGUFWriter(dst, "olmoe")
    copy_fields(reader, w, fields)
    for t in reader.tensors:
        a = np.asarray(t.data)
        if tensors and t.name in tensors:
            if tensors[t.name] is None:
                continue
            w.add_tensor(t.name, tensors[t.name], raw_dtype=t.tensor_type)
            continue
        w.add_tensor(t.name, a, raw_shape=list(reversed([int(d) for d in t.shape])), raw_dtype=t.tensor_type)
    write_gguf(w)
    return dst


@pytest.mark.parametrize("name,width,word", [
    ("blk.1.attn_q_norm.weight", 16, "blk.1.attn_q_norm.weight has shape [16], expected [64]"),
    ("blk.0.attn_k_norm.weight", 16, "blk.0.attn_k_norm.weight has shape [16], expected [64]")])
def test_a_q_or_k_norm_not_spanning_every_head_is_one_line_naming_the_tensor(tmp_path, name, width, word):
    src = write_tiny_arch(tmp_path / "ok.gguf", "olmoe")
    bad = _rewrite(src, tmp_path / "bad.gguf", tensors={name: np.ones(width, np.float32)})
    with pytest.raises(ModelFileError) as e:
        read_config(bad, open_gguf(bad))
    assert word in str(e.value) and "head_count 4" in str(e.value) and "\n" not in str(e.value)


def test_an_olmoe_file_without_its_q_norm_is_refused_naming_the_tensor(tmp_path):
    """The norms are part of the architecture (llama.cpp requires them): not silently skipped."""
    from coordinator.runtime.engine import Engine, EngineOptions

    src = write_tiny_arch(tmp_path / "ok.gguf", "olmoe")
    bad = _rewrite(src, tmp_path / "bad.gguf", tensors={"blk.0.attn_q_norm.weight": None})
    cfg = read_config(bad, open_gguf(bad))
    assert cfg.qk_norm and cfg.qk_norm_full
    with pytest.raises(ModelFileError) as e:
        Engine(bad, EngineOptions(cpu_workers=1, threads=2), plan_only=True)
    assert "blk.0.attn_q_norm.weight" in str(e.value) and "\n" not in str(e.value)


def test_config_of_the_tiny_file():
    import tempfile
    from pathlib import Path

    with tempfile.TemporaryDirectory() as d:
        path = write_tiny_arch(Path(d) / "o.gguf", "olmoe")
        cfg = read_config(path, open_gguf(path))
    # one expert's neurons are feed_forward_length (OlmoeModel writes no expert length); neox
    # rope, no permutation; as many KV heads as query heads (OLMoE-1B-7B's)
    assert (cfg.n_ff, cfg.n_experts, cfg.n_experts_used, cfg.n_kv_heads) == (64, 8, 2, 4)
    assert cfg.qk_norm_full and not cfg.expert_norm and not cfg.permuted_qk and cfg.rms_eps == pytest.approx(1e-5)


def test_llama_cpp_reads_the_tiny_file_as_transformers_does(tmp_path):
    """A second oracle: llama.cpp (llama-cpp-python) on the same tiny file, F32 KV cache, gave
    transformers' logits (its full-width Q/K norms and unrenormalized top k are llama.cpp's own
    reading of the architecture, not only ours). Recorded by scripts/make_llamacpp_reference.py
    (no llama.cpp where the suite runs): the file written now must be the one it read."""
    rec = LLAMA_CPP_REF["olmoe"]
    assert hashlib.sha256(write_tiny_arch(tmp_path / "o.gguf", "olmoe").read_bytes()).hexdigest() == rec["file_sha256"]
    assert rec["max_abs_diff"] < 1e-4 and rec["greedy_as_transformers"]  # measured 9e-6 (logits up to 10)


def test_torch_attention_normalizes_over_every_head_too(tmp_path, no_leaks):
    """A prompt the quality tools watch (attn_observer) takes torch's attention on the
    coordinator (coordinator/model/torch_layers.py): its Q/K norms span every head as the
    native step's do, so its logits are transformers' too."""
    from coordinator.runtime.engine import Engine, EngineOptions
    from tests.fixtures.arch_oracle import LOGITS_ATOL

    case = REF["archs"]["olmoe"][0]
    ids = case["prompt_ids"] + case["generated_ids"]
    seen = []
    with Engine(write_tiny_arch(tmp_path / "o.gguf", "olmoe"), EngineOptions(cpu_workers=1, threads=2)) as eng:
        eng.model.attn_observer = lambda layer, x, out: seen.append(layer)
        logits = eng.forward_logits(ids)
    assert seen == [0, 1]  # the torch path ran, once per layer
    assert float(np.abs(logits - reference_logits("olmoe")).max()) < LOGITS_ATOL
