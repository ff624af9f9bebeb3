#!/usr/bin/env python3
"""Throughput of the HTTP server under concurrent streams, against llama.cpp's llama-server.

    python scripts/bench_server.py [-m MODEL.gguf] [--streams 1,2,4,8] [--tokens 64] [--rounds 2]
                                   [--llama-server PATH] [--arith exact|fast]

Both servers run in their own processes, started from this script's environment minus every
threading variable (neither inherits a policy meant for the other), with the same threads and
the same number of parallel slots (`--parallel N` / `-np N`, N = the largest stream count) and
the same context per slot. For each stream count, N clients each send REQS streamed
completions one after another (distinct prompts of about PROMPT_WORDS words, greedy, EOS
ignored so every request yields exactly --tokens tokens). Printed per server and stream count:
aggregate tokens/s (all completion tokens / wall time of the round, prefill included), and
p50/p99 time to first token. Servers alternate per stream count and round (interleaved), so
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
from coordinator.http_client import stream_completion  # noqa: E402  (standard library only)

DEFAULT_MODEL = Path.home() / ".cache/sparseinfer/models/SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_LLAMA_SERVER = REPO / ".bench" / "llama-server"
THREAD_ENV_PREFIXES = ("OMP_", "GOMP_", "KMP_", "MKL_", "OPENBLAS_", "GOTO_", "BLIS_", "VECLIB_")
PROMPT_WORDS = 24
REQS = 2
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
        if proc.poll() is not None:
            raise SystemExit(f"{url}: server exited with {proc.returncode}")
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
    body = {"prompt": text, "max_tokens": tokens, "temperature": 0, "ignore_eos": True,
            "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    first, n, usage = None, 0, None
    for chunk in stream_completion(url, body, timeout=900):
        if chunk.get("usage"):
            usage = chunk["usage"].get("completion_tokens")
        choices = chunk.get("choices") or []
        if choices and choices[0].get("text"):
            n += 1
            if first is None:
                first = time.perf_counter() - t0
    out.append((first if first is not None else float("nan"), usage or n))


def run_round(url: str, streams: int, tokens: int, seed: int) -> dict:
    rng = random.Random(seed)
    texts = [[prompt(rng) for _ in range(REQS)] for _ in range(streams)]
    results: list = []

    def client(i):
        for t in texts[i]:
            one_request(url, t, tokens, results)
    threads = [threading.Thread(target=client, args=(i,)) for i in range(streams)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    ttft = sorted(r[0] for r in results)
    total = sum(r[1] for r in results)
    return {"tok_s": total / wall, "ttft_p50": statistics.median(ttft),
            "ttft_p99": ttft[min(len(ttft) - 1, int(round(0.99 * (len(ttft) - 1))))], "tokens": total}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-m", "--model", default=str(DEFAULT_MODEL))
    ap.add_argument("--streams", default="1,2,4,8")
    ap.add_argument("--tokens", type=int, default=64, help="completion tokens per request")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("-t", "--threads", type=int, default=os.cpu_count())
    ap.add_argument("--ctx", type=int, default=512, help="context per slot")
    ap.add_argument("--arith", choices=["exact", "fast"], default="exact")
    ap.add_argument("--llama-server", default=str(DEFAULT_LLAMA_SERVER),
                    help="llama.cpp's llama-server binary ('none': ours only)")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    streams = [int(s) for s in a.streams.split(",")]
    slots = max(streams)
    servers: list[Server] = []
    try:
        port = free_port()
        servers.append(Server("sparseinfer", [sys.executable, "-m", "coordinator", "serve", "-m", a.model,
                                              "--port", str(port), "-t", str(a.threads), "--parallel", str(slots),
                                              "--ctx", str(a.ctx), "--arith", a.arith, "--queue", "64"],
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
        summary = {name: {n: {k: statistics.median(x[k] for x in rounds) for k in ("tok_s", "ttft_p50", "ttft_p99")}
                          for n, rounds in per.items()} for name, per in res.items()}
        if a.json:
            print(json.dumps({"model": a.model, "tokens": a.tokens, "threads": a.threads, "slots": slots,
                              "rounds": res, "median": summary}, indent=1))
            return
        print(f"model {Path(a.model).name}, {a.threads} threads, {slots} slots, {a.tokens} tokens per request, "
              f"{REQS} requests per stream, medians of {a.rounds} interleaved rounds")
        base = summary["sparseinfer"][streams[0]]["tok_s"]
        print(f"{'server':<13}{'streams':>8}{'tok/s':>9}{'x 1 stream':>12}{'TTFT p50':>10}{'p99':>8}"
              + ("   vs llama-server" if len(servers) > 1 else ""))
        for name in summary:
            one = summary[name][streams[0]]["tok_s"]
            for n in streams:
                m = summary[name][n]
                vs = ""
                if len(servers) > 1 and name == "sparseinfer":
                    vs = f"   {m['tok_s'] / summary['llama-server'][n]['tok_s']:.2f}x"
                print(f"{name:<13}{n:>8}{m['tok_s']:>9.1f}{m['tok_s'] / one:>11.2f}x{m['ttft_p50']:>9.2f}s"
                      f"{m['ttft_p99']:>7.2f}s{vs}")
        del base
    finally:
        for s in servers:
            s.close()


if __name__ == "__main__":
    main()
