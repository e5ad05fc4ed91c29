"""What LLM and AsyncLLM share: the engine's declarations, cancel, and calls made into
GenerateRequests. They differ only in how they wait on the lifecycle (api/lifecycle.py)."""

from __future__ import annotations

from typing import Any, Optional, Sequence, Union

from ..errors import EngineDeadError
from ..proto.messages import GenerateRequest
from ..sampling import SamplingParams
from .client import EngineClient
from .requests import Prompt, chat_request, prompt_request, sampling_list, split_prompts

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

    def _generate_requests(self, prompts: Union[Prompt, Sequence[Prompt]],
                           sampling_params: Params) -> list[GenerateRequest]:
        items = split_prompts(prompts)
        params = sampling_list(sampling_params, len(items))
        return [prompt_request(p, sp, limits=self.client.limits) for p, sp in zip(items, params)]

    def _prompt_request(self, prompt: Prompt, sampling_params: Optional[SamplingParams],
                        request_id: Optional[str]) -> GenerateRequest:
        return prompt_request(prompt, sampling_params or SamplingParams(), request_id,
                              self.client.limits)

    def _chat_request(self, messages: list[dict], sampling_params: Optional[SamplingParams],
                      request_id: Optional[str], options: dict[str, Any]) -> GenerateRequest:
        return chat_request(messages, sampling_params or SamplingParams(),
                            request_id=request_id, limits=self.client.limits, **options)
