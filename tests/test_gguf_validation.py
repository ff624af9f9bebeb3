"""Mutated GGUF files are refused from the header: one ModelFileError naming file, field and
value, with no work or allocation sized by the mutated numbers (issue 16, item 2): counted in
Python lines run and bytes allocated against loading the valid file, never timed."""
from __future__ import annotations

import math
import os
import shutil
import struct
import subprocess
import sys
import tracemalloc
from pathlib import Path

import gguf
import pytest

from sparsecore.config import read_config
from sparsecore.errors import ModelFileError
from sparsecore.gguf_file import open_gguf
from tests.fixtures.tiny_gguf import write_tiny_llama

REPO = Path(__file__).resolve().parent.parent
_FMT = {gguf.GGUFValueType.UINT32: "<I", gguf.GGUFValueType.INT32: "<i", gguf.GGUFValueType.FLOAT32: "<f",
        gguf.GGUFValueType.UINT64: "<Q"}


@pytest.fixture(scope="module")
def valid(tmp_path_factory) -> Path:
    return write_tiny_llama(tmp_path_factory.mktemp("valid") / "tiny.gguf", n_layers=2)


def _fresh_copy(src: Path, dst: Path) -> Path:
    """A copy of `src` at `dst`: open_gguf serves a file this process opened before from memory
    (by device, inode, size and mtime), and a copy is another file, parsed when opened."""
    shutil.copyfile(src, dst)
    return dst


def _kv_value_offset(reader, key: str) -> int:
    f = reader.fields[key]
    return f.offset + 8 + len(key.encode()) + 4


def set_kv(data: bytearray, reader, key: str, value) -> None:
    """Overwrite a scalar metadata value in place (same width as the file stores)."""
    f = reader.fields[key]
    struct.pack_into(_FMT[f.types[0]], data, _kv_value_offset(reader, key), value)


def _tensor_info(reader, name: str):
    t = next(t for t in reader.tensors if t.name == name)
    pos = t.field.offset + 8 + len(name.encode())
    n_dims = struct.unpack_from("<I", reader.data, pos)[0]
    dims_at = pos + 4
    type_at = dims_at + 8 * n_dims
    return t, pos, dims_at, type_at, type_at + 4


def set_tensor(data: bytearray, reader, name: str, *, offset=None, type_id=None, n_dims=None, dim0=None):
    t, ndims_at, dims_at, type_at, off_at = _tensor_info(reader, name)
    if offset is not None:
        struct.pack_into("<Q", data, off_at, offset)
    if type_id is not None:
        struct.pack_into("<I", data, type_at, type_id)
    if n_dims is not None:
        struct.pack_into("<I", data, ndims_at, n_dims)
    if dim0 is not None:
        struct.pack_into("<Q", data, dims_at, dim0)


def rel_offset(reader, name: str) -> int:
    t = next(t for t in reader.tensors if t.name == name)
    return int(t.data_offset) - int(reader.data_offset)


def _array_count_at(reader, key: str) -> int:
    return _kv_value_offset(reader, key) + 4  # after the element type


