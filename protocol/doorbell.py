"""Both ends of the per-layer exchange: the coordinator posts a step and waits for it to be
done, a worker waits for a step and says it is done. Everything about when a side spins and
when it sleeps is here, once.

Why a doorbell. A process that sleeps needs a system call and a wake-up to hear from another:
through ZeroMQ that costs about 0.2 ms median and milliseconds at the tail on a virtual machine,
against about 2 us for a spin on a shared word and 8 us for a round trip over a pipe. Thirty
layers a token make that the difference between a fast engine and a slow one. So a step goes
through words in shared memory (protocol/shm_layout.py), and a side that has stopped spinning
sleeps on a wake pipe that the other side rings.

Memory ordering (the one place these rules are written):
  - Posting: request[REQ_WHAT, REQ_TOKENS, REQ_FLAGS] (and x, the mask, the thresholds before
    them) are written first, request[REQ_STEP] last. A worker reads the request like a seqlock:
    REQ_STEP before and after the fields must agree.
  - Finishing: the output rows, then slot[SLOT_ACTIVE, SLOT_COMPUTE_NS], then slot[SLOT_DONE]
    last. The coordinator reads the output only after it saw SLOT_DONE == step.
  - Both rely on stores becoming visible in program order (x86-TSO). Elsewhere no side spins:
    both sleep on their pipes, and the pipe's write/read pair orders memory (spin_supported).
  - Going to sleep: a side raises its sleeping word, then checks the doorbell once more before
    it blocks, so a step posted (or finished) meanwhile is either seen by that check or followed
    by a ring. Store-load reordering can let both sides miss each other for a moment; the first
    waits of a sleeper are therefore short (1, 4, 16 ms ...), never a full slice.
Spinning needs a core per spinner: the coordinator spins only when it and every worker that
computes have one each (choose_spin); a worker spins for WORKER_SPIN_US after its last step
(enough to cover the lm_head and sampling between tokens), then sleeps.

A shared machine. Those cores may not stay free: another program's busy threads turn every spin
into a fight for the core, and a spinner that loses it delays the very process it waits for by a
scheduler slice (SmolLM2 on 2 cores: 100 tok/s quiet, 13 with one busy neighbour, 5 with two).
So each side watches its own spins (SpinGovernor): a spin that got much less CPU time than wall
time was preempted. Then it spins only briefly and sleeps on its wake pipe, which costs a wake-up
(about 0.2 ms) a layer but gives the core to whoever has work; now and then it tries a full spin
again and keeps spinning once its spins run undisturbed. $SPARSEINFER_SYNC forces a policy:
"static" (the old rule: spin whenever choose_spin allowed it at start), "sleep" (never spin).
"""
from __future__ import annotations

import os
import platform
import time
from typing import Callable, NamedTuple

import numpy as np
import zmq

from .shm_layout import (FLAG_DENSE, FLAG_PREDICT, FLAG_THRESHOLD, KIND_SHIFT, REQ_COORD_SLEEPING, REQ_FLAGS,
                         REQ_STEP, REQ_TOKENS, REQ_WHAT, SLEEPING, SLOT_ACTIVE, SLOT_COMPUTE_NS, SLOT_DONE,
                         SLOT_SLEEPING, SharedBuffers, StepKind, step_of)

WORKER_SPIN_US = 50_000  # a worker spins this long for the next step (covers lm_head + sampling)
COORDINATOR_SPIN_US = 20_000  # the coordinator spins this long for a step to be done before it sleeps
SOCKET_CHECK_SPINS = 256  # a spinner looks at its socket (Shutdown, WorkerFailed) this often
CLOCK_CHECK_SPINS = 16  # and at the clock this often (a contended spin budget is only 50 us)
MAX_SLEEP_MS = 100  # a sleeper's longest wait before it checks on the other side

