"""protocol.messages: every message round-trips through msgpack, and bad input is refused clearly."""
from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import msgpack
import numpy as np
import pytest

from protocol import messages as M
from protocol.messages import MESSAGE_TYPES, PROTOCOL_VERSION, ProtocolError, decode, encode

REPO = Path(__file__).resolve().parent.parent

# One representative instance per message type; every field set away from its default so a
# field that is dropped or reordered on the wire shows up as a mismatch.
SAMPLES = {
    M.Hello: M.Hello(worker_id=3, role="cpu", pid=4242),
    M.Assign: M.Assign(
        model_path="/models/tiny é.gguf", shm_name="sparseinfer_0123abcd", slot=2, layers=[0, 1, 5],
        neurons=[np.array([0, 7, 9], np.int32).tobytes(), b"", np.arange(1000, dtype=np.int32).tobytes()],
        threads=4, device="cuda:1", weights="int8", spin_us=50000, wake_pipe="/run/a/slot2.wake",
        coordinator_pipe="/run/a/coordinator.wake", head_rows=[24576, 49152]),
    M.Ready: M.Ready(worker_id=0, role="gpu", pid=17, n_neurons=12345, device="cuda", load_s=1.25,
                     weight_bytes=2**33),
    M.WorkerFailed: M.WorkerFailed(worker_id=1, role="cpu", reason="OSError: no such file ☹"),
    M.Shutdown: M.Shutdown(),
}


def test_samples_cover_every_message_type():
    assert set(SAMPLES) == set(MESSAGE_TYPES)
    assert len(MESSAGE_TYPES) == len(set(MESSAGE_TYPES))


@pytest.mark.parametrize("cls", MESSAGE_TYPES, ids=lambda c: c.__name__)
def test_round_trip(cls):
    msg = SAMPLES[cls]
    data = encode(msg)
    back = decode(data)
    assert type(back) is cls
    assert back == msg
    assert encode(back) == data  # nothing changed form on the way (a tuple become a list, 1.0 become 1)
    # Field types survive too (== alone would accept 1 == 1.0 or True == 1).
    for f in dataclasses.fields(cls):
        assert type(getattr(back, f.name)) is type(getattr(msg, f.name)), f.name


@pytest.mark.parametrize("cls", [c for c in MESSAGE_TYPES if all(
    f.default is not dataclasses.MISSING or f.default_factory is not dataclasses.MISSING
    for f in dataclasses.fields(c))], ids=lambda c: c.__name__)
def test_round_trip_defaults(cls):
    msg = cls()
    assert decode(encode(msg)) == msg


def test_assign_bytes_fields_stay_bytes():
    msg = SAMPLES[M.Assign]
    back = decode(encode(msg))
    assert all(isinstance(b, bytes) for b in back.neurons)
    assert [np.frombuffer(b, np.int32).tolist() for b in back.neurons] == \
           [np.frombuffer(b, np.int32).tolist() for b in msg.neurons]
    assert isinstance(back.layers, list)