# name -> (mutation(data, reader, size), words the message must contain)
MUTATIONS = {
    "block_count_huge": (lambda d, r, n: set_kv(d, r, "llama.block_count", 2**32 - 1), ["llama.block_count", "4294967295"]),
    "block_count_zero": (lambda d, r, n: set_kv(d, r, "llama.block_count", 0), ["llama.block_count", "= 0"]),
    "block_count_mismatch": (lambda d, r, n: set_kv(d, r, "llama.block_count", 3), ["llama.block_count = 3", "blk.2"]),
    "ff_huge": (lambda d, r, n: set_kv(d, r, "llama.feed_forward_length", 2**31), ["llama.feed_forward_length", "2147483648"]),
    "ff_mismatch": (lambda d, r, n: set_kv(d, r, "llama.feed_forward_length", 128), ["ffn_gate", "feed_forward_length 128"]),
    "rope_dims_huge": (lambda d, r, n: set_kv(d, r, "llama.rope.dimension_count", 10**6), ["llama.rope.dimension_count", "1000000"]),
    "rope_dims_odd": (lambda d, r, n: set_kv(d, r, "llama.rope.dimension_count", 7), ["llama.rope.dimension_count", "even"]),
    "head_count_zero": (lambda d, r, n: set_kv(d, r, "llama.attention.head_count", 0), ["llama.attention.head_count", "= 0"]),
    "head_count_not_dividing": (lambda d, r, n: set_kv(d, r, "llama.attention.head_count", 3), ["head_count", "3"]),
    "head_count_kv_not_dividing": (lambda d, r, n: set_kv(d, r, "llama.attention.head_count_kv", 3), ["head_count_kv", "3"]),
    "hidden_mismatch": (lambda d, r, n: set_kv(d, r, "llama.embedding_length", 128), ["token_embd.weight", "128"]),
    "eps_nan": (lambda d, r, n: set_kv(d, r, "llama.attention.layer_norm_rms_epsilon", math.nan), ["layer_norm_rms_epsilon", "nan"]),
    "eps_negative": (lambda d, r, n: set_kv(d, r, "llama.attention.layer_norm_rms_epsilon", -1.0), ["layer_norm_rms_epsilon", "-1"]),
    "rope_base_zero": (lambda d, r, n: set_kv(d, r, "llama.rope.freq_base", 0.0), ["llama.rope.freq_base", "0"]),
    "rope_base_inf": (lambda d, r, n: set_kv(d, r, "llama.rope.freq_base", math.inf), ["llama.rope.freq_base", "inf"]),
    "context_zero": (lambda d, r, n: set_kv(d, r, "llama.context_length", 0), ["llama.context_length", "= 0"]),
    "vocab_mismatch": (lambda d, r, n: set_kv(d, r, "llama.vocab_size", 7), ["llama.vocab_size", "7"]),
    "misaligned_offset": (lambda d, r, n: set_tensor(d, r, "blk.0.ffn_up.weight", offset=rel_offset(r, "blk.0.ffn_up.weight") + 4),
                          ["blk.0.ffn_up.weight", "alignment"]),
    "overlapping": (lambda d, r, n: set_tensor(d, r, "blk.0.ffn_up.weight", offset=rel_offset(r, "blk.0.ffn_gate.weight")),
                    ["overlaps", "blk.0.ffn_gate.weight"]),
    "offset_out_of_file": (lambda d, r, n: set_tensor(d, r, "blk.1.attn_q.weight", offset=1 << 40),
                           ["blk.1.attn_q.weight", "needs bytes up to"]),
    "type_smaller": (lambda d, r, n: set_tensor(d, r, "blk.0.attn_k.weight", type_id=int(gguf.GGMLQuantizationType.F16)),
                     ["blk.0.attn_k.weight", "F16", "does not match"]),
    "type_bigger": (lambda d, r, n: set_tensor(d, r, "blk.0.attn_k.weight", type_id=int(gguf.GGMLQuantizationType.F64)),
                    ["blk.0.attn_k.weight", "F64", "overlaps"]),
    "type_unknown": (lambda d, r, n: set_tensor(d, r, "blk.0.attn_k.weight", type_id=999), ["blk.0.attn_k.weight", "999"]),
    "dim_zero": (lambda d, r, n: set_tensor(d, r, "blk.0.attn_v.weight", dim0=0), ["blk.0.attn_v.weight", "does not match"]),
    "dim_huge": (lambda d, r, n: set_tensor(d, r, "blk.0.attn_v.weight", dim0=2**62), ["blk.0.attn_v.weight"]),
    "n_dims_huge": (lambda d, r, n: set_tensor(d, r, "blk.0.attn_v.weight", n_dims=2**31), ["blk.0.attn_v.weight", "dimensions"]),
    "kv_count_huge": (lambda d, r, n: struct.pack_into("<Q", d, 16, 2**60), ["GGUF.kv_count"]),
    "tensor_count_huge": (lambda d, r, n: struct.pack_into("<Q", d, 8, 2**40), ["GGUF.tensor_count"]),
    "token_array_huge": (lambda d, r, n: struct.pack_into("<Q", d, _array_count_at(r, "tokenizer.ggml.tokens"), 2**60),
                         ["tokenizer.ggml.tokens", "does not fit"]),
    # the array's first string claims more bytes than the file has
    "token_length_huge": (lambda d, r, n: struct.pack_into("<Q", d, _array_count_at(r, "tokenizer.ggml.tokens") + 8, 2**50),
                          ["tokenizer.ggml.tokens element", "needs"]),
    "token_type_array_huge": (lambda d, r, n: struct.pack_into("<Q", d, _array_count_at(r, "tokenizer.ggml.token_type"), 2**40),
                              ["tokenizer.ggml.token_type", "does not fit"]),
    "key_length_huge": (lambda d, r, n: struct.pack_into("<Q", d, r.fields["llama.block_count"].offset, 2**50),
                        ["metadata key", "length"]),
}


