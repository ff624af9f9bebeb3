"""The layout cache (sparsecore/kernels/layout_cache.py): repacked layouts written once, read back
(into memory, or mapped from their files) on later starts with the same bytes; a changed model,
another level or another build of the kernels never reads them; a truncated or damaged file is
made again with a one-line notice; an engine whose layouts do not all fit maps the FFN's least
used units from the cache and gives the same tokens as one that holds them all
(coordinator/runtime/residency.py)."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from coordinator.runtime.engine import Engine, EngineOptions
from coordinator.runtime.residency import cold_units
from coordinator.runtime.sampling import SamplingParams
from sparsecore.errors import NotEnoughMemory
from sparsecore.gguf_file import open_gguf
from sparsecore.kernels import FileMatrix, interleaving, layout_cache
from sparsecore.kernels.layout_cache import (HEADER, LARGE_READAHEAD_KB, LAYOUT_VERSION, LayoutCache, device_readahead_kb,
                                             model_directory, prune_stale)
from sparsecore.tensors import TensorStore
from tests.conftest import REPO, run_make_bench_model



def _conversions(path: Path) -> dict[str, np.ndarray]:
    """Every kind of conversion the loaders make, on one layer of the tiny model: their bytes."""
    store = TensorStore(path, open_gguf(path))
    gate, down = (FileMatrix(store.info(f"blk.0.ffn_{n}.weight")) for n in ("gate", "down"))
    thr = np.zeros(1, np.float32)
    own = range(32, 96)
    out = {
        "r16": gate.interleave_blocks(),
        "held": gate.keep_rows(own).held_copy(),
        "cols": down.keep_columns(own),
        "twin": gate.with_input_major(own, None, thr),
    }
    if interleaving(2):  # X16 rows, where the level has them (not the portable C)
        out |= {"x16": gate.for_fast_products(own), "cols_x16": layout_cache_columns(down, own)}
    return {k: (np.asarray(m.twin if k == "twin" else m.data).reshape(-1).copy(), m) for k, m in out.items()}


def layout_cache_columns(m, own):
    from sparsecore.kernels.layouts import columns_for

    return columns_for(m, own, True)


@pytest.fixture
def model(tiny_model_factory):
    return tiny_model_factory(tensor_type="Q4_0", n_ff=128)


def test_made_once_then_read_back_with_the_same_bytes(model, tmp_path):
    plain = _conversions(model)
    with layout_cache.using(tmp_path) as cache:
        first = _conversions(model)
        made = sorted(tmp_path.glob("*.lay"))
        assert cache.misses == len(plain) and cache.hits == 0 and len(made) == len(plain)
    stamps = {p: p.stat().st_mtime_ns for p in made}
    twin_bytes = plain["twin"][0].nbytes
    for copy_held, resident in PLACEMENTS.values():
        with layout_cache.using(tmp_path, copy_held) as cache:
            with cache.placing(resident):
                again = _conversions(model)
            assert cache.hits == len(plain) and cache.misses == 0
            # held: copied into memory, or mapped whole but for the twin (huge pages); cold: mapped
            held_mapped, copied, cold = cache.held_mapped_bytes, cache.resident_bytes, cache.mapped_bytes
            if not resident:
                assert cold > 0 and copied == held_mapped == 0
            elif copy_held:
                assert copied > twin_bytes and held_mapped == cold == 0
            else:
                assert held_mapped > 0 and copied == twin_bytes and cold == 0
                assert all(_mapped_file(m.data).endswith(".lay") for k, (_, m) in again.items() if k != "twin")
                assert not _mapped_file(again["twin"][1].twin).endswith(".lay")
        for k, (data, m) in plain.items():
            same = (lambda a, b: np.array_equal(a[:40], b[:40]) and np.array_equal(a[64:], b[64:])) \
                if k == "twin" else np.array_equal  # a twin's threshold address is each one's own
            assert same(first[k][0], data) and m.args[2:4] == first[k][1].args[2:4], k
            got, gm = again[k]
            if k == "twin":  # the header's threshold address is this process's, its counters zero
                head = got[:64].view(np.int64)
                assert head[5] == gm.twin_threshold_held.ctypes.data and head[6] == head[7] == 0
                assert np.array_equal(got[64:], data[64:])
                assert np.array_equal(got[:40], data[:40])
            else:
                assert np.array_equal(got, data), k
    assert {p: p.stat().st_mtime_ns for p in made} == stamps  # nothing written again


# how a test reads the cache back: (copy_held, placing(resident))
PLACEMENTS = {"held-copied": (True, True), "held-mapped": (False, True), "cold": (False, False)}


def _product(m: FileMatrix) -> np.ndarray:
    cols = m.col_range or range(m.cols)
    x = np.random.default_rng(1).standard_normal(len(cols), dtype=np.float32)
    return m.matvec(x, rows=m.row_range or range(m.rows), cols=cols, fast=True)


def test_products_on_mapped_layouts_equal_the_made_ones(model, tmp_path):
    plain = _conversions(model)
    with layout_cache.using(tmp_path):
        _conversions(model)
    with layout_cache.using(tmp_path) as cache, cache.placing(False):
        mapped = _conversions(model)
    for k in [k for k in ("x16", "cols_x16", "cols", "held") if k in plain]:
        assert isinstance(mapped[k][1].data.base, mmap_type()) or mapped[k][1].data.base is not None
        np.testing.assert_array_equal(_product(plain[k][1]), _product(mapped[k][1]))


def _mapped_file(a: np.ndarray) -> str:
    """The file whose mapping holds a's first byte ("" for anonymous memory), by /proc/self/maps."""
    addr = a.ctypes.data
    for line in open("/proc/self/maps"):
        span, *rest = line.split(maxsplit=5)
        lo, hi = (int(x, 16) for x in span.split("-"))
        if lo <= addr < hi:
            return rest[4].strip() if len(rest) > 4 else ""
    raise AssertionError(f"address {addr:#x} is in no mapping")


