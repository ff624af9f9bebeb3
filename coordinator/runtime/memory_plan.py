"""What a run will hold in memory, worked out from the file's tensor table before anything is
loaded, and checked against what the machine has free: a plan that does not fit ends in one
line with the numbers, before any worker starts (Engine), and `sparseinfer info` prints it.

Where the bytes go (the kinds below are the plan's rows):
  copied     matrices the processes repack into memory of their own (fast mode's interleaved
             layouts: FileMatrix.for_fast_products / for_row_products); the file's pages are
             then dropped, so these bytes count once, split over the processes that hold them;
  twins      input-major copies of the matrices a sparsity level skips inputs of
             (sparsecore/input_sparsity.py), as many bytes as the rows they copy;
  converted  tensors of a type with no native kernel, converted at load into one that has
             (sparsecore.tensors.conversion): every process that uses one converts it whole;
  kv         the KV caches (kv_caches of them at full length; pages are only touched as
             positions are written, so this is the most they take) and the rope tables;
  runtime    each process's interpreter, libraries and scratch (measured: docs/MEMORY.md);
  mapped     the file's pages read in place (page cache: shared by the processes, and clean,
             so the kernel can drop them under pressure, at the price of reading them again);
  vram       what the GPU worker holds on a CUDA device (a routed model's most-routed experts
             under --vram-budget, as float16 copies): not RAM, and their share of the experts'
             tensors is then in none of the rows above.
The first five are anonymous memory nothing can reclaim: they must fit in what is available
(MemAvailable, and a cgroup's limit less its use). The mapped pages should too, or every token
reads part of the file from disk again: a one-line notice then, not a refusal.

SPARSEINFER_MEM_AVAILABLE (bytes, or with a K/M/G suffix) replaces the measured figure: to plan
for a smaller machine, or to start anyway where the estimate is too cautious.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

from sparsecore.errors import NotEnoughMemory

MIB, GB = 1 << 20, 1e9
# Resident memory of a process besides its weights and KV pages: the coordinator (interpreter,
# numpy, the tokenizer, scratch) and a CPU worker (interpreter, numpy, the kernels), and what
# torch adds where the coordinator imports it (weights other than the file's blocks, attention
# the native kernel does not compute). Measured after a 195-token prompt and 16 tokens, no torch
# (2-core EPYC, 2026-11-28): SmolLM2, Gemma 3 270M and the 1.1B shape held 72-77 MB beyond their
# copied weights over both processes; the constants were 320 + 64 MiB, which refused runs that fit.
COORDINATOR_RUNTIME = 96 * MIB
WORKER_RUNTIME = 64 * MIB
TORCH_RUNTIME = 224 * MIB


@dataclass
class MemoryPlan:
    copied: int = 0
    twins: int = 0
    converted: int = 0
    kv: int = 0
    runtime: int = 0
    mapped: int = 0
    processes: int = 1
    converted_types: dict = field(default_factory=dict)  # source type name -> (its bytes, converted bytes)
    converted_ffn: int = 0  # one copy of the converted FFN tensors: what each process with FFN rows holds
    # copied and twin bytes of the FFN tensors: what the layout cache can map instead of holding
    # (coordinator/runtime/residency.py), where the rest does not fit
    ffn_copied: int = 0
    cold: int = 0  # of those, what the residency leaves mapped from the layout cache (residency.py)
    vram: int = 0  # on the GPU worker's CUDA device (its experts), not in RAM
    available: int | None = None
    available_from: str = ""

    @property
    def anonymous(self) -> int:
        return self.copied + self.twins + self.converted + self.kv + self.runtime

    @property
    def total(self) -> int:
        return self.anonymous + self.mapped

    def rows(self) -> list[tuple[str, int, str]]:
        n = self.processes
        return [("copied", self.copied, "weights repacked for each process (interleaved layouts), mapped from "
                                        "the layout cache (or copied without one)"),
                ("twins", self.twins, "input-major copies for sparse decoding"),
                ("converted", self.converted, "tensors with no native kernel, converted at load"),
                ("kv", self.kv, "KV caches at full length, rope tables"),
                ("runtime", self.runtime, f"interpreters, libraries, scratch ({n} process{'es' if n > 1 else ''})"),
                ("mapped", self.mapped, "the file's pages read in place (page cache, shared)")] + (
            [("vram", self.vram, "the GPU worker's experts on its CUDA device (not RAM)")] if self.vram else [])

    def lines(self) -> list[str]:
        out = [f"{k:10s} {b / GB:7.3f} GB  {why}" for k, b, why in self.rows()]
        out.append(f"{'total':10s} {self.total / GB:7.3f} GB  ({self.anonymous / GB:.3f} GB that must fit, "
                   f"{self.mapped / GB:.3f} GB of file pages)")
        if self.cold:
            out.append(f"{'cold':10s} {self.cold / GB:7.3f} GB  of the copied FFN layouts mapped from the layout cache "
                       f"instead (they do not all fit): read from disk as tokens need them")
        if self.available is not None:
            out.append(f"{'available':10s} {self.available / GB:7.3f} GB  ({self.available_from})")
        return out

    @property
    def must_stay(self) -> int:
        """Anonymous memory that cannot be left to the page cache: all of it but the FFN's
        repacked layouts, which the layout cache maps from disk where they do not fit."""
        return self.anonymous - self.ffn_copied

    def check(self, path: Path, hints: list[str], cache: str = "") -> str | None:
        """Raise NotEnoughMemory (one line: the numbers and what would fit) if the memory that
        must stay does not fit (with a layout cache `cache`: all but the FFN's layouts, which it
        maps; without one: all of it); return a notice if part of the weights will be read from
        disk."""
        if self.available is None:
            return None
        if self.anonymous > self.available and not (cache and self.must_stay <= self.available):
            must = self.must_stay if cache else self.anonymous
            what = "that must stay in memory (all but the FFN's layouts)" if cache else "of memory"
            raise NotEnoughMemory(
                f"{path.name}: needs {must / GB:.2f} GB {what} ({self._parts()}) but "
                f"{self.available / GB:.2f} GB is available ({self.available_from})"
                + (f"; would fit: {'; '.join(hints)}" if hints else ""))
        if self.anonymous > self.available:
            return (f"note: {path.name}: {self.anonymous / GB:.2f} GB of weights and caches do not fit in the "
                    f"{self.available / GB:.2f} GB available ({self.available_from}): the FFN's least used layouts "
                    f"are mapped from the layout cache ({cache}) and read from disk as tokens need them")
        if self.total > self.available:
            return (f"note: {path.name}: {self.mapped / GB:.2f} GB of the file is read in place and "
                    f"{(self.total - self.available) / GB:.2f} GB of it will not stay in memory "
                    f"({self.available / GB:.2f} GB available): expect reads from disk every token")
        return None

    def _parts(self) -> str:
        return ", ".join(f"{b / GB:.2f} GB {k}" for k, b, _ in self.rows()[:5] if b)


def _size(text: str) -> int:
    text = text.strip().upper().rstrip("B")
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}.get(text[-1:], 1)
    return int(float(text.rstrip("KMGT")) * mult)


def available_memory() -> tuple[int | None, str]:
    """(bytes this run may take, where the figure comes from): MemAvailable, or the cgroup's
    limit less what it holds (page cache it could drop not counted), whichever is less."""
    env = os.environ.get("SPARSEINFER_MEM_AVAILABLE")
    if env:
        try:
            return _size(env), "SPARSEINFER_MEM_AVAILABLE"
        except ValueError:
            raise ValueError(f"SPARSEINFER_MEM_AVAILABLE={env!r}: not a size (e.g. 8G, 512M, 123456789)") from None
    best: tuple[int | None, str] = (None, "")
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                best = (int(line.split()[1]) * 1024, "MemAvailable")
    except OSError:
        pass
    cg = cgroup_free()
    if cg is not None and (best[0] is None or cg[0] < best[0]):
        best = cg
    return best


# A cgroup v1 limit of "none" is the largest page-aligned 64-bit number, never a real one.
_V1_UNLIMITED = 1 << 60


def cgroup_free(proc_cgroup: Path = Path("/proc/self/cgroup"), root: Path = Path("/sys/fs/cgroup")
                ) -> tuple[int, str] | None:
    """(bytes the tightest memory cgroup around this process has left, which file says so), or
    None where no group limits it: its limit less what it holds, page cache it could drop
    (inactive file pages) not counted. cgroup v2 (memory.max, every ancestor's) and v1 (the
    memory controller's memory.limit_in_bytes, with memory.stat's hierarchical limit): a v1
    machine's limit went unseen before, and a run under it was killed by the kernel instead of
    being refused. `proc_cgroup`, `root`: where to read (tests give others)."""
    try:
        lines = proc_cgroup.read_text().splitlines()
    except OSError:
        return None
    found = []
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        _, controllers, rel = parts
        if controllers == "" and parts[0] == "0":
            found.append(_v2_free(root, rel))
        elif "memory" in controllers.split(","):
            found.append(_v1_free(root / "memory", rel))
    found = [f for f in found if f is not None]
    return min(found) if found else None


def _ancestors(base: Path, rel: str) -> list[Path]:
    """The group's directory and its parents up to `base` (those that exist: inside a container
    the group's path may be the host's, and the container's own root its group)."""
    d, out = base / rel.strip("/"), []
    while True:
        if d.is_dir():
            out.append(d)
        if d == base or d == d.parent:
            return out or ([base] if base.is_dir() else [])
        d = d.parent