@pytest.mark.parametrize("cls", MESSAGE_TYPES, ids=lambda c: c.__name__)
def test_wire_form(cls):
    msg = SAMPLES[cls]
    raw = msgpack.unpackb(encode(msg), raw=False)
    assert isinstance(raw, list)
    assert raw[0] == PROTOCOL_VERSION
    assert raw[1] == MESSAGE_TYPES.index(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    assert len(raw) == 2 + len(names)
    # Fields follow in declaration order.
    for value, name in zip(raw[2:], names):
        assert value == getattr(msg, name), name


def test_bytes_travel_as_msgpack_bin():
    """Neuron indices go as msgpack bin and strings as str: raw=False keeps them apart."""
    raw = msgpack.unpackb(encode(SAMPLES[M.Assign]), raw=False)
    names = [f.name for f in dataclasses.fields(M.Assign)]
    neurons = raw[2 + names.index("neurons")]
    assert all(type(b) is bytes for b in neurons)
    assert neurons == SAMPLES[M.Assign].neurons
    assert raw[2 + names.index("model_path")] == "/models/tiny é.gguf"


def _wire(*items) -> bytes:
    return msgpack.packb(list(items), use_bin_type=True)


def test_wrong_version():
    data = _wire(PROTOCOL_VERSION + 1, MESSAGE_TYPES.index(M.Shutdown))
    with pytest.raises(ProtocolError, match=r"version") as e:
        decode(data)
    assert str(PROTOCOL_VERSION + 1) in str(e.value)


def test_unknown_kind():
    for kind in (len(MESSAGE_TYPES), -1, 999, "Hello"):
        with pytest.raises(ProtocolError, match=r"unknown message kind") as e:
            decode(_wire(PROTOCOL_VERSION, kind))
        assert repr(kind) in str(e.value) or str(kind) in str(e.value)


def test_wrong_field_count():
    kind = MESSAGE_TYPES.index(M.Hello)
    with pytest.raises(ProtocolError, match=r"Hello: expected 4 fields, got 2"):
        decode(_wire(PROTOCOL_VERSION, kind, 1, "cpu"))
    with pytest.raises(ProtocolError, match=r"Hello: expected 4 fields, got 5"):
        decode(_wire(PROTOCOL_VERSION, kind, 1, "cpu", 5, "s", 6))


def test_wrong_field_types_are_refused_at_decode():
    kind = MESSAGE_TYPES.index(M.Hello)
    with pytest.raises(ProtocolError, match=r"Hello.pid: wrong type str"):
        decode(_wire(PROTOCOL_VERSION, kind, 1, "cpu", "5", ""))
    failed = MESSAGE_TYPES.index(M.WorkerFailed)
    with pytest.raises(ProtocolError, match=r"WorkerFailed.reason: wrong type dict"):
        decode(_wire(PROTOCOL_VERSION, failed, 1, "cpu", {"a": 1}))
    with pytest.raises(ProtocolError, match=r"Shutdown: expected 0 fields, got 1"):
        decode(_wire(PROTOCOL_VERSION, MESSAGE_TYPES.index(M.Shutdown), "x"))


@pytest.mark.parametrize("data", [
    b"",
    b"\xc1",                                    # a byte msgpack never uses
    b"\x93\x01",                                # array of 3, truncated
    bytes(range(200, 256)) * 3,                 # random-looking garbage
    msgpack.packb([PROTOCOL_VERSION, 0, 1, "cpu", 5]) + b"\x00",  # trailing bytes
], ids=["empty", "reserved", "truncated", "garbage", "trailing"])
def test_garbage_bytes(data):
    with pytest.raises(ProtocolError, match=r"undecodable message"):
        decode(data)


@pytest.mark.parametrize("obj", [42, "hello", {"a": 1}, [PROTOCOL_VERSION], []],
                         ids=["int", "str", "map", "short", "emptylist"])
def test_not_an_array(obj):
    with pytest.raises(ProtocolError, match=r"not a \[version, kind, \.\.\.\] array"):
        decode(msgpack.packb(obj))


@pytest.mark.parametrize("obj", [None, 5, "Hello", {"worker_id": 1}, (1, 2),
                                 dataclasses.make_dataclass("Hello", [("worker_id", int)])(1)],
                         ids=["none", "int", "str", "dict", "tuple", "lookalike"])
def test_encode_non_message(obj):
    with pytest.raises(ProtocolError, match=r"not a protocol message"):
        encode(obj)


# Anything that could run code from data: pickle itself, numpy/torch loads that allow it.
UNSAFE_LOAD = re.compile(r"\b(import|from)\s+(c?pickle|dill|marshal)\b|\bpickle\.|allow_pickle\s*=\s*True"
                         r"|weights_only\s*=\s*False")


def test_the_pickle_pattern_catches_what_it_names():
    """The scan below is only as good as its pattern: each unsafe form matches, safe ones do not."""
    unsafe = ["import pickle", "from pickle import loads", "import dill", "data = pickle.loads(b)",
              "np.load(f, allow_pickle=True)", "torch.load(f, weights_only=False)", "import marshal"]
    safe = ["np.load(f)", "np.load(f, allow_pickle=False)", "torch.load(f, weights_only=True)", "import msgpack",
            "unpickled = 0"]
    assert [line for line in unsafe if not UNSAFE_LOAD.search(line)] == []
    assert [line for line in safe if UNSAFE_LOAD.search(line)] == []


def test_no_pickle_outside_tests():
    """No pickle crosses a process boundary: nothing in the runtime packages uses it."""
    offenders = []
    for pkg in ("protocol", "coordinator", "cpu_worker", "gpu_worker", "sparsecore"):
        files = sorted((REPO / pkg).rglob("*.py"))
        assert files, f"no python sources found in {pkg}/"
        for path in files:
            for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
                if UNSAFE_LOAD.search(line):
                    offenders.append(f"{path.relative_to(REPO)}:{n}: {line.strip()}")
    assert not offenders, "pickle used in runtime code:\n" + "\n".join(offenders)