def mmap_type():
    import mmap

    return mmap.mmap


# A cold product's check reads one page in 64 (not all of what may stay on disk): damage on a
# page it does not read is for the held placements, which sum all of it.
@pytest.mark.parametrize("damage,placement", [(d, p) for d in ("truncate", "header", "data", "unsampled data")
                                              for p in PLACEMENTS if d != "unsampled data" or p != "cold"])
def test_a_damaged_file_is_made_again_with_a_notice(model, tmp_path, capfd, damage, placement):
    copy_held, resident = PLACEMENTS[placement]
    plain = _conversions(model)
    with layout_cache.using(tmp_path):
        _conversions(model)
    files = sorted(tmp_path.glob("*.lay"))
    for p in files:
        size = p.stat().st_size
        with open(p, "r+b") as f:
            if damage == "truncate":
                f.truncate(size - 100)
            elif damage == "header":
                f.seek(20)
                f.write(b"\xff\xff\xff\xff")
            elif damage == "unsampled data":  # the last byte but one page's: only a full check sees it
                f.seek(size - 4096 - 1 if size > HEADER + 2 * 4096 else size - 1)
                b = f.read(1)
                f.seek(-1, 1)
                f.write(bytes([b[0] ^ 0x5A]))
            else:  # the first data page: read by the full check and by the mapped one's sample
                f.seek(HEADER)
                b = f.read(1)
                f.seek(HEADER)
                f.write(bytes([b[0] ^ 0x5A]))
    capfd.readouterr()
    with layout_cache.using(tmp_path, copy_held) as cache, cache.placing(resident):
        again = _conversions(model)
    err = capfd.readouterr().err.splitlines()
    assert cache.rebuilt == len(files) and cache.hits == 0
    assert len([l for l in err if "damaged or stale, made again" in l]) == len(files)
    for k, (data, _) in plain.items():
        assert np.array_equal(again[k][0][64:] if k == "twin" else again[k][0], data[64:] if k == "twin" else data)
    with layout_cache.using(tmp_path) as cache:  # and the made-again files are good
        _conversions(model)
        assert cache.hits == len(files) and cache.rebuilt == 0


