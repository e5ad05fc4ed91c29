"""PocketLLM: a small, honest LLM serving engine (offline API, OpenAI-compatible server)."""

from . import _source_layout

_source_layout.install()  # a checkout imports proto/ and workers/ as the wheel does

from .api.async_llm import AsyncLLM
from .api.llm import LLM
from .config import EngineArgs
from .errors import (CheckpointError, EngineDeadError, EngineStartupError, InvalidRequestError,
                     PocketLLMError, PromptTooLongError, RequestFailedError,
                     UnsupportedFeatureError)
from .outputs import GenerationOutput, TokenEvent, Usage
from .sampling import SamplingParams

__version__ = "0.1.0"

__all__ = [
    "LLM", "AsyncLLM", "EngineArgs", "SamplingParams", "GenerationOutput", "TokenEvent", "Usage",
    "PocketLLMError", "InvalidRequestError", "PromptTooLongError", "UnsupportedFeatureError",
    "CheckpointError", "EngineDeadError", "EngineStartupError", "RequestFailedError",
]