SYNC_ENV = "SPARSEINFER_SYNC"  # adaptive (default) | static (spin as choose_spin said) | sleep
SYNC_POLICIES = ("adaptive", "static", "sleep")
CONTENDED_SPIN_US = 50  # a contended coordinator still spins this long: a worker that finishes with it
# costs no wake-up. A contended worker does not spin: its next step comes after the coordinator's
# attention (about 0.3 ms), far beyond a short spin.
SPIN_WINDOW_S = 0.005  # judge spinning over this much spin time (several waits)
MIN_SPIN_CPU = 0.7  # a spin window with less CPU time than this share of wall time was preempted
# A contended side tries full spins again after PROBE_S, doubling to MAX_PROBE_S while contention
# keeps coming back (within RECENT_S of the last time): a one-off preemption (another program's
# burst) costs 0.1 s of sleeping, a lasting neighbour a probe window every 8 s.
PROBE_S, MAX_PROBE_S, RECENT_S = 0.1, 8.0, 10.0


def sync_policy() -> str:
    """The policy from $SPARSEINFER_SYNC; anything unknown is the default, adaptive."""
    p = os.environ.get(SYNC_ENV, "adaptive").strip().lower()
    return p if p in SYNC_POLICIES else "adaptive"


def spin_supported() -> bool:
    return platform.machine().lower() in ("x86_64", "amd64", "i386", "i686", "x86")


def usable_cores() -> int:
    """The cores this process may run on (a taskset or a container's cpuset narrows them), not
    every core of the machine: workers or spinners beyond them would only queue behind each other."""
    try:
        return len(os.sched_getaffinity(0)) or 1
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def choose_spin(spinning_workers: int, cores: int | None = None) -> bool:
    """Spin only when the coordinator and every worker that computes have a core each: a spinner
    sharing a core with the process it waits for delays it by a scheduler tick."""
    if sync_policy() == "sleep":
        return False
    return spin_supported() and 1 + spinning_workers <= (cores or usable_cores())


class SpinGovernor:
    """How long one side spins before it sleeps, from how its recent spins went.

    A side reports each spin: wall time and the CPU time its thread got meanwhile (thread_time).
    Over a window of SPIN_WINDOW_S of spinning, CPU below MIN_SPIN_CPU of wall means another
    runnable process took the core while this one spun: the cores are oversubscribed, and every
    further spin steals time from the processes that compute (ours or not). Then the budget drops
    to CONTENDED_SPIN_US; after PROBE_S one full-budget window is tried again (a probe), and a
    clean one restores spinning; a contended one doubles the wait before the next probe (to
    MAX_PROBE_S), so a long-busy machine pays a probe every few seconds. Pure logic with the clock
    passed in, so the decisions are tested without timing. The wait before a probe doubles while
    contention keeps returning (within `recent_s` of the last, even across a clean probe) and
    starts again from `probe_s` after a quiet spell."""

    def __init__(self, budget_s: float, adaptive: bool = True, contended_s: float = CONTENDED_SPIN_US / 1e6,
                 window_s: float = SPIN_WINDOW_S, min_cpu: float = MIN_SPIN_CPU, probe_s: float = PROBE_S,
                 max_probe_s: float = MAX_PROBE_S, recent_s: float = RECENT_S):
        self.full_s, self.adaptive, self.contended_s = budget_s, adaptive, min(contended_s, budget_s)
        self.window_s, self.min_cpu, self.probe_s, self.max_probe_s = window_s, min_cpu, probe_s, max_probe_s
        self.recent_s = recent_s
        self.last_contended = float("-inf")
        self.contended = False
        self.probing = False
        self.next_probe = 0.0
        self.backoff_s = probe_s
        self.switches = 0  # times it went from spinning to contended (for benchmarks and tests)
        self._wall = self._cpu = 0.0

    def budget(self, now: float) -> float:
        """Seconds to spin on this wait."""
        if not self.contended:
            return self.full_s
        if not self.probing and now >= self.next_probe:
            self.probing, self._wall, self._cpu = True, 0.0, 0.0
        return self.full_s if self.probing else self.contended_s

    def record(self, wall_s: float, cpu_s: float, now: float) -> None:
        """One spin: `wall_s` long, of which this thread ran `cpu_s`."""
        if not self.adaptive or (self.contended and not self.probing):
            return  # short contended spins say nothing about whether long ones would be preempted
        self._wall += wall_s
        self._cpu += cpu_s
        if self._wall < self.window_s:
            return
        preempted = self._cpu < self.min_cpu * self._wall
        self._wall = self._cpu = 0.0
        if preempted:
            again = self.contended or now - self.last_contended < self.recent_s
            self.backoff_s = min(self.max_probe_s, self.backoff_s * 2) if again else self.probe_s
            self.switches += not self.contended
            self.contended, self.probing, self.last_contended = True, False, now
            self.next_probe = now + self.backoff_s
        else:
            self.contended, self.probing = False, False


