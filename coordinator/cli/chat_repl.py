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
from ..serve import reasoning

HELP = ("/reset clears the conversation, /thinking shows or folds a reasoning model's thinking, /exit (or Ctrl-D) "
        "ends it; Ctrl-C stops a reply")


class _Thoughts:
    """A reasoning model's thinking, shown apart from its answer: folded (one dim line that
    counts its words, the default) or whole (dim), as /thinking toggles."""

    def __init__(self, shown: bool, live: bool):
        self.shown, self.live, self.words, self.open = shown, live, 0, False

    def add(self, text: str) -> None:
        if not self.open:
            self.open = True
            if self.shown:
                click.echo(click.style("thinking: ", dim=True), nl=False)
        self.words += len(text.split())
        if self.shown:
            click.echo(click.style(text, dim=True), nl=False)
        elif self.live:  # a terminal: the count goes up in place
            click.echo(click.style(f"\r(thinking… {self.words} words", dim=True), nl=False)

    def close(self) -> None:
        if self.open:
            self.open = False
            back = "\r" if self.live else ""
            summary = "" if self.shown else f"{back}(thought for {self.words} words; /thinking shows it)"
            click.echo(click.style(summary, dim=True))


def _reply(sched: Scheduler, ids: list[int], max_tokens: int, sampling: SamplingParams, stop_at_eos: bool,
           split, thoughts: _Thoughts) -> str:
    """The reply streamed; returns its answer (the thinking apart: templates leave it out of the history)."""
    events: queue.Queue = queue.Queue()
    harmony = isinstance(split, reasoning.HarmonySplitter)
    req = Request(ids, max_tokens, events.put, sampling, [], stop_at_eos, keep_special=harmony)
    sched.submit(req)
    text = []

    def show(piece: str, final: bool = False) -> None:
        thought, answer, *_ = split.feed(piece, final)
        if thought:
            thoughts.add(thought)
        if answer:
            thoughts.close()
            text.append(answer)
            click.echo(answer, nl=False)
    try:
        while True:
            try:
                ev = events.get(timeout=0.2)
            except queue.Empty:
                continue
            interrupts.raise_if_interrupted()
            if isinstance(ev, TokenEvent):
                show(ev.text)
            elif isinstance(ev, DoneEvent):
                show(ev.text, final=True)
                thoughts.close()
                click.echo()
                return "".join(text)
            elif isinstance(ev, FailedEvent):
                raise click.ClickException(ev.message)
    except KeyboardInterrupt:
        interrupts.clear()
        req.cancelled.set()
        while not isinstance(ev := events.get(), (DoneEvent, FailedEvent)):
            pass
        thoughts.close()
        click.echo(" [stopped]")
        return "".join(text)


def run_chat(eng, sampling: SamplingParams, max_tokens: int, system: str | None, stop_at_eos: bool = True) -> None:
    start = [{"role": "system", "content": system}] if system else []
    messages = list(start)
    sched = Scheduler(eng, parallel=1, queue=0).start()
    interactive = sys.stdin.isatty()
    family = reasoning.family_of(eng.chat_template)
    show_thinking = False
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
            if cmd == "/thinking":
                show_thinking = not show_thinking
                click.echo(f"(thinking {'shown' if show_thinking else 'folded'})", err=True)
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
            split = reasoning.splitter_for(family, eng.tokenizer.decode(ids[-24:]))
            thoughts = _Thoughts(show_thinking, live=interactive and sys.stdout.isatty())
            reply = _reply(sched, ids, min(max_tokens, room), sampling, stop_at_eos, split, thoughts)
            messages.append({"role": "assistant", "content": reply})
    finally:
        sched.stop()
