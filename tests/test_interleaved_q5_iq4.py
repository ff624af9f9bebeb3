"""The fused FFN step on interleaved (X16) gate, up and down of the types tests/test_interleaved's
fixture does not make (Q5_0, Q5_1, MXFP4: gguf-py's quantizer; IQ4_NL, IQ4_XS: tests/fixtures/quant_q5_iq4's):
ffn_token against the float64 FFN of gguf-py's dequantized blocks (fast mode's tolerance), the
file layout's step (the same integers, another float order), and ffn_batch equal to it token
for token, bit for bit, at every ISA level; IQ4_XS's down columns held on its 256-value blocks."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T

from sparsecore import kernels as K
from tests.fixtures.ffn_reference import ffn_dense_reference
from tests.fixtures import quant_q5_iq4 as Q
from tests.fixtures.kernel_checks import BATCHES, interleaved_shard
from tests.fixtures.kernel_files import ffn_matrices, ffn_shapes

# (hidden, n_ff, the shards' own neurons): IQ4_XS's rows of 256 values, its down columns held by whole blocks
SHAPES = {T.Q5_0: (96, 160, [range(0, 160), range(32, 96)]),
          T.Q5_1: (96, 160, [range(0, 160), range(128, 160)]),
          T.IQ4_NL: (96, 160, [range(0, 160), range(32, 96), range(128, 160)]),
          T.IQ4_XS: (256, 512, [range(0, 512), range(256, 512)]),
          T.MXFP4: (96, 160, [range(0, 160), range(32, 96)])}
CASES = [(t, own) for t, (_, _, owns) in SHAPES.items() for own in owns]


@pytest.fixture(scope="module")
def ffns(tmp_path_factory):
    rng = np.random.default_rng(44)
    out = {}
    for t, (hidden, n_ff, _) in SHAPES.items():
        out[t] = ffn_matrices(tmp_path_factory.mktemp(t.name) / "ffn.gguf",
                              {n: (Q.quantize(rng.standard_normal(s) * 0.3, t), t)
                               for n, s in ffn_shapes(hidden, n_ff).items()})
    return out


@pytest.mark.parametrize("t,own", CASES, ids=lambda v: v.name if isinstance(v, T) else str(v))
def test_interleaved_ffn_step_is_the_dense_ffn(ffns, isa, t, own):
    (m, w), (hidden, n_ff, _) = ffns[t], SHAPES[t]
    gate, up, down = interleaved_shard(m, own)
    assert gate.interleaved and up.interleaved and down.interleaved
    rng = np.random.default_rng(45)
    scratch, one = K.FfnScratch(hidden, len(own)), K.FfnScratch(hidden, len(own))
    owned = torch.zeros(n_ff, dtype=torch.float64)
    owned[own.start:own.stop] = 1
    for B in BATCHES:
        X = (rng.standard_normal((B, hidden)) * rng.uniform(0.5, 2, (B, 1))).astype(np.float32)
        y, n = K.ffn_batch(gate, up, down, X, own, "silu", scratch, fast=True)
        assert n == B * len(own)
        for b in range(B):
            alone, nb = K.ffn_token(gate, up, down, X[b], own, "silu", one, fast=True)
            np.testing.assert_array_equal(y[b], alone, err_msg=f"B={B} token {b}")
            assert nb == len(own)
            want = ffn_dense_reference(torch.from_numpy(X[b].astype(np.float64))[None], w["gate"], w["up"],
                                       w["down"], "silu", owned)[0].numpy()
            assert np.abs(alone - want).max() <= 0.05 * (np.abs(want).max() + 1e-3)
            file_y, _ = K.ffn_token(m["gate"], m["up"], m["down"], X[b], own, "silu", one, fast=True)
            np.testing.assert_allclose(alone, file_y, rtol=1e-4, atol=1e-4 * np.abs(file_y).max())