class WakePipe:
    """One process's wake-up line: a named FIFO in the run's private directory that others ring
    and its owner polls.

    Every side opens it read-write and non-blocking: opening never waits for the other end,
    a writer never gets ENXIO while the owner is still starting, and a full pipe (a sleeper
    that has not drained it yet) just drops the byte, which carries no information anyway."""

    def __init__(self, path: str):
        self.path = path
        self.fd = os.open(path, os.O_RDWR | os.O_NONBLOCK)

    @classmethod
    def create(cls, path: str) -> "WakePipe":
        os.mkfifo(path, 0o600)
        return cls(path)

    def fileno(self) -> int:
        return self.fd

    def ring(self) -> None:
        try:
            os.write(self.fd, b"\0")
        except BlockingIOError:
            pass

    def drain(self) -> None:
        try:
            while os.read(self.fd, 4096):
                pass
        except BlockingIOError:
            pass

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def _sleep_times(longest_ms: int = MAX_SLEEP_MS):
    """A sleeper's waits in ms: short first (see the module's ordering rules), then a slice."""
    t = 1
    while True:
        yield t
        t = min(longest_ms, t * 4)


class Request(NamedTuple):
    """One posted step as a worker reads it from the request words (a tuple: made per layer).
    `layer`: an FFN or attention step's layer (0 for the head's and lockstep steps)."""
    step: int
    layer: int
    n_tokens: int
    flags: int
    kind: StepKind = StepKind.FFN

    @property
    def dense(self) -> bool:
        return bool(self.flags & FLAG_DENSE)

    @property
    def threshold(self) -> bool:
        return bool(self.flags & FLAG_THRESHOLD)

    @property
    def predict(self) -> bool:
        return bool(self.flags & FLAG_PREDICT)


# ---- the coordinator's end ---------------------------------------------------------------------

