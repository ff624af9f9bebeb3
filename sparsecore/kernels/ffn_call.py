"""The FFN call's record: ffn_step.c's ffn_call (and base.c's mat) as ctypes structures, filled
by field name and handed to _kernels.ffn_token / ffn_batch / moe_token by address. The layout is
checked at import against the one the C module reports (ffn_call_layout), field by field, as
attention.py checks ATTN_EXTRA: a field added or moved on one side only fails the import instead
of shifting every argument after it. ctypes rather than a numpy record: setting a field costs
about 50 ns against numpy's 2 us, and lockstep sets the threshold every layer and step."""
from __future__ import annotations

import ctypes

from . import _kernels


class Mat(ctypes.Structure):
    """base.c's mat: one matrix as the kernels address it (FileMatrix.args, by name)."""
    _fields_ = [("base", ctypes.c_void_p), ("stride", ctypes.c_int64), ("t", ctypes.c_int), ("layout", ctypes.c_int),
                ("cols", ctypes.c_void_p)]


def mat_record(m) -> Mat:
    """A FileMatrix's Mat (its args: base, stride, type, layout, twin), kept on it while its args
    stay the same object (FileMatrix.args is worked out once for the data held)."""
    args = m.args
    held = m.__dict__.get("_mat_record")
    if held is None or held[0] is not args:
        base, stride, t, layout, twin = args
        held = m._mat_record = (args, Mat(base=base, stride=stride, t=t, layout=layout, cols=twin or None))
    return held[1]


class FfnCall(ctypes.Structure):
    """ffn_step.c's ffn_call: what one fused FFN step reads (its comments say what each field is).
    `keep` holds the arrays its addresses point into; `address` is what the kernels take."""
    _fields_ = [("gate", Mat), ("up", Mat), ("down", Mat), ("down_t", ctypes.c_int), ("hidden", ctypes.c_int),
                ("own0", ctypes.c_int64), ("n_own", ctypes.c_int64), ("act", ctypes.c_int),
                ("threshold", ctypes.c_float), ("thr", ctypes.c_void_p), ("mask", ctypes.c_void_p),
                ("x", ctypes.c_void_p), ("B", ctypes.c_int), ("fast", ctypes.c_int), ("h", ctypes.c_void_p),
                ("any", ctypes.c_void_p), ("xq", ctypes.c_void_p), ("hq", ctypes.c_void_p),
                ("counts", ctypes.c_void_p), ("y", ctypes.c_void_p), ("bias", ctypes.c_void_p),
                ("limit", ctypes.c_float)]

    @property
    def address(self) -> int:
        return ctypes.addressof(self)


def _layout(cls) -> dict:
    return {"size": ctypes.sizeof(cls), **{name: getattr(cls, name).offset for name, _ in cls._fields_}}


_C_LAYOUT = _kernels.ffn_call_layout()
if {**_layout(FfnCall), "mat": _layout(Mat)} != _C_LAYOUT:
    raise ImportError(f"ffn_step.c's ffn_call {_C_LAYOUT} and FfnCall disagree: rebuild the kernels")
