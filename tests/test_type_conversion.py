"""Types with no native kernel (the i-quants of 1 and 2 bits, TQ2_0, ...; IQ3_XXS and IQ3_S have kernels) are converted once at
load into a native block type of at most 8 bits, never float32 (sparsecore.tensors.conversion):
the values stay within the new type's rounding of gguf-py's dequantization, the engine says so
in one line naming the sizes, and the model generates. A type gguf-py cannot read at all (Q1_0)
is refused up front (tests/test_faults.py)."""
from __future__ import annotations

import numpy as np
import pytest
from gguf import GGMLQuantizationType as QT
from gguf.constants import GGML_QUANT_SIZES
from gguf.quants import dequantize

from coordinator.runtime.engine import Engine, EngineOptions
from sparsecore.gguf_file import SUPPORTED_TYPES, open_gguf
from sparsecore.kernels import supports
from sparsecore.tensors import TensorStore, conversion, converted_size
from tests.fixtures.tiny_gguf import write_tiny_llama

CONVERTED = [QT.IQ2_XXS, QT.IQ2_XS, QT.IQ2_S, QT.IQ1_S, QT.TQ2_0]
NATIVE_IQ = [QT.IQ3_XXS, QT.IQ3_S]  # once converted, now read natively (tests/test_kernels_iq3.py)
GATE = "blk.0.ffn_gate.weight"
ATTN = "blk.1.attn_q.weight"


def _model(tmp_path, t: QT):
    return write_tiny_llama(tmp_path / f"{t.name}.gguf", n_layers=2, hidden=256, n_ff=512, tensor_type="Q8_0",
                            override_types={GATE: t, ATTN: t})


@pytest.mark.parametrize("t", CONVERTED, ids=lambda t: t.name)
def test_converted_values_are_the_files_within_the_new_types_rounding(tmp_path, t):
    assert t in SUPPORTED_TYPES and not supports(t)
    store = TensorStore(_model(tmp_path, t), open_gguf(_model(tmp_path, t)))
    raw = store.raw(GATE)
    new = store.info(GATE)
    assert raw.tensor_type == t
    assert new.tensor_type in (QT.Q5_0, QT.Q8_0) and supports(new.tensor_type)  # never float32
    bits = 8 * GGML_QUANT_SIZES[t][1] / GGML_QUANT_SIZES[t][0]
    assert new.tensor_type == (QT.Q5_0 if bits <= 4 and supports(QT.Q5_0) else QT.Q8_0)
    assert converted_size(raw) == (new.tensor_type, new.n_bytes)
    want = dequantize(np.asarray(raw.data), t).reshape(512, 256)
    got = dequantize(np.asarray(new.data), new.tensor_type).reshape(512, 256)
    # gguf-py's round to nearest: within one step of each block of 32 (Q5_0: amax / 16, and the
    # value at the far end of the signed max clips by up to a step; Q8_0: amax / 127, half a step)
    step = np.abs(want.reshape(-1, 32)).max(axis=1, keepdims=True) / (16 if new.tensor_type == QT.Q5_0 else 127)
    err = np.abs(got - want).reshape(-1, 32)
    # (d is stored in f16: 16 steps of its rounding)
    assert np.all(err <= step * 1.02 + 1e-6), float((err / (step + 1e-12)).max())
    # the float paths read the file's own values, not the requantized ones
    np.testing.assert_array_equal(store.rows(GATE, np.arange(512)), want)


def test_no_conversion_for_native_or_float_types(tiny_model_factory):
    store = TensorStore(p := tiny_model_factory(tensor_type="Q4_0"), open_gguf(p))
    assert conversion(store.raw(GATE)) is None and store.info(GATE) is store.raw(GATE)


@pytest.mark.parametrize("t", NATIVE_IQ, ids=lambda t: t.name)
def test_iq3_types_are_read_as_the_file_holds_them(tmp_path, capfd, t):
    path = _model(tmp_path, t)
    store = TensorStore(path, open_gguf(path))
    raw = store.raw(GATE)
    assert supports(t) and conversion(raw) is None and store.info(GATE) is raw
    with Engine(path, EngineOptions(threads=2, cpu_workers=1)) as eng:
        out = list(eng.generate([1, 2, 3, 4], 4, stop_at_eos=False))
        plan = eng.memory
    assert len(out) == 4
    err = capfd.readouterr().err
    assert "no native kernel" not in err and t.name not in plan.converted_types


def test_a_converted_model_generates_and_says_what_it_converted(tmp_path, capfd):
    path = _model(tmp_path, QT.IQ2_S)
    with Engine(path, EngineOptions(threads=2, cpu_workers=1)) as eng:
        out = list(eng.generate([1, 2, 3, 4], 4, stop_at_eos=False))
        plan = eng.memory
    assert len(out) == 4
    err = capfd.readouterr().err
    lines = [line for line in err.splitlines() if "no native kernel" in line]
    assert len(lines) == 1, err
    assert "2 IQ2_S tensors" in lines[0] and "requantized once at load to Q" in lines[0] and " GB" in lines[0]
    assert "float32" not in err
    assert plan.converted > 0 and "IQ2_S" in plan.converted_types
