"""protocol.shm_layout: region arithmetic, segment creation/attach across processes, refusal of a
mismatched or corrupted header, and who unlinks the segment."""
from __future__ import annotations

import os
import stat
import struct
import subprocess
import sys
import textwrap
from multiprocessing import resource_tracker, shared_memory
from pathlib import Path

import numpy as np
import pytest

from protocol.messages import PROTOCOL_VERSION
from protocol.shm_layout import (HEADER_BYTES, MAGIC, SHM_PREFIX, LayoutError, SharedBuffers,
                                 ShmLayout)

REPO = Path(__file__).resolve().parent.parent

LAYOUTS = [
    ShmLayout(hidden=64, n_ff=160, max_tokens=1, n_slots=1),
    ShmLayout(hidden=64, n_ff=160, max_tokens=8, n_slots=3),
    ShmLayout(hidden=3, n_ff=7, max_tokens=5, n_slots=2),      # nothing is naturally aligned
    ShmLayout(hidden=576, n_ff=1536, max_tokens=256, n_slots=5, n_layers=30),
    ShmLayout(hidden=1, n_ff=1, max_tokens=1, n_slots=1),
]


def _seg_path(name: str) -> Path:
    return Path("/dev/shm") / name.lstrip("/")


@pytest.mark.parametrize("L", LAYOUTS, ids=str)
def test_layout_regions(L):
    regions = [  # (start, length)
        (0, HEADER_BYTES),
        (L.x_offset, 4 * L.max_tokens * L.hidden),
        (L.mask_offset, L.n_ff),
        (L.out_offset, 4 * L.n_slots * L.max_tokens * L.hidden),
        (L.thresholds_offset, 4 * L.n_layers),
        (L.request_offset, 64),  # doorbell: the request line, then one line per slot
    ] + [(L.slots_offset + 64 * i, 64) for i in range(L.n_slots)]
    for start, _ in regions:
        assert start % 64 == 0, (start, L)
    assert L.size % 64 == 0
    for (s0, n0), (s1, _) in zip(regions, regions[1:]):
        assert s0 + n0 <= s1, f"regions overlap: {(s0, n0)} then {s1}"
    end = regions[-1][0] + regions[-1][1]
    assert end <= L.size < end + 64
    assert len(L.header()) <= HEADER_BYTES


@pytest.mark.parametrize("L", LAYOUTS, ids=str)
def test_header_round_trip(L):
    buf = bytearray(HEADER_BYTES)
    buf[: len(L.header())] = L.header()
    assert ShmLayout.from_header(buf) == L
    assert bytes(buf[:8]) == MAGIC


@pytest.fixture
def layout():
    return ShmLayout(hidden=16, n_ff=40, max_tokens=4, n_slots=3)


@pytest.fixture
def owner(layout, no_leaks):
    b = SharedBuffers.create(layout)
    yield b
    if b.x is not None:
        b.close()
    assert not _seg_path(b.name).exists()


def _fill(b: SharedBuffers) -> None:
    L = b.layout
    b.x[:] = np.arange(L.max_tokens * L.hidden, dtype=np.float32).reshape(L.max_tokens, L.hidden) * 0.5
    b.mask[:] = (np.arange(L.n_ff) % 3 == 0).astype(np.uint8)
    for s in range(L.n_slots):
        b.out[s] = s + 1


def test_create_segment(owner, layout):
    assert owner.owner
    assert owner.name.startswith(SHM_PREFIX)
    assert len(owner.name) > len(SHM_PREFIX) + 8  # a random part
    p = _seg_path(owner.name)
    assert p.exists()
    st = os.stat(p)
    assert stat.S_IMODE(st.st_mode) == 0o600
    assert st.st_size >= layout.size
    assert owner.x.shape == (layout.max_tokens, layout.hidden) and owner.x.dtype == np.float32
    assert owner.mask.shape == (layout.n_ff,) and owner.mask.dtype == np.uint8
    assert owner.out.shape == (layout.n_slots, layout.max_tokens, layout.hidden)
    assert owner.out.dtype == np.float32
    # The header is written into the segment itself.
    assert ShmLayout.from_header(owner.shm.buf) == layout