def _mutated(valid: Path, tmp_path: Path, name: str) -> Path:
    mutate, _ = MUTATIONS[name]
    data = bytearray(valid.read_bytes())
    reader = gguf.GGUFReader(valid)
    mutate(data, reader, len(data))
    del reader
    out = tmp_path / f"{name}.gguf"
    out.write_bytes(bytes(data))
    return out


def load(path: Path):
    return read_config(path, open_gguf(path))


class _TooManySteps(BaseException):
    """Raised by the line counter past its budget: not an Exception, so no `except Exception`
    on the way turns it into a ModelFileError."""


def _cost(path: Path, step_budget: int | None = None) -> tuple[BaseException | None, int, int]:
    """load(path) -> (what it raised, Python lines it ran, peak bytes it allocated). Past
    `step_budget` lines it is stopped (_TooManySteps): a step count, not a clock. `path`: a file
    this process has not opened (one opened before is served from memory, not parsed)."""
    steps = 0

    def line(frame, event, arg):
        nonlocal steps
        if event == "line":
            steps += 1
            if step_budget is not None and steps > step_budget:
                raise _TooManySteps
        return line

    tracing = tracemalloc.is_tracing()
    if tracing:
        tracemalloc.reset_peak()
    else:
        tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    old_trace, raised = sys.gettrace(), None
    sys.settrace(lambda frame, event, arg: line)
    try:
        load(path)
    except ModelFileError as e:
        raised = e
    finally:
        sys.settrace(old_trace)
        peak = tracemalloc.get_traced_memory()[1] - before
        if not tracing:
            tracemalloc.stop()
    return raised, steps, peak


@pytest.fixture(scope="module")
def valid_cost(valid, tmp_path_factory) -> tuple[int, int]:
    """Lines run and bytes allocated to load the valid file (after a first load of another copy,
    so one-time imports do not count)."""
    d = tmp_path_factory.mktemp("cost")
    load(_fresh_copy(valid, d / "warm.gguf"))
    raised, steps, peak = _cost(_fresh_copy(valid, d / "cold.gguf"))
    assert raised is None
    return steps, peak


def test_valid_fixture_loads(valid):
    cfg = load(valid)
    assert cfg.n_layers == 2


@pytest.mark.parametrize("name", sorted(MUTATIONS))
def test_mutation_refused(valid, valid_cost, tmp_path, name):
    """Refusing a mutated file costs at most twice what loading the valid one does, in Python
    lines run and in bytes allocated: a loop or an allocation sized by a mutated count (2**32
    layers, 2**60 tokens, 2**40 tensors) would exceed both by orders of magnitude, and a loop
    is stopped at the line budget instead of running for hours."""
    bad = _mutated(valid, tmp_path, name)
    valid_steps, valid_peak = valid_cost
    try:
        raised, steps, peak = _cost(bad, step_budget=2 * valid_steps)
    except _TooManySteps:
        pytest.fail(f"refusing {name} ran more than {2 * valid_steps} Python lines "
                    f"(loading the valid file: {valid_steps})")
    assert isinstance(raised, ModelFileError), f"{name} was accepted"
    assert peak <= 2 * valid_peak, f"refusing {name} allocated {peak} bytes (the valid file: {valid_peak})"
    msg = str(raised)
    assert "\n" not in msg and str(bad) in msg
    for word in MUTATIONS[name][1]:
        assert word in msg, (word, msg)


