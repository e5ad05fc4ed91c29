"""LLM: the synchronous offline API, a thin wrapper running the one request lifecycle
(``lifecycle.Generation``) on an event loop of its own thread."""

from __future__ import annotations

import asyncio
import threading
import weakref
from typing import Any, Coroutine, Iterator, Optional, Sequence, Union

from ..config import EngineArgs
from ..errors import EngineDeadError, PocketLLMError
from ..outputs import GenerationOutput, TokenEvent
from ..proto.messages import GenerateRequest
from ..sampling import SamplingParams
from .client import EngineClient
from .lifecycle import Generation
from .requests import Prompt, chat_request, prompt_request, sampling_list, split_prompts


class LoopThread:
    """An asyncio loop on a daemon thread, so synchronous calls can await the lifecycle
    (and work from inside another running loop, such as a notebook's)."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True,
                                        name="pocketllm-llm-loop")
        self._thread.start()

    def run(self, coro: Coroutine) -> Any:
        if self.loop.is_closed():
            coro.close()
            raise EngineDeadError("the engine has been shut down")
        future = asyncio.run_coroutine_threadsafe(coro, self.loop)
        try:
            return future.result()
        except BaseException:
            future.cancel()  # interrupted while waiting (Ctrl-C): the coroutine is cancelled
            raise

    def close(self) -> None:
        if self.loop.is_closed():
            return
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=5)
        if not self._thread.is_alive():
            self.loop.close()


def _close(client: EngineClient, loop: LoopThread) -> None:
    client.close()  # first: its last EngineDeadErrors still reach the loop
    loop.close()


class LLM:
    """``LLM(EngineArgs(...))``; ``LLM()`` serves the embedded Gemma 3 270M on this machine."""

    def __init__(self, args: Optional[EngineArgs] = None, **kwargs: Any):
        self.args = args if args is not None else EngineArgs(**kwargs)
        self._client = EngineClient(self.args)
        self._loop = LoopThread()
        # Stop the process group when this object is collected or at interpreter exit.
        self._finalizer = weakref.finalize(self, _close, self._client, self._loop)

    # ---------------------------------------------------------------- info

    @property
    def capabilities(self):
        """What the engine declared at startup (block size, KV blocks, max slots, ...)."""
        return self._client.capabilities

    def engine_caps(self):
        return self._client.capabilities

    def engine_stats(self):
        """The scheduler's latest gauges and counters (``SchedulerStats``), as the server's
        /metrics shows them; sent after steps (at most every 0.1 s) and when it goes idle."""
        return self._client.stats

    @property
    def model_info(self):
        return self._client.info

    # ---------------------------------------------------------------- generate

    def generate(self, prompts: Union[Prompt, Sequence[Prompt]],
                 sampling_params: Union[None, SamplingParams, Sequence[SamplingParams]] = None,
                 ) -> list[GenerationOutput]:
        items = split_prompts(prompts)
        params = sampling_list(sampling_params, len(items))
        reqs = [prompt_request(p, sp, limits=self._client.limits)
                for p, sp in zip(items, params)]
        return self._run_all(reqs)

    def chat(self, messages: list[dict], sampling_params: Optional[SamplingParams] = None,
             *, request_id: Optional[str] = None, **chat_options: Any) -> list[GenerationOutput]:
        req = chat_request(messages, sampling_params or SamplingParams(),
                           request_id=request_id, limits=self._client.limits,
                           **chat_options)
        return self._run_all([req])

    def generate_stream(self, prompt: Prompt, sampling_params: Optional[SamplingParams] = None,
                        *, request_id: Optional[str] = None) -> Iterator[TokenEvent]:
        req = prompt_request(prompt, sampling_params or SamplingParams(), request_id,
                             self._client.limits)
        return self._stream(req)

    def chat_stream(self, messages: list[dict], sampling_params: Optional[SamplingParams] = None,
                    *, request_id: Optional[str] = None, **chat_options: Any
                    ) -> Iterator[TokenEvent]:
        req = chat_request(messages, sampling_params or SamplingParams(),
                           request_id=request_id, limits=self._client.limits,
                           **chat_options)
        return self._stream(req)

    def cancel(self, request_id: str) -> bool:
        """Cancel at the next step boundary. True only if the request was active."""
        return bool(self._client.abort([request_id]))

    # ---------------------------------------------------------------- plumbing

    def _run_all(self, reqs: list[GenerateRequest]) -> list[GenerationOutput]:
        gen = Generation(self._client, reqs)
        try:
            return self._loop.run(gen.run())
        except BaseException:
            gen.cancel()  # a Ctrl-C here leaves nothing running (the loop's side cancels too)
            raise

    def _stream(self, req: GenerateRequest) -> Iterator[TokenEvent]:
        gen = Generation(self._client, [req])
        self._loop.run(gen.__aenter__())  # submitted now: a refusal raises at the call

        def events() -> Iterator[TokenEvent]:
            try:
                while (item := self._loop.run(gen.next())) is not None:
                    yield item[1]
            finally:
                gen.cancel()  # the caller stopped iterating (or it failed): stop generating

        return events()

    # ---------------------------------------------------------------- lifecycle

    def shutdown(self) -> None:
        self._finalizer()

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.shutdown()


__all__ = ["LLM", "PocketLLMError"]
