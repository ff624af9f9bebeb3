"""The exception types for a model we cannot use; each message names the file and the reason."""


class ModelFileError(Exception):
    """A model file is missing, malformed or uses something sparseinfer does not support."""


class NotEnoughMemory(ModelFileError):
    """A model that cannot fit in the memory this machine has free (coordinator/runtime/memory_plan.py)."""