class CoordinatorBell:
    """Posts steps and waits for the slots that take part. One per run; it numbers the steps.

    `socket` is polled beside the wake pipe while sleeping (workers report failures there), and
    `check()` is called every `check_every_s` while waiting: it raises if a worker died or
    failed, so a dead worker ends the wait instead of hanging the token loop."""

    def __init__(self, buffers: SharedBuffers, own_wake: WakePipe, worker_wakes: list[WakePipe], spin: bool,
                 socket: zmq.Socket | None = None, check: Callable[[], None] = lambda: None,
                 check_every_s: float = 0.2, adaptive: bool | None = None):
        self.buffers, self.wake, self.worker_wakes = buffers, own_wake, worker_wakes
        self.spin, self.socket, self.check, self.check_every_s = spin, socket, check, check_every_s
        # adaptive: the governor backs off when spins are preempted (None: as $SPARSEINFER_SYNC says)
        self.governor = SpinGovernor(COORDINATOR_SPIN_US / 1e6,
                                     adaptive=sync_policy() == "adaptive" if adaptive is None else adaptive)
        self.step = 0
        self.wakeups = 0  # steps posted to sleeping workers
        self._last_check = 0.0
        self._poller = zmq.Poller()
        self._poller.register(own_wake.fileno(), zmq.POLLIN)
        if socket is not None:
            self._poller.register(socket, zmq.POLLIN)
        if not spin:  # the coordinator always sleeps: workers always ring its wake pipe
            buffers.request[REQ_COORD_SLEEPING] = SLEEPING

    def post(self, kind: StepKind, layer: int, n_tokens: int, dense: bool, threshold: bool, part: np.ndarray,
             predict: bool = False) -> Request:
        """Publish the next step (a `kind` step of `layer`), then ring the slots in `part` that
        sleep. Returns what was posted."""
        self.step += 1
        posted = Request(self.step, layer, n_tokens, (FLAG_DENSE if dense else 0) | (FLAG_THRESHOLD if threshold else 0)
                         | (FLAG_PREDICT if predict else 0), kind)
        req, slots = self.buffers.request, self.buffers.slots
        # shm_layout.step_word, inline: this runs a few times per layer and token
        req[REQ_WHAT], req[REQ_TOKENS], req[REQ_FLAGS] = kind << KIND_SHIFT | layer, n_tokens, posted.flags
        req[REQ_STEP] = self.step  # last: a worker that sees it reads a complete request
        for slot in part:
            if slots[slot, SLOT_SLEEPING]:
                self.wakeups += 1
                self.worker_wakes[slot].ring()
        return posted

    def _check_every(self, interval_s: float) -> None:
        now = time.monotonic()
        if now - self._last_check >= interval_s:
            self._last_check = now
            self.check()

    def watch(self) -> None:
        """For waits outside `wait` (a lockstep step's, sparsecore/lockstep.py): raise if a
        worker reported a failure or died, looking at the processes at most every check_every_s."""
        if self.socket is not None and self.socket.poll(0):
            self.check()
        self._check_every(self.check_every_s)

    def wait(self, step: int, part: np.ndarray) -> tuple[int, int]:
        """Wait until every slot in `part` has done `step`: spin, then sleep on the wake pipe.
        Returns (active neuron-token pairs summed over the slots, slowest compute in ns)."""
        slots = self.buffers.slots
        waiting = [int(s) for s in part]
        n_active, slowest = 0, 0

        def collect() -> None:
            nonlocal n_active, slowest
            for s in [s for s in waiting if slots[s, SLOT_DONE] == step]:
                waiting.remove(s)
                n_active += int(slots[s, SLOT_ACTIVE])
                slowest = max(slowest, int(slots[s, SLOT_COMPUTE_NS]))

        self._check_every(self.check_every_s)  # also workers that sit this step out
        if self.spin:
            t0, cpu0 = time.perf_counter(), time.thread_time()
            deadline = t0 + self.governor.budget(t0)
            n = 0
            while waiting:
                collect()
                n += 1
                if waiting and n % CLOCK_CHECK_SPINS == 0:
                    if n % SOCKET_CHECK_SPINS == 0:
                        if self.socket is not None and self.socket.poll(0):
                            self.check()
                        self._check_every(self.check_every_s)
                    if time.perf_counter() > deadline:
                        break
            t1 = time.perf_counter()
            self.governor.record(t1 - t0, time.thread_time() - cpu0, t1)
            if not waiting:
                return n_active, slowest
        req = self.buffers.request
        req[REQ_COORD_SLEEPING] = SLEEPING
        try:
            for timeout in _sleep_times():
                collect()
                if not waiting:
                    return n_active, slowest
                ready = dict(self._poller.poll(timeout))
                if self.wake.fileno() in ready:
                    self.wake.drain()
                if self.socket is not None and self.socket in ready:
                    self.check()
                self._check_every(0.0 if not ready else self.check_every_s)
        finally:
            if self.spin:
                req[REQ_COORD_SLEEPING] = 0
        raise AssertionError("unreachable")

    def close(self) -> None:
        for pipe in (self.wake, *self.worker_wakes):
            pipe.close()


# ---- a worker's end ----------------------------------------------------------------------------