def _stat(d: Path) -> dict[str, int]:
    try:
        return {k: int(v) for k, v in (l.split() for l in (d / "memory.stat").read_text().splitlines())}
    except (OSError, ValueError):
        return {}


def _v2_free(base: Path, rel: str) -> tuple[int, str] | None:
    best = None
    for d in _ancestors(base, rel):
        try:
            limit = (d / "memory.max").read_text().strip()
            if limit == "max":
                continue
            free = int(limit) - int((d / "memory.current").read_text()) + _stat(d).get("inactive_file", 0)
        except (OSError, ValueError):
            continue
        if best is None or free < best[0]:
            best = (free, f"the cgroup's memory.max ({d / 'memory.max'})")
    return best


def _v1_free(base: Path, rel: str) -> tuple[int, str] | None:
    best = None
    for d in _ancestors(base, rel):
        try:
            limit = int((d / "memory.limit_in_bytes").read_text())
            used = int((d / "memory.usage_in_bytes").read_text())
        except (OSError, ValueError):
            continue
        stat = _stat(d)
        limit = min(limit, stat.get("hierarchical_memory_limit", limit))
        if limit >= _V1_UNLIMITED:
            continue
        free = limit - used + stat.get("total_inactive_file", stat.get("inactive_file", 0))
        if best is None or free < best[0]:
            best = (free, f"the cgroup's memory.limit_in_bytes ({d / 'memory.limit_in_bytes'})")
    return best