def _resident_pages(m, n: int) -> int:
    """How many of the first n bytes' pages of map m are in the page cache (mincore)."""
    import ctypes
    import mmap

    libc = ctypes.CDLL(None, use_errno=True)
    pages = -(-n // mmap.PAGESIZE)
    vec = (ctypes.c_ubyte * pages)()
    addr = ctypes.addressof(ctypes.c_char.from_buffer(m))
    assert libc.mincore(ctypes.c_void_p(addr), ctypes.c_size_t(n), vec) == 0, ctypes.get_errno()
    return sum(v & 1 for v in vec)


def test_a_cold_layer_reads_ahead_all_of_its_files(model, tmp_path, monkeypatch):
    """FileLayer.read_ahead (what Lockstep calls a layer early) brings every page of the
    layer's mapped files into the page cache; a held layer maps nothing to read."""
    import time

    from sparsecore.file_layer import FileLayer
    from sparsecore.kernels import FfnScratch

    monkeypatch.setenv("SPARSEINFER_COLD_READS", "ahead")
    store = TensorStore(model, open_gguf(model))
    own = range(0, 64)  # part of the neurons: down's columns are a product at every level, X16 or not
    scratch = FfnScratch(store.shape("blk.0.ffn_gate.weight")[1], len(own))
    with layout_cache.using(tmp_path):
        FileLayer(store, 0, own, True, scratch)  # made and written
    with layout_cache.using(tmp_path) as cache, cache.placing(False):
        cold = FileLayer(store, 0, own, True, scratch)
    assert cold.cold_maps and cold.reads_ahead
    import mmap

    for m, n in cold.cold_maps:  # unmapped from this process (clean pages: nothing lost), then
        m.madvise(mmap.MADV_DONTNEED)  # out of the page cache
    for p in tmp_path.glob("*.lay"):
        fd = os.open(p, os.O_RDONLY)
        os.fsync(fd)  # just written: the kernel drops only pages already on disk
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        os.close(fd)
    before = sum(_resident_pages(m, HEADER + n) for m, n in cold.cold_maps)
    cold.read_ahead()
    total = sum(-(-(HEADER + n) // 4096) for _, n in cold.cold_maps)
    deadline = time.monotonic() + 10
    while sum(_resident_pages(m, HEADER + n) for m, n in cold.cold_maps) < total and time.monotonic() < deadline:
        time.sleep(0.01)
    assert before < total and sum(_resident_pages(m, HEADER + n) for m, n in cold.cold_maps) == total
    with layout_cache.using(tmp_path):
        held = FileLayer(store, 0, own, True, scratch)
    assert held.cold_maps == [] and not held.reads_ahead


def test_cold_reads_follow_the_disks_readahead_unless_told(tmp_path, monkeypatch):
    monkeypatch.delenv("SPARSEINFER_COLD_READS", raising=False)
    ra = device_readahead_kb(tmp_path)
    assert ra is None or ra > 0
    assert LayoutCache(tmp_path / "a").reads_layers_ahead == (ra is not None and ra > LARGE_READAHEAD_KB)
    for told, ahead in (("ahead", True), ("faults", False)):
        monkeypatch.setenv("SPARSEINFER_COLD_READS", told)
        assert LayoutCache(tmp_path / told).reads_layers_ahead is ahead


def test_a_changed_model_or_level_has_another_directory(model, tmp_path):
    d = model_directory(tmp_path, model, "avx2")
    assert model_directory(tmp_path, model, "avx2") == d
    assert model_directory(tmp_path, model, "generic") != d
    d.mkdir(parents=True)
    (d / "x.lay").write_bytes(b"old")
    other_level = model_directory(tmp_path, model, "generic")
    other_level.mkdir(parents=True)
    st = model.stat()
    os.utime(model, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000))  # the model rewritten
    try:
        changed = model_directory(tmp_path, model, "avx2")
        assert changed != d and changed.parent == d.parent
        changed.mkdir(parents=True)
        same_file_other_level = changed.with_name(changed.name.replace("-avx2-", "-generic-"))
        other_layout = changed.with_name(changed.name.replace(f"-v{LAYOUT_VERSION}-", f"-v{LAYOUT_VERSION - 1}-"))
        for extra in (same_file_other_level, other_layout):
            extra.mkdir(parents=True)
        prune_stale(changed)
        assert not d.exists() and not other_level.exists() and changed.exists()  # the old version's, every level
        assert same_file_other_level.exists() and not other_layout.exists()  # another layout version: never read
    finally:
        os.utime(model, ns=(st.st_atime_ns, st.st_mtime_ns))


def _nothing_copied(model, plan, want, monkeypatch) -> bool:
    """At a level without repacked rows (the portable C) the FFN stays in the file's mapped pages:
    the plan copies nothing there, and a run with just what it says must fit decodes the same
    tokens. True where that is the case (the caller's check of mapped layouts does not apply)."""
    if plan.ffn_copied:
        return False
    assert not interleaving(2)
    monkeypatch.setenv("SPARSEINFER_MEM_AVAILABLE", str(plan.anonymous))
    assert _generate(model, layout_cache="off") == want
    return True


def _mapped_layouts(pid: int, root: Path) -> tuple[int, int]:
    """How many layout cache files under `root` process `pid` has mapped: (held, cold). A cold
    unit's map is advised sequential (VmFlags "sr" in /proc/PID/smaps), a held one's is not."""
    held, cold, path = set(), set(), None
    for line in Path(f"/proc/{pid}/smaps").read_text().splitlines():
        if line.endswith(".lay") and line.split()[-1].startswith(str(root)):
            path = line.split()[-1]
        elif line.startswith("VmFlags:"):
            if path is not None:
                (cold if "sr" in line.split()[1:] else held).add(path)
            path = None
    return len(held), len(cold)


def _generate(path, n=12, maps: list | None = None, **kw):
    with Engine(path, EngineOptions(**{"threads": 2, "cpu_workers": 1, "spin": False, **kw})) as eng:
        out = list(eng.generate([1, 2, 3, 4], n, SamplingParams(temperature=0.0), stop_at_eos=False))
        if maps is not None:
            maps.extend(_mapped_layouts(pid, kw["layout_cache"]) for pid in [os.getpid(),
                                                                              *(w.proc.pid for w in eng.pool.workers)])
        return out


def test_an_engine_starts_warm_from_the_cache_with_the_same_tokens(model, tmp_path):
    want = _generate(model, layout_cache="off")
    assert _generate(model, layout_cache=str(tmp_path)) == want
    files = {p: p.stat().st_mtime_ns for p in tmp_path.rglob("*.lay")}
    assert len(files) > 4  # both processes' conversions
    assert _generate(model, layout_cache=str(tmp_path)) == want
    assert {p: p.stat().st_mtime_ns for p in tmp_path.rglob("*.lay")} == files  # read, not made


@pytest.mark.parametrize("cold_reads", ["faults", "ahead"])
def test_layouts_that_do_not_fit_are_mapped_not_refused(model, tmp_path, monkeypatch, cold_reads):
    """Memory for all but part of the FFN's layouts: the plan maps the rest from the layout cache
    (a one-line notice), and the tokens are the unlimited run's, whether cold layers are read by
    their faults or ahead by the layer before. Without a cache it refuses in one line; with too
    little for what must stay it refuses too."""
    monkeypatch.setenv("SPARSEINFER_COLD_READS", cold_reads)
    want = _generate(model, layout_cache="off")
    eng = Engine(model, EngineOptions(threads=2, cpu_workers=1, layout_cache=str(tmp_path)), plan_only=True)
    plan = eng.memory
    if _nothing_copied(model, plan, want, monkeypatch):
        return
    monkeypatch.setenv("SPARSEINFER_MEM_AVAILABLE", str(plan.anonymous - plan.ffn_copied // 2))
    eng = Engine(model, EngineOptions(threads=2, cpu_workers=1, layout_cache=str(tmp_path)), plan_only=True)
    cold = cold_units(eng.memory, eng.store, eng.cfg)
    assert cold is not None and cold.any() and cold.shape == (eng.cfg.n_layers, 1)
    for _ in range(2):  # cold (made and written), then warm (mapped from the files)
        maps = []
        # lockstep: where a cold layer is read ahead by the one before it (Lockstep.cold_reads)
        assert _generate(model, maps=maps, layout_cache=str(tmp_path), decode_path="lockstep", spin=True) == want
        # the coordinator's and the worker's cold parts are mapped, what they hold read into memory
        assert all(cold > 0 and held == 0 for held, cold in maps), maps
    monkeypatch.delenv("SPARSEINFER_MEM_AVAILABLE")
    maps = []
    assert _generate(model, maps=maps, layout_cache=str(tmp_path)) == want
    assert all(held > 0 and cold == 0 for held, cold in maps), maps  # where everything fits, all held mapped
    with pytest.raises(NotEnoughMemory, match="must stay in memory"):
        monkeypatch.setenv("SPARSEINFER_MEM_AVAILABLE", str(plan.must_stay - (1 << 20)))
        Engine(model, EngineOptions(threads=2, cpu_workers=1, layout_cache=str(tmp_path)))
    monkeypatch.setenv("SPARSEINFER_MEM_AVAILABLE", str(plan.anonymous - plan.ffn_copied // 2))
    with pytest.raises(NotEnoughMemory):
        Engine(model, EngineOptions(threads=2, cpu_workers=1, layout_cache="off"))


def test_the_command_line_takes_the_option(model, tmp_path):
    r = subprocess.run([sys.executable, "-m", "coordinator", "generate", "-m", str(model), "-p", "hi", "-n", "2",
                        "--layout-cache", str(tmp_path), "-t", "2", "--spec", "off"],
                       capture_output=True, text=True, timeout=120, cwd=REPO)
    assert r.returncode == 0, r.stderr
    assert list(tmp_path.rglob("*.lay"))


def test_cold_experts_are_mapped_and_decode_the_same_tokens(tmp_path, tiny_model, monkeypatch):
    """A routed model whose experts do not all fit: the cold ones are mapped from the cache (read
    ahead once a token chooses them), the tokens those of a run that holds them all."""
    model = tmp_path / "moe.gguf"
    run_make_bench_model(["--shape", "tiny", "--layers", "2", "--quiet", "--type", "q4_0", "--arch", "qwen3moe",
                          "--tokenizer-from", str(tiny_model), "-o", str(model)])
    tmp_path = tmp_path / "layouts"
    want = _generate(model, layout_cache="off")
    plan = Engine(model, EngineOptions(threads=2, cpu_workers=1, layout_cache=str(tmp_path)), plan_only=True).memory
    if _nothing_copied(model, plan, want, monkeypatch):
        return
    monkeypatch.setenv("SPARSEINFER_MEM_AVAILABLE", str(plan.anonymous - plan.ffn_copied // 2))
    eng = Engine(model, EngineOptions(threads=2, cpu_workers=1, layout_cache=str(tmp_path)), plan_only=True)
    cold = cold_units(eng.memory, eng.store, eng.cfg)
    assert cold.shape == (eng.cfg.n_layers, eng.cfg.n_experts) and 0 < cold.sum() < cold.size
    for _ in range(2):
        maps = []
        assert _generate(model, maps=maps, layout_cache=str(tmp_path)) == want
        assert all(cold > 0 for _, cold in maps), maps



def test_info_says_what_is_read_from_disk(model, tmp_path):
    plan = Engine(model, EngineOptions(threads=2, cpu_workers=1, layout_cache=str(tmp_path)), plan_only=True).memory
    env = {**os.environ, "SPARSEINFER_MEM_AVAILABLE": str(plan.anonymous - plan.ffn_copied // 2)}
    r = subprocess.run([sys.executable, "-m", "coordinator", "info", "-m", str(model), "-t", "2", "--cpu-workers", "1"],
                       capture_output=True, text=True, timeout=120, cwd=REPO, env=env)
    assert r.returncode == 0, r.stderr
    if not plan.ffn_copied:  # the portable level copies nothing: all of it fits, nothing is cold
        assert "  fits\n" in r.stdout and "cold " not in r.stdout, r.stdout
        return
    assert "fits with" in r.stdout and "read from disk" in r.stdout and "cold " in r.stdout, r.stdout


def test_a_rewritten_model_is_never_read_from_its_old_layouts(tmp_path):
    """The same path and size, other weights: the engine makes the layouts again (the old
    directory removed) and gives the new model's tokens, those of a run without the cache."""
    from tests.fixtures.tiny_gguf import write_tiny_llama

    path, layouts = tmp_path / "m.gguf", tmp_path / "layouts"
    write_tiny_llama(path, tensor_type="Q4_0", n_ff=128, seed=0)
    first = _generate(path, layout_cache=str(layouts))
    old = {p.parent for p in layouts.rglob("*.lay")}
    size = path.stat().st_size
    write_tiny_llama(path, tensor_type="Q4_0", n_ff=128, seed=1)
    assert path.stat().st_size == size
    want = _generate(path, layout_cache="off")
    assert want != first  # other weights, other tokens: a stale cache would give `first`
    assert _generate(path, layout_cache=str(layouts)) == want
    assert not any(d.exists() for d in old) and list(layouts.rglob("*.lay"))


def test_processes_making_the_same_layout_at_once_keep_the_first_file(tmp_path):
    """Dealt experts: two processes may make the same conversion at once. The first file written
    stays (the one the first process has mapped), the second maps it too instead of renaming its
    own over it (which would leave two copies of the layout in memory), and no temporary is left."""
    first, second = LayoutCache(tmp_path), LayoutCache(tmp_path)
    data = (np.arange(3 * 4096 + 5) % 251).astype(np.uint8)
    alloc = lambda n: np.empty(n, np.uint8)  # noqa: E731
    seen = {}

    def fill_first(buf):
        buf[:] = data

    def fill_second(buf):  # while this one converts, the other makes the same and writes it first
        buf[:] = data
        seen["first"] = first.product("expert 3", data.size, alloc, fill_first)
        seen["inode"] = os.stat(first.path("expert 3")).st_ino

    got = second.product("expert 3", data.size, alloc, fill_second)
    assert os.stat(second.path("expert 3")).st_ino == seen["inode"]
    np.testing.assert_array_equal(got, data)
    np.testing.assert_array_equal(seen["first"], data)
    assert [p.name for p in tmp_path.iterdir()] == [first.path("expert 3").name]
