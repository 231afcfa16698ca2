"""Errors that the command line turns into one clear line and exit code 2."""


class RlflowError(Exception):
    """Base class: a problem the user can act on, reported in one line without a traceback."""


class InputError(RlflowError):
    """The input is unusable: a missing or unreadable file, not ONNX, rejected by the checker, bad shapes."""


class ProviderError(RlflowError):
    """The execution provider is missing, or cannot run the model."""