# Down matrices whose columns (one per neuron) a process holds a share of (FileLayer: columns_for)
FFN_COLUMN_SHARES = (".ffn_down.", ".ffn_down_exps.", ".ffn_down_shexp.")


def tensor_kinds(store, cfg, names: list[str], fast: bool, weights: str, row_layout: str,
                 sparse: bool, split_ffn: bool = False) -> dict[str, tuple[str, int]]:
    """{tensor name: (kind, bytes)} for the tensors a run reads: "copied", "converted" or
    "mapped", by the rules the loaders follow (FileMatrix.for_fast_products and
    for_row_products; TensorStore's conversions; layouts.columns_for). split_ffn: more than
    one process holds FFN neurons, so each copies its share of down's columns (keep_columns,
    in either mode and whatever the type: together the whole matrix), where a process holding
    them all reads them in place."""
    from sparsecore.kernels import R16_TYPES, X16_TYPES, blocked_rows, interleaving, supports
    from sparsecore.tensors import converted_size

    head = "token_embd.weight" if cfg.tied_embeddings else "output.weight"
    out: dict[str, tuple[str, int]] = {}
    for name in names:
        if not store.has(name):
            continue
        raw = store.by_name[name]
        if len(raw.shape) < 2 or weights != "gguf":
            out[name] = ("mapped" if weights == "gguf" else "converted", int(raw.n_bytes if weights == "gguf"
                         else 4 * int(raw.n_elements)))
            continue
        conv = converted_size(raw)
        t, nbytes = (raw.tensor_type, int(raw.n_bytes)) if conv is None else conv
        if conv is not None:
            out[name] = ("converted", nbytes)
            continue
        if not supports(t):
            out[name] = ("converted", 4 * int(raw.n_elements))  # float32: only for float files' odd types
            continue
        ffn = ".ffn_" in name
        if name == "token_embd.weight" and name != head:
            kind = "mapped"  # rows looked up one by one
        elif not fast:
            kind = "mapped"
        elif ffn and ((".ffn_up." in name and row_layout != "gate+up") or (".ffn_gate." in name and not row_layout)):
            kind = "copied" if (sparse and int(t) in R16_TYPES and blocked_rows()) else "mapped"
        else:
            kind = "copied" if int(t) in X16_TYPES and interleaving(t) else "mapped"
        if split_ffn and any(d in name for d in FFN_COLUMN_SHARES):
            kind = "copied"
        out[name] = (kind, nbytes)
    return out


