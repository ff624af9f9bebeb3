"""The synthetic GGUF writer stores what it means to: metadata, names, shapes, values, tokenizer."""
from __future__ import annotations

import numpy as np
import pytest

import gguf
from gguf import GGMLQuantizationType as QT

from tests.fixtures import tiny_gguf as tg

# Relative Frobenius error of dequantize(stored) vs the float weights, per type.
MAX_REL_ERR = {
    "F32": 0.0, "F16": 1e-3, "BF16": 5e-3, "Q8_0": 0.01,
    "Q6_K": 0.04, "Q5_0": 0.07, "Q5_1": 0.07, "Q5_K": 0.07,
    "Q4_0": 0.15, "Q4_1": 0.15, "Q4_K": 0.15, "IQ4_NL": 0.15, "IQ4_XS": 0.15, "Q3_K": 0.2, "Q2_K": 0.4,
}
EXPECTED_QTYPE = {name: QT[name] for name in tg.TENSOR_TYPES}
LAYER_TENSORS = ("attn_norm", "attn_q", "attn_k", "attn_v", "attn_output",
                 "ffn_norm", "ffn_gate", "ffn_up", "ffn_down")


def fields(reader: gguf.GGUFReader) -> dict:
    return {f.name: f.contents() for f in reader.fields.values()}


def numpy_shape(t) -> tuple[int, ...]:
    return tuple(reversed([int(x) for x in t.shape]))


