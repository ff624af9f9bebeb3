#!/usr/bin/env python3
"""Throughput of the HTTP server under concurrent streams, against llama.cpp's llama-server.

    python scripts/bench_server.py [-m MODEL.gguf] [--streams 1,2,4,8] [--tokens 64] [--rounds 2]
                                   [--llama-server PATH] [--arith fast|exact]

Both servers run in their own processes, started from this script's environment minus every
threading variable (neither inherits a policy meant for the other), with the same threads and
the same number of parallel slots (`--parallel N` / `-np N`, N = the largest stream count) and
the same context per slot. For each stream count, N clients each send one streamed completion
at the same moment (distinct prompts of about PROMPT_WORDS words, greedy, EOS
ignored so every request yields exactly --tokens tokens). Printed per server and stream count:
aggregate decode tokens/s while all N sequences decode, end-to-end tokens/s (prefill
included), and the median and worst time to first token when N requests arrive at once. Servers alternate per stream count and round (interleaved), so
a noisy neighbour hits both. llama-server is built by `scripts/setup-bench --server`.
"""
from __future__ import annotations

import os

BASE_ENV = dict(os.environ)  # before any import could change it

import argparse  # noqa: E402
import json  # noqa: E402
import random  # noqa: E402
import socket  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import threading  # noqa: E402
import time  # noqa: E402
import urllib.request  # noqa: E402
from pathlib import Path  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
from coordinator.cli.http_client import stream_completion  # noqa: E402  (standard library only)

DEFAULT_MODEL = Path.home() / ".cache/sparseinfer/models/SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_LLAMA_SERVER = REPO / ".bench" / "llama-server"
THREAD_ENV_PREFIXES = ("OMP_", "GOMP_", "KMP_", "MKL_", "OPENBLAS_", "GOTO_", "BLIS_", "VECLIB_")
PROMPT_WORDS = 24
WORDS = ("the of and to in is was for on that with as by at from his her an which were are this be had "
         "river mountain engine garden winter letter market doctor window silver history science music "
         "village ocean bridge forest journey question answer kingdom machine summer evening").split()


def clean_env() -> dict:
    return {k: v for k, v in BASE_ENV.items() if not k.startswith(THREAD_ENV_PREFIXES)}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(url: str, proc: subprocess.Popen, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:  # its last line of stderr says why (e.g. "Error: M: no such file")
            last = (proc.stderr.read().decode(errors="replace").strip().splitlines() or [""])[-1] if proc.stderr else ""
            raise SystemExit(f"{url}: server exited with {proc.returncode}: {last}")
        try:
            with urllib.request.urlopen(url + "/health", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.2)
    raise SystemExit(f"{url}: not healthy within {timeout:.0f}s")


class Server:
    def __init__(self, name: str, argv: list[str], url: str):
        self.name, self.url = name, url
        self.proc = subprocess.Popen(argv, env=clean_env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                     start_new_session=True)
        wait_healthy(url, self.proc)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def prompt(rng: random.Random) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(PROMPT_WORDS))


def one_request(url: str, text: str, tokens: int, out: list) -> None:
    """One streamed completion; appends (start, arrival time of each token's text)."""
    body = {"prompt": text, "max_tokens": tokens, "temperature": 0, "ignore_eos": True}
    t0 = time.perf_counter()
    arrivals = []
    for chunk in stream_completion(url, body, timeout=900):
        choices = chunk.get("choices") or []
        if choices and choices[0].get("text"):
            arrivals.append(time.perf_counter())
    out.append((t0, arrivals))