def plan_memory(store, cfg, names: list[str], *, fast: bool, weights: str, row_layout: str, sparse: bool,
                n_workers: int, ffn_processes: int, kv_shape=None, input_major: str = "",
                gpu_experts: list[float] | None = None, vram: int = 0) -> MemoryPlan:
    """The plan for a run: `names` the tensors it reads, `n_workers` the worker processes besides
    the coordinator, `ffn_processes` the processes that hold FFN rows (each converts a converted
    FFN tensor whole), `kv_shape` the shared KV pool's KvShape (None: one private cache the size
    of cfg at ctx, passed as a KvShape too), `input_major` which matrices get twins
    (sparsecore/input_sparsity.py: "", "down", "all"). `gpu_experts`: per layer the share of a
    routed model's experts the GPU worker holds on a CUDA device (the experts' tensors count that
    much less in RAM), `vram` their bytes there; the GPU worker then imports torch."""
    from sparsecore.kernels import input_major_bytes, input_major_type

    p = MemoryPlan(processes=1 + n_workers, vram=vram)

    def in_ram(name: str, nbytes: int) -> int:
        """A tensor's bytes less the GPU worker's experts' share of them (on CUDA)."""
        if gpu_experts is None or "_exps." not in name:
            return nbytes
        return int(nbytes * (1.0 - gpu_experts[int(name.split(".")[1])]))

    twinned = (".ffn_down.", ".ffn_down_exps.") if input_major == "down" else (
        ".ffn_gate.", ".ffn_up.", ".ffn_down.", ".attn_q.", ".attn_k.", ".attn_v.", ".attn_output.") \
        if input_major == "all" else ()
    head = "token_embd.weight" if cfg.tied_embeddings else "output.weight"
    for name in names:
        if not store.has(name) or not input_major_type(store.by_name[name].tensor_type):
            continue
        if any(t in name for t in twinned) or (input_major == "all" and name == head):
            n = in_ram(name, input_major_bytes(store.by_name[name].tensor_type, int(store.by_name[name].n_bytes)))
            p.twins += n
            p.ffn_copied += n if ".ffn_" in name else 0
    for name, (kind, nbytes) in tensor_kinds(store, cfg, names, fast, weights, row_layout, sparse,
                                             split_ffn=ffn_processes > 1).items():
        nbytes = in_ram(name, nbytes)
        if kind == "converted":
            copies = ffn_processes if ".ffn_" in name else 1
            p.converted += copies * nbytes
            p.converted_ffn += nbytes if ".ffn_" in name else 0
            src = store.by_name[name].tensor_type.name
            have, conv = p.converted_types.get(src, (0, 0))
            p.converted_types[src] = (have + int(store.by_name[name].n_bytes), conv + nbytes)
        else:
            setattr(p, kind, getattr(p, kind) + nbytes)
            p.ffn_copied += nbytes if kind == "copied" and ".ffn_" in name else 0
    if kv_shape is not None:
        p.kv = kv_shape.size
    torch = TORCH_RUNTIME if coordinator_torch(store, cfg, weights) else 0
    p.runtime = COORDINATOR_RUNTIME + n_workers * WORKER_RUNTIME + torch + (TORCH_RUNTIME if vram else 0)
    p.available, p.available_from = available_memory()
    return p


def coordinator_torch(store, cfg, weights: str) -> bool:
    """Whether the coordinator will import torch: float copies of the weights, or an attention
    the native kernel does not compute (sparsecore.attn_shard.native_attention)."""
    from sparsecore.attn_shard import native_attention

    return weights != "gguf" or not native_attention(store, cfg)


def fit_hints(p: MemoryPlan, kv_shape, ctx: int, n_workers: int) -> list[str]:
    """What would fit in p.available: a shorter context, fewer workers."""
    if p.available is None:
        return []
    hints = []
    over = p.anonymous - p.available
    if kv_shape is not None and p.kv > over and ctx > 256:
        per_pos = max(1, p.kv // max(1, kv_shape.max_ctx))
        fit = (p.kv - over) // per_pos // 256 * 256
        if fit >= 256:
            hints.append(f"--ctx {fit}")
    per_worker = WORKER_RUNTIME + p.converted_ffn  # what one worker fewer saves
    fewer = -(-over // per_worker)
    if n_workers - fewer >= 1:
        hints.append(f"--cpu-workers {n_workers - fewer}")
    hints.append("a smaller type of the model (fewer bits per weight)")
    return hints
