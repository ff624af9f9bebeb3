"""The one exception type for a model file we cannot use; its message names file and reason."""


class ModelFileError(Exception):
    """A model file is missing, malformed or uses something sparseinfer does not support."""
