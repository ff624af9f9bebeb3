"""`sparseinfer chat`: a multi-turn conversation in the terminal, on the engine directly.

Each turn goes through a one-slot `Scheduler`, so the conversation's KV cache is reused (the
history is not prefilled again) and Ctrl-C stops the current reply, not the session."""
from __future__ import annotations

import queue
import sys

import click

from ..runtime import interrupts
from ..runtime.batching import DoneEvent, FailedEvent, Request, Scheduler, TokenEvent
from ..runtime.sampling import SamplingParams

HELP = "/reset clears the conversation, /exit (or Ctrl-D) ends it; Ctrl-C stops a reply"


def _reply(sched: Scheduler, ids: list[int], max_tokens: int, sampling: SamplingParams, stop_at_eos: bool) -> str:
    events: queue.Queue = queue.Queue()
    req = Request(ids, max_tokens, events.put, sampling, [], stop_at_eos)
    sched.submit(req)
    text = []
    try:
        while True:
            try:
                ev = events.get(timeout=0.2)
            except queue.Empty:
                continue
            interrupts.raise_if_interrupted()
            if isinstance(ev, TokenEvent):
                text.append(ev.text)
                click.echo(ev.text, nl=False)
            elif isinstance(ev, DoneEvent):
                text.append(ev.text)
                click.echo(ev.text)
                return "".join(text)
            elif isinstance(ev, FailedEvent):
                raise click.ClickException(ev.message)
    except KeyboardInterrupt:
        interrupts.clear()
        req.cancelled.set()
        while not isinstance(ev := events.get(), (DoneEvent, FailedEvent)):
            pass
        click.echo(" [stopped]")
        return "".join(text)


def run_chat(eng, sampling: SamplingParams, max_tokens: int, system: str | None, stop_at_eos: bool = True) -> None:
    start = [{"role": "system", "content": system}] if system else []
    messages = list(start)
    sched = Scheduler(eng, parallel=1, queue=0).start()
    interactive = sys.stdin.isatty()
    if interactive:
        click.echo(f"chatting with {eng.path.name} ({HELP})", err=True)
    try:
        while True:
            try:
                line = input("> " if interactive else "")
            except EOFError:
                break
            except KeyboardInterrupt:  # Ctrl-C at the prompt: leave
                click.echo()
                break
            cmd = line.strip()
            if cmd in ("/exit", "/quit"):
                break
            if cmd == "/reset":
                messages = list(start)
                click.echo("(conversation cleared)", err=True)
                continue
            if cmd in ("/help", "/?"):
                click.echo(HELP, err=True)
                continue
            if not cmd:
                continue
            messages.append({"role": "user", "content": line})
            ids = eng.encode_chat(messages)
            room = sched.max_ctx - len(ids)
            if room < 1:
                messages.pop()
                click.echo(f"(the conversation no longer fits the context of {sched.max_ctx} tokens: /reset, or "
                           f"start with a larger --ctx)", err=True)
                continue
            reply = _reply(sched, ids, min(max_tokens, room), sampling, stop_at_eos)
            messages.append({"role": "assistant", "content": reply})
    finally:
        sched.stop()