def run_round(url: str, streams: int, tokens: int, seed: int) -> dict:
    """`streams` clients start one request each at once. Decode tokens/s: the tokens that
    arrived while all `streams` sequences were decoding (after the last first token, before the
    first sequence ended), per second of that window: the steady state with exactly N
    sequences. End-to-end: all tokens over the whole round's wall time, prefill included."""
    rng = random.Random(seed)
    texts = [prompt(rng) for _ in range(streams)]
    results: list = []
    threads = [threading.Thread(target=one_request, args=(url, texts[i], tokens, results)) for i in range(streams)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    firsts = [a[0] for _, a in results]
    lo, hi = max(firsts), min(a[-1] for _, a in results)
    inside = sum(sum(1 for x in a if lo < x <= hi) for _, a in results)
    ttft = sorted(f - s for s, f in zip((r[0] for r in results), firsts))
    return {"tok_s": inside / (hi - lo) if hi > lo else float("nan"),
            "e2e_tok_s": sum(len(a) for _, a in results) / wall,
            "ttft_p50": statistics.median(ttft), "ttft_p99": ttft[-1] if len(ttft) < 100 else ttft[int(0.99 * len(ttft))]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-m", "--model", default=str(DEFAULT_MODEL))
    ap.add_argument("--streams", default="1,2,4,8")
    ap.add_argument("--tokens", type=int, default=128, help="completion tokens per request")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("-t", "--threads", type=int, default=os.cpu_count())
    ap.add_argument("--ctx", type=int, default=512, help="context per slot")
    ap.add_argument("--arith", choices=["exact", "fast"], default="fast", help="ours: sparseinfer serve --arith")
    ap.add_argument("--llama-server", default=str(DEFAULT_LLAMA_SERVER),
                    help="llama.cpp's llama-server binary ('none': ours only)")
    ap.add_argument("--spec", choices=("off", "ngram"), default=None,
                    help="ours: sparseinfer serve --spec (default: the server's own, ngram)")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    streams = [int(s) for s in a.streams.split(",")]
    slots = max(streams)
    servers: list[Server] = []
    try:
        port = free_port()
        servers.append(Server("sparseinfer", [sys.executable, "-m", "coordinator", "serve", "-m", a.model,
                                              "--port", str(port), "-t", str(a.threads), "--parallel", str(slots),
                                              "--ctx", str(a.ctx), "--arith", a.arith, "--queue", "64",
                                              *(["--spec", a.spec] if a.spec else [])],
                              f"http://127.0.0.1:{port}"))
        if a.llama_server != "none":
            if not Path(a.llama_server).exists():
                raise SystemExit(f"{a.llama_server}: no llama-server (build it with `scripts/setup-bench --server`, "
                                 f"or pass --llama-server none)")
            port = free_port()
            servers.append(Server("llama-server", [a.llama_server, "-m", a.model, "--host", "127.0.0.1", "--port",
                                                   str(port), "-t", str(a.threads), "-tb", str(a.threads),
                                                   "-np", str(slots), "-c", str(a.ctx * slots), "--no-webui",
                                                   "-lv", "0"],
                                  f"http://127.0.0.1:{port}"))
        for s in servers:  # warm-up: first requests pay for page faults and lazy set-up
            run_round(s.url, 1, 8, seed=999)
        res: dict = {s.name: {n: [] for n in streams} for s in servers}
        for r in range(a.rounds):
            for n in streams:
                for s in (servers if r % 2 == 0 else servers[::-1]):
                    res[s.name][n].append(run_round(s.url, n, a.tokens, seed=1000 * r + n))
        summary = {name: {n: {k: statistics.median(x[k] for x in rounds)
                              for k in ("tok_s", "e2e_tok_s", "ttft_p50", "ttft_p99")}
                          for n, rounds in per.items()} for name, per in res.items()}
        if a.json:
            print(json.dumps({"model": a.model, "tokens": a.tokens, "threads": a.threads, "slots": slots,
                              "rounds": res, "median": summary}, indent=1))
            return
        print(f"model {Path(a.model).name}, {a.threads} threads, {slots} slots, {a.tokens} tokens per request, "
              f"--arith {a.arith}, medians of {a.rounds} interleaved rounds")
        print(f"{'server':<13}{'streams':>8}{'decode tok/s':>14}{'x 1 stream':>12}{'e2e tok/s':>11}{'TTFT p50':>10}"
              f"{'max':>8}" + ("   decode vs llama-server" if len(servers) > 1 else ""))
        for name in summary:
            one = summary[name][streams[0]]["tok_s"]
            for n in streams:
                m = summary[name][n]
                vs = ""
                if len(servers) > 1 and name == "sparseinfer":
                    vs = f"   {m['tok_s'] / summary['llama-server'][n]['tok_s']:.2f}x"
                print(f"{name:<13}{n:>8}{m['tok_s']:>14.1f}{m['tok_s'] / one:>11.2f}x{m['e2e_tok_s']:>11.1f}"
                      f"{m['ttft_p50']:>9.2f}s{m['ttft_p99']:>7.2f}s{vs}")
    finally:
        for s in servers:
            s.close()


if __name__ == "__main__":
    main()
