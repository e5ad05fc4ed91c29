"""PocketLLM's wire contract: message structs, the codec and endpoint names.

Installed as ``pocketllm.proto``; imports nothing else of the project.
"""

from . import codec, endpoints, messages
from .messages import PROTOCOL_VERSION

__all__ = ["codec", "endpoints", "messages", "PROTOCOL_VERSION"]
