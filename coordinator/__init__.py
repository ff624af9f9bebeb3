"""The coordinator process: tokenizer, attention + KV cache, predictors, sampling, token loop."""
import os

# torch's OpenMP threads spin after each parallel region by default, stealing the cores the
# worker processes need between two layers (measured: 0.4 tok/s instead of 9 on 2 cores).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
