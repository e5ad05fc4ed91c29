"""The one place that renders chat: message normalization and chat templates.

The checkpoint's own template is the authority. A checkpoint without one (the
embedded Gemma GGUF) uses its family's built-in template (``families.py``); a
family with neither is refused rather than rendered in a made-up format.
"""

from __future__ import annotations

import copy
import json
from functools import lru_cache
from importlib import resources
from typing import Any, Optional

from ..errors import InvalidRequestError, UnsupportedFeatureError
from ..families import BY_NAME

ROLES = ("system", "developer", "user", "assistant", "tool")

# Request fields that only a template can act on; refused when the template ignores them.
TEMPLATE_CONTROLS = ("reasoning_effort", "enable_thinking")


def normalize_messages(messages: Any) -> list[dict]:
    """Validate OpenAI-shaped messages and flatten text-part arrays, on a private copy."""
    if not isinstance(messages, list) or not messages:
        raise InvalidRequestError("'messages' must be a non-empty array of messages", "messages")
    out = []
    for i, msg in enumerate(messages):
        if not isinstance(msg, dict):
            raise InvalidRequestError(f"messages[{i}] must be an object", "messages")
        role = msg.get("role")
        if role not in ROLES:
            raise InvalidRequestError(
                f"messages[{i}].role = {role!r} is not one of {', '.join(ROLES)}", "messages")
        msg = copy.deepcopy(msg)
        msg["content"] = _flatten_content(msg.get("content"), i, role, msg)
        if role == "assistant" and msg.get("tool_calls") is not None:
            _tool_calls_for_template(msg["tool_calls"], i)
        if role == "tool" and not isinstance(msg.get("tool_call_id"), str):
            raise InvalidRequestError(f"messages[{i}] (role \"tool\") needs \"tool_call_id\": "
                                      "the id of the call it answers", "messages")
        if role == "developer":  # OpenAI's newer spelling of the system role
            msg["role"] = "system"
        out.append(msg)
    return out


def _tool_calls_for_template(calls: Any, i: int) -> None:
    """In place, on the private copy: OpenAI sends arguments as a JSON string, and templates
    that iterate them (Qwen3-Coder's `arguments|items`) need the object."""
    if not isinstance(calls, list):
        raise InvalidRequestError(f"messages[{i}].tool_calls must be an array", "messages")
    for j, call in enumerate(calls):
        where = f"messages[{i}].tool_calls[{j}]"
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise InvalidRequestError(f'{where} must be {{"type": "function", "function": '
                                      '{"name": ..., "arguments": ...}}', "messages")
        args = fn.get("arguments")
        if args is None or (isinstance(args, str) and not args.strip()):
            args = {}
        elif isinstance(args, str):
            try:
                args = json.loads(args)
            except ValueError:
                raise InvalidRequestError(f"{where}.function.arguments is not valid JSON",
                                          "messages") from None
        if not isinstance(args, dict):
            raise InvalidRequestError(f"{where}.function.arguments must be a JSON object",
                                      "messages")
        fn["arguments"] = args


def _flatten_content(content: Any, i: int, role: str, msg: dict) -> str:
    if content is None:
        if role == "assistant" and msg.get("tool_calls"):
            return ""
        raise InvalidRequestError(f"messages[{i}].content is missing", "messages")
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for j, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(
                    part.get("text"), str):
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise InvalidRequestError(
                    f"messages[{i}].content[{j}] of type {kind!r} is not supported: this server "
                    "reads text parts only ({\"type\": \"text\", \"text\": ...})", "messages")
            texts.append(part["text"])
        return "\n".join(texts)
    raise InvalidRequestError(
        f"messages[{i}].content must be a string or an array of text parts", "messages")


class ChatRenderer:
    """Renders normalized messages with the checkpoint's (or the family's built-in) template."""

    def __init__(self, template: Optional[str], family: str, special_tokens: dict[str, str]):
        self.stop_token: Optional[str] = None
        builtin = BY_NAME.get(family)
        if template is None and builtin is not None and builtin.template is not None:
            template, self.stop_token = _builtin(builtin.template), builtin.template_stop
        self.template_source = template
        self._template = _compile(template) if template else None
        self._special = special_tokens  # bos_token, eos_token, ... as the template expects

    @property
    def available(self) -> bool:
        return self._template is not None

    def render(self, messages: list[dict], add_generation_prompt: bool = True,
               **template_kwargs: Any) -> str:
        if self._template is None:
            raise UnsupportedFeatureError(
                "this checkpoint has no chat template and PocketLLM has no built-in one for "
                "its family; use generate() with a prompt you format yourself")
        from jinja2 import TemplateError

        for var in TEMPLATE_CONTROLS:
            if var in template_kwargs and var not in self.template_source:
                raise UnsupportedFeatureError(
                    f"this checkpoint's chat template has no {var!r} control, so the request "
                    "cannot be honoured; send it without that field")
        try:
            return self._template.render(messages=messages,
                                         add_generation_prompt=add_generation_prompt,
                                         **self._special, **template_kwargs)
        except TemplateError as e:
            raise InvalidRequestError(f"the chat template rejected these messages: {e}",
                                      "messages") from None


@lru_cache(maxsize=8)
def _builtin(name: str) -> str:
    return resources.files("pocketllm").joinpath("templates", name).read_text(encoding="utf-8")


@lru_cache(maxsize=8)
def _compile(source: str):
    from jinja2.exceptions import TemplateError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str):
        raise TemplateError(message)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=["jinja2.ext.loopcontrols"])
    env.globals["raise_exception"] = raise_exception
    env.filters["tojson"] = _tojson  # JSON as templates expect it, not HTML-escaped
    return env.from_string(source)


def _tojson(value: Any, indent: Optional[int] = None, ensure_ascii: bool = False,
            sort_keys: bool = False) -> str:
    return json.dumps(value, indent=indent, ensure_ascii=ensure_ascii, sort_keys=sort_keys)