MESSAGE = "message"  # WorkerBell.wait: the socket has a message for the worker to read
GONE = "gone"  # WorkerBell.wait: the coordinator has gone away


class WorkerBell:
    """A worker's end: wait for the next step it takes part in, say when it is done.

    `takes_part(kind, layer)` says whether this worker owns anything of a step: steps it does not
    take part in are skipped (the coordinator does not wait for them). `gone()` is asked while
    sleeping, so a worker whose coordinator died exits instead of sleeping forever."""

    def __init__(self, buffers: SharedBuffers, slot: int, wake: WakePipe, coordinator_wake: WakePipe,
                 spin_s: float, socket: zmq.Socket, takes_part: Callable[[StepKind, int], bool],
                 gone: Callable[[], bool] = lambda: False, gone_check_ms: int = 500):
        self.buffers, self.slot, self.wake, self.coordinator_wake = buffers, slot, wake, coordinator_wake
        self.spin_s, self.socket, self.takes_part, self.gone = spin_s, socket, takes_part, gone
        self.gone_check_ms = gone_check_ms
        self.governor = SpinGovernor(spin_s, adaptive=sync_policy() == "adaptive", contended_s=0.0)
        self.last_step = 0
        self._poller = zmq.Poller()
        self._poller.register(socket, zmq.POLLIN)
        self._poller.register(wake.fileno(), zmq.POLLIN)

    def _request(self) -> Request | None:
        """The posted request if it is a new step for this worker, else None (seqlock read)."""
        req = self.buffers.request
        while True:
            step = int(req[REQ_STEP])
            if step == self.last_step:
                return None
            what, n_tokens, flags = int(req[REQ_WHAT]), int(req[REQ_TOKENS]), int(req[REQ_FLAGS])
            if int(req[REQ_STEP]) == step:
                break
        kind, layer = step_of(what)
        if not self.takes_part(kind, layer):
            self.last_step = step
            return None
        return Request(step, layer, n_tokens, flags, kind)

    def wait(self) -> Request | str:
        """The next Request for this worker, MESSAGE (read the socket), or GONE."""
        req = self.buffers.request
        if self.spin_s > 0:
            t0, cpu0 = time.perf_counter(), time.thread_time()
            deadline = t0 + self.governor.budget(t0)
            n = 0
            try:
                while True:
                    if req[REQ_STEP] != self.last_step:
                        r = self._request()
                        if r is not None:
                            return r
                    n += 1
                    if n % CLOCK_CHECK_SPINS == 0:
                        if n % SOCKET_CHECK_SPINS == 0 and self.socket.poll(0):
                            return MESSAGE
                        if time.perf_counter() > deadline:
                            break
            finally:
                t1 = time.perf_counter()
                self.governor.record(t1 - t0, time.thread_time() - cpu0, t1)
        sleeping = self.buffers.slots[self.slot]
        sleeping[SLOT_SLEEPING] = SLEEPING
        try:
            for timeout in _sleep_times(self.gone_check_ms):
                r = self._request()
                if r is not None:
                    return r
                ready = dict(self._poller.poll(timeout))
                if self.wake.fileno() in ready:
                    self.wake.drain()
                if self.socket in ready:
                    return MESSAGE
                if not ready and self.gone():
                    return GONE
        finally:
            sleeping[SLOT_SLEEPING] = 0
        raise AssertionError("unreachable")

    def finish(self, step: int, n_active: int, compute_ns: int) -> None:
        """Step `step` is in this worker's output slot: say so, and ring the coordinator if it sleeps."""
        slot = self.buffers.slots[self.slot]
        slot[SLOT_ACTIVE] = n_active
        slot[SLOT_COMPUTE_NS] = compute_ns
        slot[SLOT_DONE] = step  # last: the coordinator reads the slot once it sees this
        self.last_step = step
        if self.buffers.request[REQ_COORD_SLEEPING]:
            self.coordinator_wake.ring()

    def close(self) -> None:
        for pipe in (self.wake, self.coordinator_wake):
            pipe.close()
