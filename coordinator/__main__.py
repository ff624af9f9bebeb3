"""`python -m coordinator ...`: the `sparseinfer` command (coordinator/cli/)."""
from coordinator.cli import main

main()
