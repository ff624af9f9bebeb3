"""The GPU worker process: the CPU worker's loop on a CUDA device (`worker.py`)."""
