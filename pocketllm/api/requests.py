"""The offline API that LLM and AsyncLLM share: calls made into GenerateRequests (checked
as the HTTP edge checks them), the engine's declarations, cancel. The two differ only in
how they wait on the one request lifecycle (api/lifecycle.py): ``_whole`` and
``_stream``, blocking or async."""

from __future__ import annotations

import dataclasses
import uuid
from typing import Any, Optional, Sequence, Union

from ..errors import EngineDeadError, InvalidRequestError
from ..proto.messages import GenerateRequest
from ..protocol import limits as L
from ..protocol.chat import normalize_messages
from ..protocol.limits import DEFAULT_LIMITS, RequestLimits
from ..protocol.tool_choice import tool_options
from ..sampling import SamplingParams
from .client import EngineClient

Prompt = Union[str, Sequence[int]]


def split_prompts(prompts: Union[Prompt, Sequence[Prompt]]) -> list[Prompt]:
    """A string, a token-id list, or a batch of either."""
    if isinstance(prompts, str):
        return [prompts]
    if isinstance(prompts, (list, tuple)):
        if prompts and all(isinstance(t, int) and not isinstance(t, bool) for t in prompts):
            return [list(prompts)]
        return list(prompts)
    raise InvalidRequestError("prompts must be a string, a list of token ids, or a list of those",
                              "prompt")


def sampling_list(params: Union[None, SamplingParams, Sequence[SamplingParams]],
                  n: int) -> list[SamplingParams]:
    if params is None:
        return [SamplingParams() for _ in range(n)]
    if isinstance(params, SamplingParams):
        return [params] * n
    params = list(params)
    if len(params) != n:
        raise InvalidRequestError(f"{len(params)} sampling params for {n} prompts",
                                  "sampling_params")
    return params


def _request_id(request_id: Optional[str]) -> str:
    return L.check_request_id(request_id) if request_id else uuid.uuid4().hex


def prompt_request(prompt: Prompt, params: SamplingParams, request_id: Optional[str] = None,
                   limits: RequestLimits = DEFAULT_LIMITS) -> GenerateRequest:
    """limits: the engine's (EngineClient.limits), which carry the model's bounds."""
    params.validate(limits)
    rid = _request_id(request_id)
    if isinstance(prompt, str):
        if not prompt:
            raise InvalidRequestError("the prompt is empty", "prompt")
        L.check_prompt_chars(len(prompt), limits, "prompt")
        L.check_text("prompt", prompt)
        return GenerateRequest(rid, params.to_spec(), prompt=prompt)
    if isinstance(prompt, (list, tuple)):
        ids = list(prompt)
        if not ids:
            raise InvalidRequestError("the prompt is empty", "prompt")
        if not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
            raise InvalidRequestError("a token-id prompt must hold integers only", "prompt")
        L.check_prompt_ids(ids, limits)
        return GenerateRequest(rid, params.to_spec(), prompt_token_ids=ids)
    raise InvalidRequestError(f"a prompt must be a string or a list of token ids, "
                              f"not {type(prompt).__name__}", "prompt")


