"""How fast one core reads the bytes an input-major twin's product picks, with no arithmetic:
the memory side of the twins' speed (docs/KERNELS.md, "Input-major twins": "What bounds the
twins' read rate").

    python scripts/bench_twin_reads.py [--lines 22 44] [--fractions 1 0.5 0.3] [--pair]

A twin holds, per group of 32 inputs, 32 channel rows of `lines` 64-byte lines (a process's
share of the 1.1B shape: 22 for fused gate+up Q4_0 rows of one of two processes, 16 for down,
10 for fused q/k/v). A product reads the active channels' rows of each group, line l of every
active row, then line l + 1 (cols_*.c), prefetching into L2 the items 16 ahead. This writes a
small C program (the access patterns only: one 8-byte load a line) to a temporary folder,
compiles it with the system's C compiler, and prints GB/s of the bytes each pattern needs, over
512 MB of huge pages, best of 5:

- seq: every line in address order (the dense X16 stream);
- twin: the twins' order, the active channels of each group drawn at random (as TEAL's
  inputs nearly are: scripts/input_clustering.py);
- twin, clustered: the same number of active channels, the first ones of each group (what a
  perfect grouping of co-active inputs would give);
- line-major: line l of the group's 32 channels side by side (one stream with holes);
- channel-major: each active channel's row whole, one after another.

`--ahead 0` turns the software prefetches off (every pattern but seq, which has none).
`--pair` also runs two copies at once (one per core): a pattern that reads as fast in pairs as
alone is bound by one core's outstanding misses, not by the machine's bandwidth. Nothing here is
asserted anywhere; figures name the CPU and the date they came from (docs)."""
from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from coordinator.runtime.sparsity_level import machine  # noqa: E402  the CPU's name, as figures name it

SOURCE = r"""
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <sys/mman.h>
static double now(void) { struct timespec t; clock_gettime(CLOCK_MONOTONIC, &t); return t.tv_sec + t.tv_nsec * 1e-9; }
/* args: lines, active fraction, pattern (0 seq, 1 twin, 2 twin clustered, 3 line-major, 4 channel-major), ahead */
int main(int argc, char **argv) {
    int L = atoi(argv[1]), pat = atoi(argv[3]), ahead = atoi(argv[4]);
    double frac = atof(argv[2]);
    size_t gb = 32ull * L * 64, G = ((size_t)512 << 20) / gb, total = G * gb;
    uint8_t *buf = mmap(0, total, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (buf == MAP_FAILED) return 1;
    madvise(buf, total, MADV_HUGEPAGE);
    memset(buf, 1, total);
    uint32_t *masks = malloc(G * 4);
    srand(1);
    for (size_t g = 0; g < G; g++) {
        uint32_t m = 0;
        for (int j = 0; j < 32; j++) if (rand() < frac * RAND_MAX) m |= 1u << j;
        if (pat == 2) { int n = __builtin_popcount(m); m = n == 32 ? ~0u : (1u << n) - 1; }
        masks[g] = m;
    }
    uint64_t acc = 0;
    double best = 1e9, bytes = 0;
    for (int rep = 0; rep < 5; rep++) {
        double t = now();
        bytes = 0;
        if (pat == 0) {
            for (size_t o = 0; o < total; o += 64) acc += *(volatile uint64_t *)(buf + o);
            bytes = total;
        } else if (pat == 1 || pat == 2 || pat == 3) {  /* items (g, l), each the active channels' line l */
            size_t cs = pat == 3 ? 64 : (size_t)L * 64, ls = pat == 3 ? 32 * 64 : 64;
            for (size_t it = 0; it < G * L; it++) {
                size_t f = it + ahead;
                if (ahead && f < G * L)
                    for (uint32_t m = masks[f / L]; m; m &= m - 1)
                        __builtin_prefetch(buf + f / L * gb + __builtin_ctz(m) * cs + f % L * ls, 0, 2);
                const uint8_t *p = buf + it / L * gb + it % L * ls;
                for (uint32_t m = masks[it / L]; m; m &= m - 1) acc += *(volatile uint64_t *)(p + __builtin_ctz(m) * cs), bytes += 64;
            }
        } else {
            for (size_t g = 0; g < G; g++)
                for (uint32_t m = masks[g]; m; m &= m - 1) {
                    const uint8_t *row = buf + g * gb + __builtin_ctz(m) * (size_t)L * 64;
                    for (int l = 0; l < L; l++) {
                        if (ahead) __builtin_prefetch(row + (l + ahead) * 64, 0, 2);
                        acc += *(volatile uint64_t *)(row + l * 64), bytes += 64;
                    }
                }
        }
        double dt = now() - t;
        if (dt < best) best = dt;
    }
    printf("%.2f %llu\n", bytes / best / 1e9, (unsigned long long)(acc & 1));
    return 0;
}
"""

PATTERNS = {"twin": 1, "twin, clustered": 2, "line-major": 3, "channel-major": 4}


def build(folder: Path) -> Path:
    src, exe = folder / "reads.c", folder / "reads"
    src.write_text(SOURCE)
    subprocess.run(["cc", "-O2", "-std=gnu11", "-o", str(exe), str(src)], check=True)
    return exe


def run(exe: Path, lines: int, frac: float, pattern: int, ahead: int, copies: int) -> list[float]:
    args = [str(exe), str(lines), str(frac), str(pattern), str(ahead)]
    procs = [subprocess.Popen(args, stdout=subprocess.PIPE, text=True) for _ in range(copies)]
    return [float(p.communicate()[0].split()[0]) for p in procs]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--lines", type=int, nargs="+", default=[22, 44], help="64-byte lines a channel row")
    ap.add_argument("--fractions", type=float, nargs="+", default=[1.0, 0.5, 0.3])
    ap.add_argument("--ahead", type=int, default=16, help="items prefetched ahead (the kernels' cols_ahead)")
    ap.add_argument("--pair", action="store_true", help="also two copies at once, one a core")
    a = ap.parse_args()
    cpu = machine()["cpu"]
    with tempfile.TemporaryDirectory() as d:
        exe = build(Path(d))
        copies = [1, 2] if a.pair else [1]
        print(f"{cpu}; GB/s of the bytes each pattern needs, one core" + (" (and two copies at once)" if a.pair else ""))
        print("| pattern | lines a row | active | " + " | ".join(f"{c} cop{'y' if c == 1 else 'ies'}" for c in copies) + " |")
        print("|---|---|---|" + "---|" * len(copies))

        def row(name, lines, frac, pattern, ahead):
            got = [run(exe, lines, frac, pattern, ahead, c) for c in copies]
            cells = " | ".join(" + ".join(f"{v:.1f}" for v in g) for g in got)
            print(f"| {name} | {lines} | {frac:.0%} | {cells} |", flush=True)

        row("seq", a.lines[0], 1.0, 0, 0)
        for lines in a.lines:
            for frac in a.fractions:
                for name, p in PATTERNS.items():
                    if frac == 1.0 and p in (2, 4):  # the same bytes in the same order as twin / seq
                        continue
                    row(name, lines, frac, p, a.ahead)


if __name__ == "__main__":
    sys.exit(main())
