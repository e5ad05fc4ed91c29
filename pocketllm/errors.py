"""The typed errors of the public API, and the one table that maps each error kind
(``proto.messages.ErrorKind``, what a stage reports) to its exception class and to the
HTTP status and OpenAI ``type``/``code`` the server answers with."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from .proto.messages import ErrorDetail, ErrorKind, RequestError


class PocketLLMError(Exception):
    """Base class of every error PocketLLM raises on purpose."""

    kind = ErrorKind.internal

    def __init__(self, message: str = "", param: Optional[str] = None):
        super().__init__(message)
        self.param = param  # the request field at fault, when one is (HTTP error ``param``)
        self.request_id: Optional[str] = None  # set when the engine failed one request


class InvalidRequestError(PocketLLMError, ValueError):
    """The request is malformed or asks for something out of range (HTTP 400)."""

    kind = ErrorKind.invalid_request


class PromptTooLongError(InvalidRequestError):
    """The prompt (plus its budget) can never fit max_model_len or the KV cache."""

    kind = ErrorKind.too_long


class RequestIdInUseError(InvalidRequestError):
    """The request id names a request still active (HTTP 409)."""

    kind = ErrorKind.conflict


class UnsupportedFeatureError(PocketLLMError):
    """A requested feature or backend is not implemented; refused rather than ignored."""

    kind = ErrorKind.unsupported


class RequestNotFoundError(PocketLLMError, LookupError):
    """No active request has this id (HTTP 404)."""

    kind = ErrorKind.not_found


class RateLimitedError(PocketLLMError):
    """The server is over an admission limit; ``retry_after`` seconds is a fair wait (HTTP 429)."""

    kind = ErrorKind.rate_limited

    def __init__(self, message: str = "", param: Optional[str] = None,
                 retry_after: Optional[float] = None):
        super().__init__(message, param)
        self.retry_after = retry_after


class RequestTimeoutError(PocketLLMError, TimeoutError):
    """The request's deadline passed before it finished (HTTP 504)."""

    kind = ErrorKind.timeout


class CheckpointError(PocketLLMError):
    """The checkpoint is missing, unreadable or of an unknown architecture."""


class EngineDeadError(PocketLLMError):
    """A process of the engine died; every pending and later request fails with this."""

    kind = ErrorKind.engine_dead


class EngineStartupError(PocketLLMError):
    """The engine did not become ready (a stage failed or the startup timed out)."""


class RequestFailedError(PocketLLMError):
    """The engine accepted the request but could not finish it (e.g. a forward raised)."""


@dataclass(frozen=True)
class ErrorSpec:
    cls: type  # the exception a caller of LLM / AsyncLLM catches
    status: int  # the HTTP status
    type: str  # OpenAI error ``type``
    code: Optional[str]  # OpenAI error ``code``


ERRORS: dict[ErrorKind, ErrorSpec] = {
    ErrorKind.invalid_request: ErrorSpec(InvalidRequestError, 400, "invalid_request_error", None),
    ErrorKind.too_long: ErrorSpec(PromptTooLongError, 400, "invalid_request_error",
                                  "context_length_exceeded"),
    ErrorKind.unsupported: ErrorSpec(UnsupportedFeatureError, 400, "invalid_request_error",
                                     "unsupported"),
    ErrorKind.not_found: ErrorSpec(RequestNotFoundError, 404, "invalid_request_error",
                                   "not_found"),
    ErrorKind.conflict: ErrorSpec(RequestIdInUseError, 409, "invalid_request_error",
                                  "request_id_in_use"),
    ErrorKind.rate_limited: ErrorSpec(RateLimitedError, 429, "requests", "rate_limit_exceeded"),
    ErrorKind.timeout: ErrorSpec(RequestTimeoutError, 504, "timeout", "timeout"),
    ErrorKind.internal: ErrorSpec(RequestFailedError, 500, "server_error", "internal_error"),
    ErrorKind.engine_dead: ErrorSpec(EngineDeadError, 503, "service_unavailable", "engine_dead"),
}


def error_spec(exc: BaseException) -> ErrorSpec:
    """How the server answers ``exc``: anything not ours is the engine's fault (500)."""
    kind = exc.kind if isinstance(exc, PocketLLMError) else ErrorKind.internal
    return ERRORS[kind]


def error_from_wire(err: RequestError | ErrorDetail,
                    request_id: Optional[str] = None) -> PocketLLMError:
    """The exception for a stage's report (a refusal, or a failure after the request started)."""
    kind = err.kind if err.kind in ERRORS else ErrorKind.internal
    exc = ERRORS[ErrorKind(kind)].cls(err.message, err.param)
    exc.request_id = request_id if request_id is not None else getattr(err, "request_id", None)
    return exc
