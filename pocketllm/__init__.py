"""PocketLLM: a small, honest LLM serving engine (offline API, OpenAI-compatible server)."""

from . import _source_layout

_source_layout.install()  # a checkout imports proto/ and workers/ as the wheel does

from .config import EngineArgs
from .errors import (CheckpointError, EngineDeadError, EngineStartupError, InvalidRequestError,
                     PocketLLMError, PromptTooLongError, RequestFailedError,
                     UnsupportedFeatureError)
from .outputs import GenerationOutput, TokenEvent, Usage
from .sampling import SamplingParams

__version__ = "0.1.0"

# LLM and AsyncLLM are imported on first use: every engine process imports this package,
# and the frontend's modules (asyncio, the supervisor...) would add ~50 ms to each start.
_LAZY = {"LLM": ".api.llm", "AsyncLLM": ".api.async_llm"}


def __getattr__(name: str):
    if name not in _LAZY:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    from importlib import import_module

    value = getattr(import_module(_LAZY[name], __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_LAZY})


__all__ = [
    "LLM", "AsyncLLM", "EngineArgs", "SamplingParams", "GenerationOutput", "TokenEvent", "Usage",
    "PocketLLMError", "InvalidRequestError", "PromptTooLongError", "UnsupportedFeatureError",
    "CheckpointError", "EngineDeadError", "EngineStartupError", "RequestFailedError",
]
