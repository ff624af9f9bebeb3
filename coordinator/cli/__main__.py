"""`python -m coordinator.cli ...`, as `python -m coordinator ...`."""
from coordinator.cli import main

main()
