"""The `sparseinfer` command group, `main`, and how it ends: the errors a user can cause as one
line (`fail`), Ctrl-C, and the quick exit of a command that has closed everything. The
commands register on `main` from their modules (coordinator/cli/__init__.py imports them)."""
from __future__ import annotations

import os
import sys

import click

from sparsecore.errors import ModelFileError

from ..runtime.interrupts import exit_status, pending, stop_on_signals
from ..runtime.model_fetch import FetchError

EXIT_ERROR = 1


def fail(msg: str) -> None:
    click.echo(f"error: {msg}", err=True)
    sys.exit(EXIT_ERROR)


class _Command(click.Command):
    """A value a command's body refuses with click.BadParameter is a refused value like any other
    (exit 1); only what click's parser itself rejects keeps click's usage code, 2."""

    def invoke(self, ctx):
        try:
            return super().invoke(ctx)
        except click.BadParameter as e:
            raise ValueError(e.format_message()) from None


# Set by a command that has stopped its workers and written everything (generate, through
# exit_at_once): the program then ends without the interpreter's teardown, which with torch
# loaded takes 0.3-0.8 s (the workers end the same way, cpu_worker/__main__.py).
_EXIT_AT_ONCE = False


def exit_at_once() -> None:
    """Called by a command once its engine has closed: nothing is left to tear down."""
    global _EXIT_AT_ONCE
    _EXIT_AT_ONCE = True


class _Cli(click.Group):
    """Turns the errors a user can cause into one line on stderr instead of a traceback: exit 1
    for a value refused (by the commands' checks, the model file, the engine), 2 for click's own
    usage errors (an unknown option, `-n abc`), which it would otherwise print in three lines."""

    command_class = _Command

    def main(self, args=None, *rest, **kwargs):
        try:
            return super().main(args, *rest, **kwargs)
        except SystemExit as e:
            # only as the program itself (no args given: the console script, `python -m coordinator`)
            if not _EXIT_AT_ONCE or args is not None or not isinstance(e.code, (int, type(None))):
                raise
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(e.code or 0)

    def invoke(self, ctx):
        stop_on_signals()
        try:
            return super().invoke(ctx)
        except click.UsageError as e:
            click.echo(f"error: {e.format_message()} (see `sparseinfer {ctx.invoked_subcommand or ''} --help`)",
                       err=True)
            sys.exit(e.exit_code)
        except Exception as e:
            if pending():  # a Ctrl-C a library re-raised as another error (interrupts.pending)
                _interrupted(ctx)
            # worker_pool imports torch (2 s): only a run that got that far can raise its error,
            # so look it up rather than import it, and a refused option fails fast.
            pool = sys.modules.get("coordinator.runtime.worker_pool")
            if isinstance(e, (ModelFileError, FetchError, ValueError) + ((pool.WorkerError,) if pool else ())):
                fail(str(e))
            raise
        except KeyboardInterrupt:
            _interrupted(ctx)


def _interrupted(ctx) -> None:
    """End a command stopped by a signal: one line, the signal's exit status."""
    status = exit_status(ctx.invoked_subcommand)
    click.echo("\nstopped" if status == 0 else "\ninterrupted", err=True)
    sys.exit(status)


@click.group(cls=_Cli)
def main():
    """sparseinfer: run LLMs on one PC with hot neurons on the GPU and cold ones on CPU workers."""

