"""What scripts/bench_vs_llamacpp.py measures of a benchmarked process tree (CPU time, memory,
bytes read from disk) and the memory limit it can run a side under (--mem-limit): a cgroup made
for the run (v1's memory controller or v2), the page cache dropped first, as a machine with that
much memory would be, the same for both engines (issue 43: a model bigger than memory); and
what the machine is and how busy it is (cpu_name, machine_busy_s, busy_cores).
"""
from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

CLOCK_TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def _children_of() -> dict[int, list[int]]:
    kids: dict[int, list[int]] = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            kids.setdefault(ppid, []).append(int(d))
    return kids


def process_tree(pid: int) -> list[int]:
    kids, out, todo = _children_of(), [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        todo += kids.get(p, [])
    return out


def proc_field(path: str, key: str) -> int:
    """The number after `key` in a /proc file (kB in status, bytes in io), or 0."""
    try:
        with open(path) as f:
            for line in f:
                if line.startswith(key):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0


def tree_cpu_s(pid: int) -> float:
    """CPU seconds (user + system) used so far by `pid` and its live descendants."""
    total = 0
    for p in process_tree(pid):
        try:
            with open(f"/proc/{p}/stat") as f:
                v = f.read().rsplit(")", 1)[1].split()
            total += int(v[11]) + int(v[12])  # utime, stime (fields 14 and 15)
        except (OSError, IndexError, ValueError):
            pass
    return total / CLOCK_TICK


def tree_memory(pid: int) -> dict:
    """Peak RSS (VmHWM) and PSS now, each summed over `pid` and its descendants, in bytes."""
    pids = process_tree(pid)
    return dict(peak_rss=1024 * sum(proc_field(f"/proc/{p}/status", "VmHWM:") for p in pids),
                pss=1024 * sum(proc_field(f"/proc/{p}/smaps_rollup", "Pss:") for p in pids),
                processes=len(pids))


def tree_read_bytes(pid: int) -> int:
    """Bytes `pid` and its live descendants have had read from the disk (page faults on a mapped
    file included: /proc/PID/io read_bytes, what reached the block layer, not the page cache)."""
    return sum(proc_field(f"/proc/{p}/io", "read_bytes:") for p in process_tree(pid))


def drop_caches() -> None:
    """Write dirty pages out and drop the page cache (root): the next run reads from disk."""
    subprocess.run(["sync"], check=False)
    with open("/proc/sys/vm/drop_caches", "w") as f:
        f.write("1\n")


class MemoryLimit:
    """A cgroup of `limit` bytes for one benchmarked side and its descendants: cgroup v1's memory
    controller (memory.limit_in_bytes) where it is mounted, else v2 (memory.max, swap off). A
    process joins it before it runs anything (`join`, a Popen preexec_fn); `peak` is the group's
    high-water mark (page cache charged to it included), `oom_kills` what the kernel killed."""

    V1 = Path("/sys/fs/cgroup/memory")
    V2 = Path("/sys/fs/cgroup")

    def __init__(self, name: str, limit: int):
        self.v1 = (self.V1 / "memory.limit_in_bytes").exists()
        base = self.V1 if self.v1 else self.V2
        if not self.v1 and "memory" not in (self.V2 / "cgroup.controllers").read_text(errors="replace").split():
            raise RuntimeError("no cgroup memory controller (v1 or v2) on this machine")
        self.path = base / name
        self.path.mkdir()
        try:
            if self.v1:
                (self.path / "memory.limit_in_bytes").write_text(str(limit))
                for knob in ("memory.memsw.limit_in_bytes", "memory.swappiness"):  # no swap to hide in
                    try:
                        (self.path / knob).write_text(str(limit) if "memsw" in knob else "0")
                    except OSError:
                        pass
            else:
                (self.path / "memory.max").write_text(str(limit))
                try:
                    (self.path / "memory.swap.max").write_text("0")
                except OSError:
                    pass
        except BaseException:
            self.remove()
            raise
        self.limit = limit

    def join(self) -> None:
        """In the child, before exec: this process (and so all it starts) into the group."""
        (self.path / "cgroup.procs").write_text(str(os.getpid()))

    def peak(self) -> int:
        f = "memory.max_usage_in_bytes" if self.v1 else "memory.peak"
        try:
            return int((self.path / f).read_text())
        except (OSError, ValueError):
            return 0

    def oom_kills(self) -> int:
        try:
            text = (self.path / ("memory.oom_control" if self.v1 else "memory.events")).read_text()
        except OSError:
            return 0
        return next((int(l.split()[1]) for l in text.splitlines() if l.startswith("oom_kill ")), 0)

    def remove(self) -> None:
        try:
            self.path.rmdir()
        except OSError:  # a process left in it: the group goes when it does
            pass


# ---- the machine: what it is, how busy ----------------------------------------------------

def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), "?")
    except OSError:
        return "?"


def machine_busy_s() -> float:
    """CPU seconds all cores spent not idle since boot (/proc/stat)."""
    with open("/proc/stat") as f:
        v = [int(x) for x in f.readline().split()[1:]]
    return (sum(v) - v[3] - v[4]) / CLOCK_TICK


def busy_cores(seconds: float = 1.0) -> float | None:
    """Cores kept busy by other processes while we sit idle (Linux /proc/stat), else None."""
    def sample():
        with open("/proc/stat") as f:
            v = [int(x) for x in f.readline().split()[1:]]
        return sum(v), v[3] + v[4]  # total, idle + iowait
    try:
        t0, i0 = sample()
        time.sleep(seconds)
        t1, i1 = sample()
    except OSError:
        return None
    return (os.cpu_count() or 1) * (1 - (i1 - i0) / max(1, t1 - t0))