@pytest.mark.parametrize("cut", [30, 200, 2000, -100])
def test_truncated(valid, tmp_path, cut):
    data = valid.read_bytes()
    bad = tmp_path / "cut.gguf"
    bad.write_bytes(data[:cut] if cut > 0 else data[:cut])
    with pytest.raises(ModelFileError) as e:
        load(bad)
    assert "truncated" in str(e.value) and "\n" not in str(e.value)


def test_all_mutations_under_memory_limit(valid, tmp_path):
    """Every mutation in one child process limited to 1 GiB of address space and 60 s: nothing
    the header declares gets allocated or looped over."""
    files = [str(_mutated(valid, tmp_path, n)) for n in sorted(MUTATIONS)]
    code = (
        "import resource, sys\n"
        "from sparsecore.config import read_config\n"
        "from sparsecore.gguf_file import open_gguf\n"
        "from sparsecore.errors import ModelFileError\n"
        "resource.setrlimit(resource.RLIMIT_AS, (1 << 30, 1 << 30))\n"
        "for p in sys.argv[1:]:\n"
        "    try:\n"
        "        read_config(p, open_gguf(p))\n"
        "        print('ACCEPTED', p)\n"
        "    except ModelFileError:\n"
        "        pass\n"
        "print('done')\n")
    env = dict(os.environ, PYTHONPATH=str(REPO))
    r = subprocess.run([sys.executable, "-c", code, *files], capture_output=True, text=True, timeout=60,
                       env=env, cwd=REPO)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.strip() == "done", r.stdout


def test_tokenizer_errors_are_one_line(valid, tmp_path):
    from coordinator.text.tokenizer import GGUFTokenizer
    data = bytearray(valid.read_bytes())
    reader = gguf.GGUFReader(valid)
    set_kv(data, reader, "tokenizer.ggml.eos_token_id", 10**6)
    del reader
    bad = tmp_path / "eos.gguf"
    bad.write_bytes(bytes(data))
    with pytest.raises(ValueError) as e:
        GGUFTokenizer.from_reader(open_gguf(bad))
    assert "tokenizer.ggml.eos_token_id" in str(e.value) and "1000000" in str(e.value)


@pytest.mark.parametrize("name", ["block_count_huge", "head_count_zero", "eps_nan", "overlapping", "token_array_huge"])
def test_cli_prints_one_line(valid, tmp_path, name):
    bad = _mutated(valid, tmp_path, name)
    env = dict(os.environ, PYTHONPATH=str(REPO))
    r = subprocess.run([sys.executable, "-m", "coordinator", "generate", "-m", str(bad), "-p", "hi", "-n", "1"],
                       capture_output=True, text=True, timeout=120, env=env, cwd=REPO)
    assert r.returncode != 0
    assert "Traceback" not in r.stderr, r.stderr
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and str(bad) in lines[0], r.stderr


def test_cli_tokenizer_error_one_line(valid, tmp_path):
    data = bytearray(valid.read_bytes())
    reader = gguf.GGUFReader(valid)
    set_kv(data, reader, "tokenizer.ggml.eos_token_id", 10**6)
    del reader
    bad = tmp_path / "eos.gguf"
    bad.write_bytes(bytes(data))
    env = dict(os.environ, PYTHONPATH=str(REPO))
    r = subprocess.run([sys.executable, "-m", "coordinator", "generate", "-m", str(bad), "-p", "hi", "-n", "1"],
                       capture_output=True, text=True, timeout=120, env=env, cwd=REPO)
    assert r.returncode != 0 and "Traceback" not in r.stderr
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and "tokenizer.ggml.eos_token_id" in lines[0], r.stderr


