"""The OpenAI-compatible server's processes over their lifetime, each test with a server of its
own on a tiny model: a client that disconnects frees its slot, SIGTERM and SIGINT stop it
cleanly (also started as a background job), silent and slow connections are closed at the header
deadline, SIGTERM lets a running stream finish, and a dead worker is restarted (a second death,
or the first with --on-worker-death exit, ends the server)."""
from __future__ import annotations

import json
import os
import signal
import socket
import time
import urllib.error
import urllib.request

import pytest

from tests.conftest import HANG_S, children_of
from tests.fixtures import procs
from tests.fixtures.http_server import launched as _server
from tests.fixtures.openai_server import health_with_key as _health


def test_a_client_that_disconnects_frees_its_slot(tiny_model_factory, tmp_path):
    """A client that goes away mid-stream (its socket closed, as when a user stops a reply)
    frees its slot long before the reply would have ended. A long context and reply: the tiny
    model decodes thousands of tokens a second while the server's HTTP thread shares a core
    with its spinning scheduler, so a disconnect can take a few hundred steps to be seen (a
    240-token reply on the 256-token model sometimes ended first)."""
    import http.client

    model_path = tiny_model_factory(tensor_type="F32", ctx=16384)
    with _server(model_path, tmp_path, "--parallel", "1", "--ctx", "16384") as (_, url):
        host, port = url.removeprefix("http://").split(":")
        conn = http.client.HTTPConnection(host, int(port), timeout=30)
        max_tokens = 12000
        body = json.dumps({"prompt": "the lazy dog", "max_tokens": max_tokens, "temperature": 0,
                           "stream": True, "ignore_eos": True})
        conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
        resp = conn.getresponse()
        assert resp.status == 200
        for _ in range(6):  # a few events in: the sequence is decoding
            assert resp.fp.readline()
        assert _health(url)[1]["slots_busy"] == 1
        steps = _health(url)[1]["decode_steps"]
        conn.sock.shutdown(socket.SHUT_RDWR)  # the client goes away mid-stream
        conn.close()
        deadline = time.monotonic() + 30
        while _health(url)[1]["slots_busy"] and time.monotonic() < deadline:
            time.sleep(0.005)
        body = _health(url)[1]
        assert body["slots_busy"] == 0
        # freed by the disconnect, far from the reply's end
        assert body["decode_steps"] - steps < max_tokens // 4, body["decode_steps"] - steps


def _ignore_sigint():
    signal.signal(signal.SIGINT, signal.SIG_IGN)


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_signals_stop_the_server_cleanly_even_started_as_a_background_job(tiny_model, tmp_path, no_leaks, signum):
    """SIGTERM and SIGINT both stop the server and its workers and remove its ready file, also
    when it was started with SIGINT ignored, as a shell's background job is. SIGTERM, a service
    manager's stop, is a clean stop (status 0); Ctrl-C is 130."""
    with _server(tiny_model, tmp_path, preexec_fn=_ignore_sigint) as (server, _):
        workers = children_of(server.pid)
        assert workers
        server.send_signal(signum)
        assert server.wait(timeout=30) == (0 if signum == signal.SIGTERM else 130)
        assert ("stopped" if signum == signal.SIGTERM else "interrupted") in server.stderr.read()
        deadline = time.monotonic() + HANG_S  # gone with the server; this only catches one that stays
        while [p for p in workers if procs.alive(p)] and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not [p for p in workers if procs.alive(p)]
        assert not (tmp_path / "ready").exists()


def test_silent_and_slow_connections_are_closed_at_the_header_deadline(tiny_model, tmp_path):
    """A connection that sends nothing, one that sends a header byte at a time, and one idle
    after its response are each closed by the server (--header-timeout 1), which serves on.
    The sockets' own timeout (HANG_S) only catches a server that never closes them."""
    with _server(tiny_model, tmp_path, "--header-timeout", "1") as (_, url):
        host, port = url.removeprefix("http://").split(":")
        socks = [socket.create_connection((host, int(port)), timeout=HANG_S) for _ in range(3)]
        silent, slow, idle = socks
        idle.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        assert idle.recv(4096).startswith(b"HTTP/1.1 200")
        slow.sendall(b"GET /hea")  # and no more: the rest of the request line never comes
        for s in socks:  # each is closed by the server: recv returns b"" (EOF), not a timeout
            while s.recv(4096):
                pass
            s.close()
        assert _health(url)[0] == 200


