"""The `sparseinfer` command: `main`, the click group the console script, `python -m
coordinator` and scripts/launch run.

    app.py                the group: errors as one line, Ctrl-C, the quick exit
    options.py            the options commands share, and the readers of those passed in the context
    validation.py         what a command refuses before anything loads
    engine_args.py        the model, the decode level, EngineOptions: the engine a command opens
    reports.py            what the commands print when done
    text_commands.py      pull, generate, chat (chat_repl.py: the terminal conversation)
    http_commands.py      serve, prompt (http_client.py: prompt's client of the server)
    sparsity_commands.py  calibrate, profile, train-predictor
    measure_commands.py   info, perplexity, bench
"""
from .app import main
from . import http_commands, measure_commands, sparsity_commands, text_commands  # noqa: F401,E402 (register on main)

__all__ = ["main"]
