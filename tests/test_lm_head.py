"""coordinator.lm_head: the Q8_0 lm_head for one decoded token equals the float32 product with
the dequantized matrix, and the attention model uses it exactly when the file stores Q8_0."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from coordinator.attention_model import AttentionModel
from coordinator.lm_head import Q8Head
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


def test_attention_model_uses_q8_head_only_for_q8_files(tiny_model_factory):
    q8 = tiny_model_factory(tensor_type="Q8_0", tied_embeddings=True)
    f32 = tiny_model_factory(tensor_type="F32", tied_embeddings=False)
    store, cfg = _store(q8)
    m = AttentionModel(store, cfg, 16)
    if m.head_q8 is None:
        pytest.skip("this torch has no quantized embedding_bag kernel")
    zero_ffn = lambda i, x, h: torch.zeros_like(x)  # noqa: E731
    one = m.forward([3, 4, 5], zero_ffn)  # last token only: the Q8 head
    m.reset()
    every = m.forward([3, 4, 5], zero_ffn, all_logits=True)  # a batch: the float32 GEMM
    np.testing.assert_allclose(one[0].numpy(), every[-1].numpy(), rtol=1e-5, atol=1e-5)
    store, cfg = _store(f32)
    assert AttentionModel(store, cfg, 16).head_q8 is None