def test_a_header_without_the_vocabulary_reads_the_rest_alike(valid, tmp_path):
    """open_gguf(vocabulary=False), as workers open the model: the vocabulary arrays are stepped
    over, every other field and every tensor reads as in the full header; a vocabulary array
    cut short is still refused with the file's name. Once the whole header is parsed, it
    serves a process's second open without the vocabulary too (the coordinator's own shard)."""
    first_lean = _fresh_copy(valid, tmp_path / "lean_first.gguf")  # files this process never opened
    lean, full = open_gguf(first_lean, vocabulary=False), open_gguf(first_lean)
    assert open_gguf(first_lean, vocabulary=False) is lean and lean is not full
    first_full = _fresh_copy(valid, tmp_path / "full_first.gguf")
    whole = open_gguf(first_full)
    assert open_gguf(first_full, vocabulary=False) is whole and "tokenizer.ggml.tokens" in whole.fields
    assert "tokenizer.ggml.tokens" in full.fields and "tokenizer.ggml.tokens" not in lean.fields
    kept = [k for k in full.fields if k not in ("tokenizer.ggml.tokens", "tokenizer.ggml.scores",
                                                 "tokenizer.ggml.token_type", "tokenizer.ggml.merges")]
    assert sorted(lean.fields) == sorted(kept)
    for k in kept:
        if not k.startswith("GGUF."):
            assert lean.fields[k].contents() == full.fields[k].contents(), k
    assert [(t.name, int(t.data_offset), t.tensor_type) for t in lean.tensors] == \
        [(t.name, int(t.data_offset), t.tensor_type) for t in full.tensors]
    assert read_config(first_lean, lean) == read_config(first_lean, full)
    data = bytearray(valid.read_bytes())
    tokens = full.fields["tokenizer.ggml.tokens"]
    struct.pack_into("<Q", data, _kv_value_offset(full, "tokenizer.ggml.tokens") + 4, 1 << 40)  # element count
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(bytes(data))
    assert len(tokens.data) > 0
    with pytest.raises(ModelFileError, match="bad.gguf"):
        open_gguf(bad, vocabulary=False)


@pytest.mark.parametrize("endian", [gguf.GGUFEndian.LITTLE, gguf.GGUFEndian.BIG], ids=["little", "big"])
def test_long_arrays_decode_when_read_as_gguf_py_decodes_them(tmp_path, endian):
    """Arrays longer than LAZY_ARRAY (a vocabulary) are decoded on first read, not while the
    header is parsed: the same values as gguf-py's own reader, element and slice access alike,
    and a string that is not UTF-8 refused there too."""
    from sparsecore.gguf_file import LAZY_ARRAY

    n = LAZY_ARRAY + 45
    path = tmp_path / "arrays.gguf"
    w = gguf.GGUFWriter(str(path), "llama", endianess=endian)
    strings = [f"tok{i}" if i % 7 else f"ünï {i} ✓" for i in range(n)]
    w.add_array("t.strings", strings)
    w.add_array("t.floats", [i / 3 for i in range(n)])
    w.add_key_value("t.ints", list(range(-5, n - 5)), gguf.GGUFValueType.ARRAY, sub_type=gguf.GGUFValueType.INT32)
    w.add_array("t.short", [1.5, 2.5])
    w.add_array("t.bytes", [bytes([0xFF, 0xFE])] * n)  # not UTF-8
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    ours, theirs = open_gguf(path), gguf.GGUFReader(path)
    for key in ("t.strings", "t.floats", "t.ints", "t.short"):
        a, b = ours.fields[key], theirs.fields[key]
        # decoded when read: no parts (gguf-py's numpy view per element) built with the header
        assert (not a.parts) == (key != "t.short") and bool(b.parts), key
        assert a.types == b.types and len(a.data) == len(b.data), key
        assert a.contents() == pytest.approx(b.contents()), key
        assert a.contents(1) == pytest.approx(b.contents(1))
        assert a.contents(slice(1, 9)) == pytest.approx(b.contents(slice(1, 9)))
    assert ours.fields["t.strings"].contents()[:8] == strings[:8]
    with pytest.raises(UnicodeDecodeError):
        theirs.fields["t.bytes"].contents()
    with pytest.raises(UnicodeDecodeError):
        ours.fields["t.bytes"].contents()
