"""The CPU worker process: `worker.py` its logic, `__main__.py` the process around it."""