def test_sigterm_lets_a_running_stream_finish_then_exits_0(tiny_model_factory, tmp_path):
    """SIGTERM mid-stream (1500 tokens to go): the stream runs to its last token and [DONE]
    within --shutdown-grace, and the server exits 0."""
    import http.client

    with _server(tiny_model_factory(ctx=4096), tmp_path, "--shutdown-grace", "60", "--ctx", "4096") as (server, url):
        host, port = url.removeprefix("http://").split(":")
        conn = http.client.HTTPConnection(host, int(port), timeout=HANG_S)
        body = json.dumps({"prompt": "the lazy dog", "max_tokens": 1500, "temperature": 0, "stream": True,
                           "ignore_eos": True})
        conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
        resp = conn.getresponse()
        assert resp.status == 200 and resp.readline()  # decoding has begun
        server.send_signal(signal.SIGTERM)
        rest = resp.read().decode()
        conn.close()
        assert rest.rstrip().endswith("data: [DONE]")
        events = [json.loads(line[6:]) for line in rest.splitlines() if line.startswith("data: {")]
        assert len(events) > 1000 and events[-1]["choices"][0]["finish_reason"] == "length"
        assert server.wait(timeout=HANG_S) == 0


def _complete(url: str, max_tokens: int = 3) -> int:
    req = urllib.request.Request(url + "/v1/completions", data=json.dumps(
        {"prompt": "the lazy dog", "max_tokens": max_tokens, "temperature": 0}).encode(),
        headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=HANG_S) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code


def _workers(pid: int) -> list[int]:
    """The server's CPU worker processes (not multiprocessing's resource tracker)."""
    return [p for p in children_of(pid) if "cpu_worker" in procs.cmdline(p)]


def _wait_for(cond, what: str):
    deadline = time.monotonic() + HANG_S  # only catches a server that never gets there
    while not cond():
        assert time.monotonic() < deadline, what
        time.sleep(0.1)


def test_a_dead_worker_is_restarted_and_a_second_death_exits_non_zero(tiny_model, tmp_path):
    """kill -9 of the CPU worker: the server says so in one line, restarts the engine's workers
    (/health "recovering" meanwhile) and serves again with nobody restarting anything; a second
    death within the window ends the server with a non-zero status, its workers gone."""
    with _server(tiny_model, tmp_path) as (server, url):
        assert _complete(url) == 200
        first = _workers(server.pid)
        assert first
        os.kill(first[0], signal.SIGKILL)
        _wait_for(lambda: _health(url)[1]["status"] != "ok", "the death was never noticed")
        _wait_for(lambda: _health(url)[0] == 200, "the server did not recover")
        assert _complete(url) == 200
        second = _workers(server.pid)
        assert second and not set(second) & set(first)
        os.kill(second[0], signal.SIGKILL)
        assert server.wait(timeout=HANG_S) == 1
        err = server.stderr.read()
        assert "restarting the engine's workers" in err and "exiting" in err.splitlines()[-1]
        _wait_for(lambda: not [p for p in second if procs.alive(p)], "workers left behind")


def test_on_worker_death_exit_ends_the_server_at_the_first_death(tiny_model, tmp_path):
    with _server(tiny_model, tmp_path, "--on-worker-death", "exit") as (server, url):
        assert _complete(url) == 200
        workers = _workers(server.pid)
        os.kill(workers[0], signal.SIGKILL)
        assert server.wait(timeout=HANG_S) == 1
        assert server.stderr.read().splitlines()[-1].startswith("error: ")
