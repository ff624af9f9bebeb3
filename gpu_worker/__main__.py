"""The GPU worker process: the CPU worker's process wrapper with the GPU worker's device choice."""
import sys

from cpu_worker.__main__ import main
from gpu_worker.worker import pick_device

sys.exit(main("gpu", pick_device))