@pytest.mark.parametrize("tensor_type", tg.TENSOR_TYPES)
def test_roundtrip(tmp_path, tensor_type):
    path = tg.write_tiny_llama(tmp_path / f"tiny-{tensor_type}.gguf", tensor_type=tensor_type)
    hidden, n_ff = tg.resolve_dims(tensor_type, None, None)
    assert (hidden, n_ff) == ((256, 512) if tensor_type in tg.K_QUANTS else (64, 160))
    want = tg.tiny_llama_tensors(hidden=hidden, n_ff=n_ff)
    vocab = tg.tiny_vocab()
    n_vocab = len(vocab.tokens)

    r = gguf.GGUFReader(path)
    kv = fields(r)
    expected = {
        "general.architecture": "llama",
        "llama.block_count": 2,
        "llama.context_length": 256,
        "llama.embedding_length": hidden,
        "llama.feed_forward_length": n_ff,
        "llama.attention.head_count": 4,
        "llama.attention.head_count_kv": 2,
        "llama.rope.dimension_count": hidden // 4,
        "llama.vocab_size": n_vocab,
        "general.file_type": int(tg.TYPES[tensor_type][1]),
        "general.quantization_version": 2,
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": "gpt2",
        "tokenizer.ggml.bos_token_id": vocab.bos_id,
        "tokenizer.ggml.eos_token_id": vocab.eos_id,
        "tokenizer.ggml.add_bos_token": False,
    }
    for key, value in expected.items():
        assert kv[key] == value, key
    assert kv["llama.rope.freq_base"] == pytest.approx(10000.0)
    assert kv["llama.attention.layer_norm_rms_epsilon"] == pytest.approx(1e-5)
    assert "sparseinfer.activation" not in kv
    assert "<|im_start|>" in kv["tokenizer.chat_template"]

    names = {t.name for t in r.tensors}
    assert names == set(want)
    assert names == ({"token_embd.weight", "output_norm.weight", "output.weight"}
                     | {f"blk.{i}.{n}.weight" for i in range(2) for n in LAYER_TENSORS})
    shapes = {t.name: [int(x) for x in t.shape] for t in r.tensors}
    assert shapes["token_embd.weight"] == [hidden, n_vocab]          # GGUF ne order: [in, out]
    assert shapes["output.weight"] == [hidden, n_vocab]
    assert shapes["blk.0.attn_q.weight"] == [hidden, hidden]
    assert shapes["blk.0.attn_k.weight"] == [hidden, 2 * hidden // 4]
    assert shapes["blk.1.ffn_gate.weight"] == [hidden, n_ff]
    assert shapes["blk.1.ffn_down.weight"] == [n_ff, hidden]
    assert shapes["blk.1.ffn_norm.weight"] == [hidden]

    for t in r.tensors:
        w = want[t.name]
        assert numpy_shape(t) == w.shape, t.name
        if w.ndim == 1:
            assert t.tensor_type == QT.F32
            np.testing.assert_array_equal(t.data, w)
            continue
        assert t.tensor_type == EXPECTED_QTYPE[tensor_type], t.name
        got = gguf.quants.dequantize(t.data, t.tensor_type).reshape(w.shape)
        assert np.isfinite(got).all()
        rel = np.linalg.norm(got - w) / np.linalg.norm(w)
        assert rel <= MAX_REL_ERR[tensor_type], (t.name, rel)
        if tensor_type == "F32":
            np.testing.assert_array_equal(got, w)


def test_options(tmp_path):
    path = tg.write_tiny_llama(tmp_path / "m.gguf", n_layers=3, hidden=128, n_ff=96, n_heads=8,
                               n_kv_heads=8, vocab_size=400, ctx=512, rope_base=5e5,
                               tied_embeddings=True, activation="relu", tensor_type="Q8_0")
    r = gguf.GGUFReader(path)
    kv = fields(r)
    assert kv["llama.block_count"] == 3
    assert kv["llama.context_length"] == 512
    assert kv["llama.attention.head_count_kv"] == 8
    assert kv["llama.rope.dimension_count"] == 16
    assert kv["llama.rope.freq_base"] == pytest.approx(5e5)
    assert kv["llama.vocab_size"] == 400
    assert kv["sparseinfer.activation"] == "relu"
    tokens = kv["tokenizer.ggml.tokens"]
    assert len(tokens) == 400 and tokens[-1] == "[PAD399]"
    assert kv["tokenizer.ggml.token_type"][-1] == gguf.TokenType.UNUSED
    names = {t.name: t for t in r.tensors}
    assert "output.weight" not in names
    assert [int(x) for x in names["token_embd.weight"].shape] == [128, 400]
    assert "blk.2.ffn_down.weight" in names


def test_bad_arguments(tmp_path):
    with pytest.raises(ValueError, match="256"):
        tg.write_tiny_llama(tmp_path / "x.gguf", tensor_type="Q4_K", hidden=64)
    with pytest.raises(ValueError, match="multiple"):
        tg.write_tiny_llama(tmp_path / "x.gguf", tensor_type="Q4_0", n_ff=100)
    with pytest.raises(ValueError, match="tensor_type"):
        tg.write_tiny_llama(tmp_path / "x.gguf", tensor_type="IQ2_XXS")
    with pytest.raises(ValueError, match="vocab_size"):
        tg.write_tiny_llama(tmp_path / "x.gguf", vocab_size=10)


def test_deterministic(tmp_path):
    a = tg.write_tiny_llama(tmp_path / "a.gguf", tensor_type="Q4_K", seed=1).read_bytes()
    b = tg.write_tiny_llama(tmp_path / "b.gguf", tensor_type="Q4_K", seed=1).read_bytes()
    c = tg.write_tiny_llama(tmp_path / "c.gguf", tensor_type="Q4_K", seed=2).read_bytes()
    assert a == b
    assert a != c and len(a) == len(c)


def test_tokenizer_builds_bpe(tmp_path):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    r = gguf.GGUFReader(tg.write_tiny_llama(tmp_path / "m.gguf"))
    kv = fields(r)
    tokens, types, merges = kv["tokenizer.ggml.tokens"], kv["tokenizer.ggml.token_type"], kv["tokenizer.ggml.merges"]
    vocab = {t: i for i, t in enumerate(tokens)}
    assert len(vocab) == len(tokens), "duplicate tokens"
    assert 300 <= len(tokens) <= 400
    b2u = tg.bytes_to_unicode()
    assert all(b2u[b] in vocab for b in range(256))
    pairs = [tuple(m.split(" ")) for m in merges]
    assert all(len(p) == 2 and p[0] in vocab and p[1] in vocab and p[0] + p[1] in vocab for p in pairs)
    assert ("Ġt", "he") in pairs
    specials = {t: i for i, t in enumerate(tokens) if types[i] == gguf.TokenType.CONTROL}
    assert set(specials) == {"<|endoftext|>", "<|im_start|>", "<|im_end|>"}
    assert kv["tokenizer.ggml.eos_token_id"] == specials["<|im_end|>"]

    tok = Tokenizer(models.BPE(vocab, pairs))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    text = "Hello, the world is nice. Ünïcödé 🙂 and\ttabs\n"
    enc = tok.encode(text)
    assert tok.decode(enc.ids) == text
    assert vocab["Ġthe"] in enc.ids                              # merges apply
    assert len(enc.ids) < len(text.encode("utf-8"))


# ---- ggml's scalar dequantizers (ggml-quants.c), transcribed, to check the K-quant bit layout
# independently of gguf-py's vectorized version.

def _scale_min_k4(j, q):
    if j < 4:
        return q[j] & 63, q[j + 4] & 63
    return (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4), (q[j + 4] >> 4) | ((q[j] >> 6) << 4)


def _ggml_q4_k(b: bytes) -> np.ndarray:
    d, dmin = np.frombuffer(b[:4], np.float16).astype(np.float32)
    sc, qs, y = b[4:16], b[16:], []
    for j in range(4):
        s1, m1 = _scale_min_k4(2 * j, sc)
        s2, m2 = _scale_min_k4(2 * j + 1, sc)
        q = qs[32 * j: 32 * j + 32]
        y += [d * s1 * (v & 0xF) - dmin * m1 for v in q]
        y += [d * s2 * (v >> 4) - dmin * m2 for v in q]
    return np.array(y, np.float32)


def _ggml_q5_k(b: bytes) -> np.ndarray:
    d, dmin = np.frombuffer(b[:4], np.float16).astype(np.float32)
    sc, qh, ql, y = b[4:16], b[16:48], b[48:], []
    for j in range(4):
        s1, m1 = _scale_min_k4(2 * j, sc)
        s2, m2 = _scale_min_k4(2 * j + 1, sc)
        u1, u2 = 1 << (2 * j), 2 << (2 * j)
        q = ql[32 * j: 32 * j + 32]
        y += [d * s1 * ((q[l] & 0xF) + (16 if qh[l] & u1 else 0)) - dmin * m1 for l in range(32)]
        y += [d * s2 * ((q[l] >> 4) + (16 if qh[l] & u2 else 0)) - dmin * m2 for l in range(32)]
    return np.array(y, np.float32)


def _ggml_q6_k(b: bytes) -> np.ndarray:
    ql, qh = b[:128], b[128:192]
    sc = np.frombuffer(b[192:208], np.int8).astype(np.float32)
    d = np.frombuffer(b[208:210], np.float16).astype(np.float32)[0]
    y = np.zeros(256, np.float32)
    for n in range(2):
        L, H, S = ql[64 * n:], qh[32 * n:], sc[8 * n:]
        for l in range(32):
            i = l // 16
            y[128 * n + l] = d * S[i] * (((L[l] & 0xF) | (((H[l] >> 0) & 3) << 4)) - 32)
            y[128 * n + l + 32] = d * S[i + 2] * (((L[l + 32] & 0xF) | (((H[l] >> 2) & 3) << 4)) - 32)
            y[128 * n + l + 64] = d * S[i + 4] * (((L[l] >> 4) | (((H[l] >> 4) & 3) << 4)) - 32)
            y[128 * n + l + 96] = d * S[i + 6] * (((L[l + 32] >> 4) | (((H[l] >> 6) & 3) << 4)) - 32)
    return y


@pytest.mark.parametrize("qtype,ref", [(QT.Q4_K, _ggml_q4_k), (QT.Q5_K, _ggml_q5_k), (QT.Q6_K, _ggml_q6_k)])
def test_k_quant_layout_matches_ggml(qtype, ref):
    rng = np.random.default_rng(5)
    x = rng.standard_normal((2, 512), dtype=np.float32) * 0.05
    x[1, :256] += 0.03  # a block with an offset (non-zero min)
    q = tg.quantize_k(x, qtype)
    _, size = gguf.GGML_QUANT_SIZES[qtype]
    assert q.shape == (2, 2 * size) and q.dtype == np.uint8
    blocks = q.reshape(-1, size)
    lib = gguf.quants.dequantize(q, qtype)
    for i, blk in enumerate(blocks):
        np.testing.assert_allclose(ref(blk.tobytes()), lib.reshape(-1, 256)[i], rtol=1e-6, atol=1e-7)
    assert np.linalg.norm(lib - x) / np.linalg.norm(x) < MAX_REL_ERR[qtype.name]


def test_garbage_files(tmp_path):
    files = tg.write_garbage_files(tmp_path)
    assert set(files) == {"not_gguf", "random_bytes", "empty", "truncated", "truncated_header",
                          "mamba_arch", "undequantizable_qtype"}
    assert all(p.exists() for p in files.values())
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(p.name for p in files.values())
    for key in ("not_gguf", "random_bytes", "empty", "truncated", "truncated_header"):
        with pytest.raises((ValueError, IndexError)):
            gguf.GGUFReader(files[key])
    assert files["truncated"].read_bytes()[:4] == b"GGUF"

    kv = fields(gguf.GGUFReader(files["mamba_arch"]))
    assert kv["general.architecture"] == "mamba"

    r = gguf.GGUFReader(files["undequantizable_qtype"])
    assert fields(r)["general.architecture"] == "llama"
    types = {t.name: t.tensor_type for t in r.tensors}
    assert types["blk.0.ffn_gate.weight"] == QT.Q1_0
    assert types["blk.0.ffn_up.weight"] == QT.Q8_0
    with pytest.raises(NotImplementedError):
        r = gguf.GGUFReader(files["undequantizable_qtype"])
        t = next(t for t in r.tensors if t.name == "blk.0.ffn_gate.weight")
        gguf.quants.dequantize(t.data, t.tensor_type)


@pytest.mark.parametrize("tensor_type", ["Q5_0", "Q5_1"])
def test_q5_files_are_read_in_their_own_blocks(tiny_model_factory, tensor_type):
    """Q5_0 (common in K-quant files) and Q5_1 have native kernels: the store hands their
    tensors out as the file holds them (no conversion at load), and the kernels' products on
    them are those of gguf-py's dequantized matrix."""
    import numpy as np
    from gguf.quants import dequantize

    from sparsecore.gguf_file import open_gguf
    from sparsecore.kernels import FileMatrix, supports
    from sparsecore.tensors import TensorStore

    path = tiny_model_factory(tensor_type=tensor_type)
    store = TensorStore(path, open_gguf(path))
    raw = next(t for t in store.reader.tensors if t.name == "blk.0.ffn_up.weight")
    t = store.info("blk.0.ffn_up.weight")
    assert raw.tensor_type == t.tensor_type == QT[tensor_type] and supports(t.tensor_type)
    assert np.shares_memory(np.asarray(t.data), np.asarray(raw.data)) and not store.converted
    want = dequantize(np.asarray(raw.data), QT[tensor_type]).reshape(store.shape("blk.0.ffn_up.weight"))
    np.testing.assert_array_equal(store.matrix("blk.0.ffn_up.weight"), want)
    m = FileMatrix(t)
    xs = np.random.default_rng(6).standard_normal(m.cols).astype(np.float32)
    np.testing.assert_allclose(m.matvec(xs), want @ xs, rtol=1e-4, atol=1e-4)
