"""The coordinator as a long-running process: serves generate requests from frontends.

A frontend (`sparseinfer prompt`, later the HTTP server) connects a DEALER socket to the
coordinator's ROUTER endpoint, sends a GenerateRequest and receives TokenChunk messages as
text is produced, then GenerateDone. A StopServer request shuts everything down.
"""
from __future__ import annotations

import sys

import zmq

from protocol.messages import GenerateDone, GenerateRequest, StopServer, TokenChunk, decode, encode

from .engine import Engine
from .interrupts import stop_on_signals
from .sampling import SamplingParams


def handle_request(eng: Engine, req: GenerateRequest, send) -> None:
    from .tokenizer import StreamDecoder

    try:
        text = eng.chat_prompt(req.prompt) if req.chat else req.prompt
        ids = eng.tokenizer.encode(text)
        sampling = SamplingParams(req.temperature, req.top_k, req.top_p, req.seed)
        stream = StreamDecoder(eng.tokenizer, skip_special=True)
        n, reason = 0, "length"
        for tok in eng.generate(ids, req.max_tokens, sampling, stop_at_eos=req.stop_at_eos):
            n += 1
            if req.stop_at_eos and tok in eng.tokenizer.eos_ids:
                reason = "stop"
                break
            piece = stream.push(tok)
            send(TokenChunk(req.request_id, piece, [tok]))
        tail = stream.flush()
        if tail:
            send(TokenChunk(req.request_id, tail, []))
        st = eng.last
        send(GenerateDone(req.request_id, len(ids), n, st.prefill_s, st.decode_s, reason))
    except ValueError as e:  # bad request (context too long, bad sampling values): tell the client
        send(GenerateDone(req.request_id, 0, 0, 0.0, 0.0, "error", str(e)))


def serve(eng: Engine, endpoint: str, ready_file: str | None = None) -> None:
    stop_on_signals()
    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.bind(endpoint)
    bound = sock.getsockopt_string(zmq.LAST_ENDPOINT)
    print(f"coordinator serving on {bound}", file=sys.stderr, flush=True)
    if ready_file:
        with open(ready_file, "w") as f:
            f.write(bound + "\n")
    try:
        while True:
            if not sock.poll(500):
                eng.check_workers()  # a worker dying while idle is still reported promptly
                continue
            ident, data = sock.recv_multipart()
            msg = decode(data)
            if isinstance(msg, StopServer):
                break
            if isinstance(msg, GenerateRequest):
                handle_request(eng, msg, lambda m: sock.send_multipart([ident, encode(m)]))
    finally:
        sock.close(0)
        ctx.term()
