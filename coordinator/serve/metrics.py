"""The server's Prometheus metrics at GET /metrics (prometheus-client's text format), as
llama-server's --metrics and vLLM expose theirs.

Counted as things happen: requests by endpoint and status (the HTTP middleware), prompt and
generated tokens, time to first token and time between tokens (each request's events, on the
scheduler's thread). Read when scraped: slots busy, slots, requests waiting, decode steps run,
FFN neuron-token pairs computed (the engine's exchange counters). Each app has a registry of its
own, so two servers in one process (the tests) never share counts.
"""
from __future__ import annotations

import time

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from ..runtime.batching import DoneEvent, TokenEvent

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


class _Live:
    """The gauges and counters the scheduler and the engine already keep, read at scrape time."""

    def __init__(self, state):
        self.state = state

    def collect(self):
        sched, eng = self.state.scheduler, self.state.engine
        if sched is None:
            return
        busy = GaugeMetricFamily("sparseinfer_slots_busy", "sequences being decoded")
        busy.add_metric([], sched.busy_slots())
        yield busy
        slots = GaugeMetricFamily("sparseinfer_slots", "sequences that can be decoded together (--parallel)")
        slots.add_metric([], len(sched.slots))
        yield slots
        waiting = GaugeMetricFamily("sparseinfer_requests_waiting", "requests queued for a slot")
        waiting.add_metric([], len(sched.waiting))
        yield waiting
        steps = CounterMetricFamily("sparseinfer_decode_steps", "decode steps run (one token of every busy slot)")
        steps.add_metric([], sched.steps)
        yield steps
        if eng is not None and getattr(eng, "ffn", None) is not None:
            st = eng.ffn.stats
            pairs = CounterMetricFamily("sparseinfer_ffn_neurons_computed",
                                        "FFN neuron-token pairs computed, over every layer")
            pairs.add_metric([], sum(st.active.values()))
            yield pairs
            tokens = CounterMetricFamily("sparseinfer_ffn_layer_tokens", "token-layer pairs through the FFN")
            tokens.add_metric([], sum(st.tokens.values()))
            yield tokens
            routed = eng.routed_work() if getattr(eng, "cfg", None) is not None and eng.cfg.routed else None
            if routed is not None:  # a routed model: its (token, expert) choices, and each process's part
                yield from routed_metrics(routed)
        spec = getattr(eng, "spec", None)
        if spec is not None:  # speculative decoding (coordinator/runtime/speculative.py)
            yield from spec_metrics(spec.stats)


def routed_metrics(routed: dict):
    """A routed model's choices since the start, those each process computed (the GPU worker's
    share of them is the measured routed share) and placement's predicted share for the GPU worker."""
    total = CounterMetricFamily("sparseinfer_routed_choices", "routed (token, expert) choices, over every layer")
    total.add_metric([], routed["routes"])
    yield total
    mine = CounterMetricFamily("sparseinfer_routed_choices_computed",
                               "routed (token, expert) choices that fell on experts the process computes",
                               labels=["role", "worker"])
    for p in routed["processes"]:
        mine.add_metric([p["role"], str(p["worker_id"])], p["routes"])
    yield mine
    if routed["predicted_share"] is not None:
        g = GaugeMetricFamily("sparseinfer_routed_share_predicted",
                              "the GPU worker's share of the routed work its placement predicted (--vram-budget)")
        g.add_metric([], routed["predicted_share"])
        yield g


def spec_metrics(st):
    """Speculative decoding's counts, and the acceptance and tokens per target step they give."""
    for name, what, value in (("drafted_tokens", "drafted tokens checked by the model", st.drafted),
                              ("accepted_tokens", "drafted tokens kept", st.accepted),
                              ("sequence_steps", "target steps, counted once per sequence in each", st.steps),
                              ("step_tokens", "tokens those sequence steps gave", st.tokens)):
        c = CounterMetricFamily(f"sparseinfer_spec_{name}", what)
        c.add_metric([], value)
        yield c
    for name, what, value in (("acceptance", "drafted tokens kept / checked", st.acceptance),
                              ("tokens_per_step", "tokens a sequence gets per target step", st.tokens_per_step)):
        g = GaugeMetricFamily(f"sparseinfer_spec_{name}", what)
        g.add_metric([], value)
        yield g


class ServerMetrics:
    def __init__(self, state):
        self.registry = r = CollectorRegistry()
        self.requests = Counter("sparseinfer_requests", "HTTP requests by endpoint and status", ["endpoint", "status"],
                                registry=r)
        self.prompt_tokens = Counter("sparseinfer_prompt_tokens", "prompt tokens of finished requests", registry=r)
        self.generated_tokens = Counter("sparseinfer_generated_tokens", "tokens generated", registry=r)
        self.ttft = Histogram("sparseinfer_time_to_first_token_seconds", "request accepted to its first token",
                              buckets=_LATENCY_BUCKETS, registry=r)
        self.per_token = Histogram("sparseinfer_time_per_output_token_seconds", "time between a request's tokens",
                                   buckets=_LATENCY_BUCKETS, registry=r)
        r.register(_Live(state))

    def request(self, endpoint: str, status: int) -> None:
        self.requests.labels(endpoint, str(status)).inc()

    def watch(self, on_event):
        """on_event wrapped to time a request's tokens (called on the scheduler's thread)."""
        t0 = last = time.perf_counter()
        first = True

        def observed(ev):
            nonlocal last, first
            if isinstance(ev, TokenEvent):
                now = time.perf_counter()
                (self.ttft if first else self.per_token).observe(now - (t0 if first else last))
                first, last = False, now
                self.generated_tokens.inc()
            elif isinstance(ev, DoneEvent):
                self.prompt_tokens.inc(ev.prompt_tokens)
            on_event(ev)
        return observed

    def text(self) -> bytes:
        return generate_latest(self.registry)
