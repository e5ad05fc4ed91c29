"""The typed errors of the public API. The server maps each to an HTTP status."""


class PocketLLMError(Exception):
    """Base class of every error PocketLLM raises on purpose."""


class InvalidRequestError(PocketLLMError, ValueError):
    """The request is malformed or asks for something out of range (HTTP 400)."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


class PromptTooLongError(InvalidRequestError):
    """The prompt (plus its budget) can never fit max_model_len or the KV cache."""


class UnsupportedFeatureError(PocketLLMError):
    """A requested feature or backend is not implemented; refused rather than ignored."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param  # the request field that asked for it, when one did (HTTP 400 param)


class CheckpointError(PocketLLMError):
    """The checkpoint is missing, unreadable or of an unknown architecture."""


class EngineDeadError(PocketLLMError):
    """A process of the engine died; every pending and later request fails with this."""


class EngineStartupError(PocketLLMError):
    """The engine did not become ready (a stage failed or the startup timed out)."""


class RequestFailedError(PocketLLMError):
    """The engine accepted the request but could not finish it (e.g. a forward raised)."""
