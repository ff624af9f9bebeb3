"""sparsecore.lm_head: the Q8_0 lm_head for one decoded token equals the float32 product with
the dequantized matrix, the attention model uses it exactly when the file stores Q8_0, and
vocabulary ranges computed apart equal the whole head."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from coordinator.model.transformer import Embedding, LmHead, Transformer
from sparsecore.lm_head import HeadRows, Q8Head, head_tensor_name
from sparsecore.config import read_config
from sparsecore.gguf_file import open_gguf
from sparsecore.tensors import TensorStore



def _store(path):
    reader = open_gguf(path)
    return TensorStore(path, reader), read_config(path, reader)


@pytest.mark.parametrize("seed", [0, 1])
def test_q8_head_equals_dequantized_matmul(tiny_model_factory, seed):
    path = tiny_model_factory(tensor_type="Q8_0", tied_embeddings=True)
    store, cfg = _store(path)
    head = Q8Head.from_tensor(store.info("token_embd.weight"))
    if head is None or head.op is None:
        pytest.skip("this torch has no quantized embedding_bag kernel")
    w = torch.from_numpy(store.matrix("token_embd.weight"))
    x = torch.randn(1, cfg.hidden, generator=torch.Generator().manual_seed(seed))
    want = (x.double() @ w.double().T).float()
    got = head(x)
    assert got.shape == want.shape
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * float(want.abs().max()))
    assert head.nbytes < w.numel() * 4 / 3  # int8 values plus one float32 scale per 32


def _model(store, cfg):
    """The forward pass with every FFN output zero (the head is what is tested)."""
    embed = Embedding(store)
    zero_ffn = lambda i, x, h, decode=None: np.zeros_like(x)  # noqa: E731
    return Transformer(store, cfg, 16, embed, zero_ffn, LmHead(store, cfg, embed))


def test_model_uses_q8_head_only_for_q8_files(tiny_model_factory):
    q8 = tiny_model_factory(tensor_type="Q8_0", tied_embeddings=True)
    f32 = tiny_model_factory(tensor_type="F32", tied_embeddings=False)
    store, cfg = _store(q8)
    m = _model(store, cfg)
    if m.head.q8 is None:
        pytest.skip("this torch has no quantized embedding_bag kernel")
    one = m.forward([3, 4, 5])  # last token only: the Q8 head
    m.cache.reset()
    every = m.forward([3, 4, 5], all_logits=True)  # a batch: the float32 GEMM
    np.testing.assert_allclose(one[0], every[-1], rtol=1e-5, atol=1e-5)
    store, cfg = _store(f32)
    assert _model(store, cfg).head.q8 is None


@pytest.mark.parametrize("tensor_type,tied", [("Q8_0", True), ("F32", False)])
def test_head_rows_side_by_side_equal_the_whole_head(tiny_model_factory, tensor_type, tied):
    """Vocabulary ranges computed apart (as the coordinator and the workers do) and put side by
    side give the whole head's logits: Q8_0 blocks when the file has them, else float32."""
    path = tiny_model_factory(tensor_type=tensor_type, tied_embeddings=tied)
    store, cfg = _store(path)
    name = head_tensor_name(cfg.tied_embeddings)
    n_vocab = store.shape(name)[0]
    x = np.random.default_rng(0).standard_normal((1, cfg.hidden)).astype(np.float32)
    whole = HeadRows(store, name, 0, n_vocab)
    assert (whole.q8 is not None) == (tensor_type == "Q8_0" and Q8Head.from_tensor(store.info(name)) is not None)
    want = whole(x)
    assert want.shape == (n_vocab,)
    cuts = [0, 1, n_vocab // 3, n_vocab - 5, n_vocab]
    parts = [HeadRows(store, name, a, b) for a, b in zip(cuts, cuts[1:])]
    got = np.concatenate([p(x) for p in parts])
    if whole.q8 is not None:  # the bag kernel sums each row on its own: bit for bit
        np.testing.assert_array_equal(got, want)
    else:  # BLAS blocks by matrix size: the summation order may differ
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6 * np.abs(want).max())
    dense = x.astype(np.float64) @ store.matrix(name).astype(np.float64).T
    np.testing.assert_allclose(got, dense[0], rtol=1e-5, atol=1e-5 * np.abs(dense).max())