def test_two_segments_have_different_names(layout, no_leaks):
    a, b = SharedBuffers.create(layout), SharedBuffers.create(layout)
    try:
        assert a.name != b.name
    finally:
        a.close()
        b.close()


def test_attach_same_process(owner, layout):
    _fill(owner)
    other = SharedBuffers.attach(owner.name, expect=layout)
    try:
        assert not other.owner
        assert other.layout == layout
        np.testing.assert_array_equal(other.x, owner.x)
        np.testing.assert_array_equal(other.mask, owner.mask)
        np.testing.assert_array_equal(other.out, owner.out)
        other.out[1, :2] = -7.0
        other.mask[5] = 9
        assert (owner.out[1, :2] == -7.0).all() and owner.out[1, 2:].min() == 2.0
        assert owner.mask[5] == 9
        # Views are distinct mappings of the same memory (not the owner's mapping handed back):
        # the writes above cross between them, their addresses do not overlap.
        assert not np.shares_memory(other.out, owner.out)
    finally:
        other.close()
    # Closing the attacher neither unlinks the segment nor disturbs the owner's views.
    assert _seg_path(owner.name).exists()
    assert owner.out[1, 0, 0] == -7.0


def test_attach_without_expect_reads_layout_from_header(owner, layout):
    other = SharedBuffers.attach(owner.name)
    try:
        assert other.layout == layout
    finally:
        other.close()


ATTACH_SCRIPT = textwrap.dedent("""
    import sys, numpy as np
    from protocol.shm_layout import SharedBuffers, ShmLayout
    name, slot, do_close = sys.argv[1], int(sys.argv[2]), sys.argv[3] == "1"
    L = ShmLayout(16, 40, 4, 3)
    b = SharedBuffers.attach(name, expect=L)
    # Report what the creator wrote, then write a known function of x into our slot.
    print(float(b.x.sum()), int(b.mask.sum()), float(b.out[slot].mean()), flush=True)
    b.out[slot] = b.x * 2 + slot
    if do_close:
        b.close()
""")


