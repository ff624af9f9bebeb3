"""The `sparseinfer` command: `main`, the click group (the console script, `python -m
coordinator` and scripts/launch run it). Until cli.py is split by job it is all in app.py."""
from .app import _open_engine, generate, main  # noqa: F401 (tests reach these through the package)