def chat_request(messages: Any, params: SamplingParams, *, request_id: Optional[str] = None,
                 add_generation_prompt: bool = True, tools: Any = None, tool_choice: Any = None,
                 parallel_tool_calls: Optional[bool] = None,
                 response_format: Any = None, reasoning_effort: Optional[str] = None,
                 thinking_mode: Optional[bool] = None, drop_thinking: Optional[bool] = None,
                 chat_template_kwargs: Optional[dict] = None,
                 limits: RequestLimits = DEFAULT_LIMITS) -> GenerateRequest:
    """The same checks as the HTTP edge (protocol/limits.py) on what the caller passed."""
    params.validate(limits)
    rid = _request_id(request_id)
    for param, value in (("messages", messages), ("tools", tools),
                         ("chat_template_kwargs", chat_template_kwargs),
                         ("response_format", response_format)):
        L.check_structure(value, limits.max_json_depth, param, what=f'"{param}"')
    L.check_messages(messages, limits)
    L.check_template_kwargs(chat_template_kwargs)
    L.check_tools(tools)
    if response_format is not None:  # protocol/response_format.py, as on HTTP
        if params.response_format is not None:
            raise InvalidRequestError("response_format is given twice (as chat()'s argument and "
                                      "in SamplingParams); give it once", "response_format")
        params = dataclasses.replace(params, response_format=response_format)  # validates it
    opts: dict[str, Any] = dict(chat_template_kwargs or {})
    opts["add_generation_prompt"] = bool(add_generation_prompt)
    # Templates that know these variables act on them (e.g. Qwen3's enable_thinking).
    if reasoning_effort is not None:
        opts["reasoning_effort"] = reasoning_effort
    if thinking_mode is not None:
        opts["enable_thinking"] = bool(thinking_mode)
    if drop_thinking:  # the tokenizer stage reads it (protocol/reasoning.py), not the template
        opts["drop_thinking"] = True
    opts.update(tool_options(tools, tool_choice, parallel_tool_calls,  # protocol/tool_choice.py
                             response_format=response_format,
                             template_kwargs=chat_template_kwargs))
    normalized = normalize_messages(messages)
    L.check_message_chars(normalized, limits)
    return GenerateRequest(rid, params.to_spec(), messages=normalized, chat_options=opts)


Params = Union[None, SamplingParams, Sequence[SamplingParams]]


class Frontend:
    _client: Optional[EngineClient] = None

    @property
    def client(self) -> EngineClient:
        if self._client is None:
            raise EngineDeadError("the engine is not started: use 'async with AsyncLLM(...)' "
                                  "or 'await llm.start()'")
        return self._client

    @property
    def capabilities(self):
        """What the engine declared at startup (block size, KV blocks, max slots, ...)."""
        return self.client.capabilities

    def engine_caps(self):
        return self.client.capabilities

    def engine_stats(self):
        """The scheduler's latest gauges and counters (``SchedulerStats``), as the server's
        /metrics shows them; sent after steps (at most every 0.1 s) and when it goes idle."""
        return self.client.stats

    @property
    def model_info(self):
        return self.client.info

    def cancel(self, request_id: str) -> bool:
        """Cancel at the next step boundary. True only if the request was active."""
        return bool(self.client.abort([request_id]))

    # ---------------------------------------------------------------- generate
    # LLM returns the outputs and yields events; AsyncLLM returns a coroutine of the outputs
    # and an async iterator of events.

    def generate(self, prompts: Union[Prompt, Sequence[Prompt]], sampling_params: Params = None):
        """A string, a token-id list, or a batch of either; one SamplingParams or one each."""
        items = split_prompts(prompts)
        params = sampling_list(sampling_params, len(items))
        return self._whole([prompt_request(p, sp, limits=self.client.limits)
                            for p, sp in zip(items, params)])

    def chat(self, messages: list[dict], sampling_params: Optional[SamplingParams] = None,
             *, request_id: Optional[str] = None, **chat_options: Any):
        """A one-element list of outputs."""
        return self._whole([self._chat_request(messages, sampling_params, request_id,
                                               chat_options)])

    def generate_stream(self, prompt: Prompt, sampling_params: Optional[SamplingParams] = None,
                        *, request_id: Optional[str] = None):
        return self._stream(prompt_request(prompt, sampling_params or SamplingParams(),
                                           request_id, self.client.limits))

    def chat_stream(self, messages: list[dict], sampling_params: Optional[SamplingParams] = None,
                    *, request_id: Optional[str] = None, **chat_options: Any):
        return self._stream(self._chat_request(messages, sampling_params, request_id,
                                               chat_options))

    def _chat_request(self, messages: list[dict], sampling_params: Optional[SamplingParams],
                      request_id: Optional[str], options: dict[str, Any]) -> GenerateRequest:
        return chat_request(messages, sampling_params or SamplingParams(),
                            request_id=request_id, limits=self.client.limits, **options)