def _run_attacher(name: str, slot: int, close: bool) -> list[str]:
    r = subprocess.run([sys.executable, "-c", ATTACH_SCRIPT, name, str(slot), "1" if close else "0"],
                       cwd=REPO, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    return r.stdout.split()


@pytest.mark.parametrize("close", [True, False], ids=["closes", "just_exits"])
def test_attach_from_another_process(owner, layout, close):
    _fill(owner)
    slot = 2
    seen = _run_attacher(owner.name, slot, close)
    assert float(seen[0]) == pytest.approx(float(owner.x.sum()))
    assert int(seen[1]) == int(owner.mask.sum())
    assert float(seen[2]) == slot + 1
    np.testing.assert_array_equal(owner.out[slot], owner.x * 2 + slot)
    np.testing.assert_array_equal(owner.out[0], 1.0)  # other slots untouched
    np.testing.assert_array_equal(owner.out[1], 2.0)
    # The attacher's exit (its resource tracker included) must not unlink the creator's segment.
    assert _seg_path(owner.name).exists()
    again = SharedBuffers.attach(owner.name, expect=layout)
    again.close()


def test_plain_attach_would_unlink_at_exit(layout, no_leaks):
    """Control for the test above: without resource_tracker.unregister, Python (< 3.13) unlinks an
    attached segment when the attaching process exits. If this ever stops being true the
    unregister is unnecessary, but the test above still protects the behavior we need."""
    if sys.version_info >= (3, 13):
        pytest.skip("Python 3.13 changed resource tracking of attached segments")
    b = SharedBuffers.create(layout)
    try:
        code = ("import sys; from multiprocessing import shared_memory as s; "
                "m = s.SharedMemory(sys.argv[1]); m.close()")
        r = subprocess.run([sys.executable, "-c", code, b.name], capture_output=True, text=True, timeout=60)
        assert r.returncode == 0, r.stderr
        assert not _seg_path(b.name).exists()
    finally:
        b.close()  # unlink of an already-unlinked segment is tolerated
        # shm_unlink failed above, so Python never unregistered it: keep our tracker quiet.
        # (POSIX segments are registered under their name with the leading slash)
        resource_tracker.unregister("/" + b.name, "shared_memory")


def test_attach_mismatched_layout(owner, layout):
    for wrong in (ShmLayout(17, 40, 4, 3), ShmLayout(16, 41, 4, 3), ShmLayout(16, 40, 5, 3),
                  ShmLayout(16, 40, 4, 2)):
        with pytest.raises(LayoutError, match="does not match expected"):
            SharedBuffers.attach(owner.name, expect=wrong)
    assert _seg_path(owner.name).exists()


def test_attach_corrupted_magic(owner, layout):
    owner.shm.buf[0:8] = b"NOTSHMXX"
    with pytest.raises(LayoutError, match="magic") as e:
        SharedBuffers.attach(owner.name, expect=layout)
    assert "NOTSHMXX" in str(e.value)


def test_attach_corrupted_version(owner, layout):
    struct.pack_into("<I", owner.shm.buf, 8, PROTOCOL_VERSION + 5)
    with pytest.raises(LayoutError, match="version") as e:
        SharedBuffers.attach(owner.name, expect=layout)
    assert str(PROTOCOL_VERSION + 5) in str(e.value)


def test_attach_segment_too_small(no_leaks):
    """A header that claims more than the segment holds is refused, not mapped out of bounds."""
    claimed = ShmLayout(64, 160, 8, 3)
    shm = shared_memory.SharedMemory(SHM_PREFIX + "testsmall" + os.urandom(4).hex(), create=True, size=4096)
    try:
        shm.buf[:HEADER_BYTES] = claimed.header().ljust(HEADER_BYTES, b"\0")
        with pytest.raises(LayoutError, match="bytes"):
            SharedBuffers.attach(shm.name)
    finally:
        shm.close()
        shm.unlink()


def test_close_owner_unlinks_attacher_does_not(layout, no_leaks):
    owner = SharedBuffers.create(layout)
    name = owner.name
    other = SharedBuffers.attach(name, expect=layout)
    other.close()
    assert _seg_path(name).exists()
    owner.close()
    assert not _seg_path(name).exists()
    with pytest.raises(LayoutError, match="does not exist"):
        SharedBuffers.attach(name)


def test_a_step_word_carries_its_kind_and_layer():
    from protocol.shm_layout import StepKind, step_of, step_word

    for kind in StepKind:
        for layer in (0, 1, 29, 2047):
            word = step_word(kind, layer)
            assert step_of(word) == (kind, layer) and type(step_of(word)[0]) is StepKind
    # an FFN step of a layer and an attention step of the same layer are different words
    assert step_word(StepKind.FFN, 3) != step_word(StepKind.ATTENTION, 3)
    with pytest.raises(ValueError):
        step_word(StepKind.FFN, -1)
    with pytest.raises(ValueError, match="unknown step kind"):
        step_of(step_word(StepKind.LOCKSTEP) + (1 << 32) * 7)


def test_a_routed_models_expert_thresholds_follow_the_slots_and_round_trip():
    """ShmLayout.n_experts: one float per (layer, expert) after the doorbell's lines, in the header,
    dense (-1) in a new segment; a dense model's layout has none and keeps its size."""
    L = ShmLayout(hidden=16, n_ff=40, max_tokens=4, n_slots=3, n_layers=5, n_experts=7)
    assert L.expert_thresholds_offset == L.slots_offset + 64 * L.n_slots
    assert L.size >= L.expert_thresholds_offset + 4 * 5 * 7 and L.size % 64 == 0
    assert ShmLayout(16, 40, 4, 3, 5).size == ShmLayout(16, 40, 4, 3, 5).expert_thresholds_offset
    buf = bytearray(HEADER_BYTES)
    buf[: len(L.header())] = L.header()
    assert ShmLayout.from_header(buf) == L
    made = SharedBuffers.create(L)
    try:
        assert made.expert_thresholds.shape == (5, 7) and (made.expert_thresholds == -1).all()
        made.expert_thresholds[2, 3] = 0.25
        other = SharedBuffers.attach(made.name)
        assert other.expert_thresholds[2, 3] == np.float32(0.25)
        other.close()
    finally:
        made.close()
