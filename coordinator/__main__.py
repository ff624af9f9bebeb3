"""`python -m coordinator ...`: the `sparseinfer` command (coordinator/cli.py)."""
from coordinator.cli import main

main()
