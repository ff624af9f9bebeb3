"""GPU worker: holds the hot neurons of every layer as torch tensors on CUDA when present,
else on the CPU with the same code."""
from sparsecore.worker_runtime import main as _serve


def main(argv=None) -> int:
    return _serve("gpu", argv)
