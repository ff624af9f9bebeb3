#!/usr/bin/env python3
"""Start-up time: process start to model ready, to the first token, and to exit, of
`sparseinfer generate -p Hi -n 1` (interleaved A/B), with llama.cpp's load as the yardstick.

    python scripts/bench_startup.py [-m MODEL.gguf] [--runs 7] [--tree A_DIR --tree B_DIR]
                                    [--llamacpp] [-- EXTRA GENERATE OPTIONS, e.g. --sparsity 0]

Each --tree is a checkout (its root goes first on PYTHONPATH; default: this one), so two
commits compare in one run: `git worktree add /tmp/base <commit>` and build its kernels there.
Runs alternate tree by tree (A B A B ...), so a noisy neighbour hits both. Measured from just
before the process is spawned:
  ready: the prompt's echo reaches stdout (generate prints it once the engine has loaded and
         the prompt is tokenized);
  first: the first generated token's text reaches stdout;
  exit:  the process has exited (workers stopped);
  CPU:   user + system seconds of the process and the workers it waited for (all the work,
         whatever ran in parallel: steadier than the times when other processes load the cores).
--llamacpp adds llama-cpp-python in a fresh interpreter: process start to `Llama(...)` returned
(its import included, as ours is), 2 threads, the same context size.
Printed: median and range of each over the runs, the load average before and after.
"""
from __future__ import annotations

import argparse
import os
import resource
import select
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
DEFAULT_MODEL = Path.home() / ".cache/sparseinfer/models/SmolLM2-135M-Instruct.Q4_1.gguf"
PROMPT = "Hi"

_LLAMA = """
import sys, time
from llama_cpp import Llama
Llama(sys.argv[1], verbose=False, n_ctx=int(sys.argv[2]), n_threads=2, n_threads_batch=2)
sys.stdout.write("ready\\n"); sys.stdout.flush()
"""


def _env(tree: Path) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "MKL_NUM_THREADS")}
    env["PYTHONPATH"] = str(tree) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    return env


def _time_marks(cmd: list[str], env: dict, cwd: Path, n_ready: int) -> dict:
    """Seconds from spawn until stdout holds its first byte (ready), more than `n_ready` bytes
    (first token), and until exit."""
    ru0 = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    p = subprocess.Popen(cmd, env=env, cwd=str(cwd), stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE)
    out, err, got = 0, b"", {}
    fds = {p.stdout.fileno(): "out", p.stderr.fileno(): "err"}
    while fds:
        ready, _, _ = select.select(list(fds), [], [], 60)
        for fd in ready:
            chunk = os.read(fd, 65536)
            if not chunk:
                del fds[fd]
            elif fds[fd] == "err":
                err += chunk
            else:
                out += len(chunk)
                now = time.perf_counter() - t0
                got.setdefault("ready", now)
                if out > n_ready:
                    got.setdefault("first", now)
    rc = p.wait()
    t_exit = time.perf_counter() - t0
    ru1 = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = ru1.ru_utime + ru1.ru_stime - ru0.ru_utime - ru0.ru_stime
    if rc != 0:
        raise SystemExit(f"{' '.join(cmd)} exited {rc}:\n{err.decode(errors='replace')[-2000:]}")
    return {"ready": got.get("ready", float("nan")), "first": got.get("first", float("nan")), "exit": t_exit,
            "cpu": cpu}


def _load() -> str:
    return " ".join(open("/proc/loadavg").read().split()[:3])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-m", "--model", default=str(DEFAULT_MODEL))
    ap.add_argument("--runs", type=int, default=7)
    ap.add_argument("--tree", action="append", default=None, help="a checkout to run (repeat for A/B)")
    ap.add_argument("--llamacpp", action="store_true", help="also time llama-cpp-python's load")
    ap.add_argument("--ctx", type=int, default=2048)
    ap.add_argument("extra", nargs="*", help="more generate options (after --)")
    a = ap.parse_args()
    trees = [Path(t).resolve() for t in (a.tree or [REPO])]
    sides = [(f"{t.name}", [sys.executable, "-m", "coordinator", "generate", "-m", a.model, "-p", PROMPT, "-n", "1",
                            "--no-stats", "--ctx", str(a.ctx), *a.extra], _env(t), t) for t in trees]
    if a.llamacpp:
        sides.append(("llama.cpp", [sys.executable, "-c", _LLAMA, a.model, str(a.ctx)], _env(REPO), REPO))
    print(f"model {Path(a.model).name}, {a.runs} interleaved runs, extra options {a.extra or '-'}; "
          f"load average before: {_load()}", flush=True)
    for t in trees:  # an installed copy has its bytecode; a checkout run with this set compiles every start
        if os.environ.get("PYTHONDONTWRITEBYTECODE") and not (t / "coordinator" / "__pycache__").is_dir():
            print(f"note: {t.name} has no bytecode caches and PYTHONDONTWRITEBYTECODE is set: each start compiles "
                  f"its modules (0.15-0.2 s here); `python -m compileall -q coordinator sparsecore protocol "
                  f"cpu_worker sparseinfer` in it measures what an installed copy gets", flush=True)
    res = {name: [] for name, *_ in sides}
    for _ in range(a.runs):
        for name, cmd, env, cwd in sides:
            res[name].append(_time_marks(cmd, env, cwd, 1 << 30 if name == "llama.cpp" else len(PROMPT)))
    print(f"load average after: {_load()}")
    print(f"{'':12s} {'ready s (median, range)':>26s} {'first token s':>22s} {'exit s':>22s} {'CPU s':>22s}")
    for name, runs in res.items():
        cols = []
        for key in ("ready", "first", "exit", "cpu"):
            v = [r[key] for r in runs if r[key] == r[key]]
            cols.append(f"{statistics.median(v):6.3f} ({min(v):.2f}-{max(v):.2f})" if v else f"{'-':>20s}")
        print(f"{name:12s} {cols[0]:>26s} {cols[1]:>22s} {cols[2]:>22s} {cols[3]:>22s}")


if __name__ == "__main__":
    main()
