"""AsyncLLM: the offline API for asyncio applications, over the same process graph."""

from __future__ import annotations

import asyncio
import weakref
from typing import Any, AsyncIterator, Optional, Sequence, Union

from ..config import EngineArgs
from ..errors import EngineDeadError
from ..outputs import GenerationOutput, TokenEvent
from ..proto.messages import GenerateRequest
from ..sampling import SamplingParams
from .client import EngineClient
from .lifecycle import Generation
from .requests import Prompt, chat_request, prompt_request, sampling_list, split_prompts


class AsyncLLM:
    """``async with AsyncLLM(EngineArgs(...)) as llm:`` — startup runs off the event loop."""

    def __init__(self, args: Optional[EngineArgs] = None, **kwargs: Any):
        self.args = args if args is not None else EngineArgs(**kwargs)
        self._client: Optional[EngineClient] = None
        self._finalizer: Optional[weakref.finalize] = None

    async def start(self) -> "AsyncLLM":
        if self._client is None:
            self._client = await asyncio.to_thread(EngineClient, self.args)
            self._finalizer = weakref.finalize(self, self._client.close)
        return self

    @property
    def client(self) -> EngineClient:
        if self._client is None:
            raise EngineDeadError("the engine is not started: use 'async with AsyncLLM(...)' "
                                  "or 'await llm.start()'")
        return self._client

    @property
    def capabilities(self):
        return self.client.capabilities

    def engine_caps(self):
        return self.client.capabilities

    def engine_stats(self):
        """See ``LLM.engine_stats``."""
        return self.client.stats

    # ---------------------------------------------------------------- API

    async def generate(self, prompts: Union[Prompt, Sequence[Prompt]],
                       sampling_params: Union[None, SamplingParams,
                                              Sequence[SamplingParams]] = None,
                       ) -> list[GenerationOutput]:
        items = split_prompts(prompts)
        params = sampling_list(sampling_params, len(items))
        reqs = [prompt_request(p, sp, limits=self.client.limits)
                for p, sp in zip(items, params)]
        return await self._run(reqs)

    async def chat(self, messages: list[dict], sampling_params: Optional[SamplingParams] = None,
                   *, request_id: Optional[str] = None, **chat_options: Any
                   ) -> list[GenerationOutput]:
        req = chat_request(messages, sampling_params or SamplingParams(),
                           request_id=request_id, limits=self.client.limits,
                           **chat_options)
        return await self._run([req])

    def generate_stream(self, prompt: Prompt, sampling_params: Optional[SamplingParams] = None,
                        *, request_id: Optional[str] = None) -> AsyncIterator[TokenEvent]:
        return self._stream(prompt_request(prompt, sampling_params or SamplingParams(),
                                           request_id, self.client.limits))

    def chat_stream(self, messages: list[dict], sampling_params: Optional[SamplingParams] = None,
                    *, request_id: Optional[str] = None, **chat_options: Any
                    ) -> AsyncIterator[TokenEvent]:
        return self._stream(chat_request(messages, sampling_params or SamplingParams(),
                                         request_id=request_id, limits=self.client.limits,
                                         **chat_options))

    def cancel(self, request_id: str) -> bool:
        return bool(self.client.abort([request_id]))

    # ---------------------------------------------------------------- plumbing

    async def _run(self, reqs: list[GenerateRequest]) -> list[GenerationOutput]:
        return await Generation(self.client, reqs).run()

    async def _stream(self, req: GenerateRequest) -> AsyncIterator[TokenEvent]:
        async with Generation(self.client, [req]) as gen:  # leaving it early aborts the request
            while (item := await gen.next()) is not None:
                yield item[1]

    # ---------------------------------------------------------------- lifecycle

    async def shutdown(self) -> None:
        if self._finalizer is not None:
            await asyncio.to_thread(self._finalizer)

    async def __aenter__(self) -> "AsyncLLM":
        return await self.start()

    async def __aexit__(self, *exc: Any) -> None:
        await self.shutdown()
