"""CPU worker: holds one shard of the cold neurons of every layer and computes the active ones.

Runs the shared serve loop on the CPU with one thread (the coordinator gives each worker its
share of the cores so processes do not oversubscribe them).
"""
from sparsecore.worker_runtime import main as _serve


def main(argv=None) -> int:
    return _serve("cpu", argv)
