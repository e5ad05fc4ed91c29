"""LLM: the synchronous offline API over the process graph."""

from __future__ import annotations

import queue
import weakref
from typing import Any, Iterator, Optional, Sequence, Union

from ..config import EngineArgs
from ..errors import PocketLLMError, RequestFailedError
from ..outputs import GenerationOutput, TokenEvent
from ..proto.messages import GenerateRequest, RequestOutput
from ..sampling import SamplingParams
from .client import EngineClient
from .requests import Prompt, chat_request, prompt_request, sampling_list, split_prompts


def event_or_raise(item: Union[RequestOutput, Exception]) -> TokenEvent:
    """The event of one delta; a failed request raises its typed error (pocketllm/errors.py)."""
    if isinstance(item, Exception):
        raise item
    event = TokenEvent.from_wire(item)
    if event.finish_reason == "error":  # (the client raises the stage's own error first)
        raise RequestFailedError(f"request {event.request_id} failed in the engine")
    return event


class LLM:
    """``LLM(EngineArgs(...))``; ``LLM()`` serves the embedded Gemma 3 270M on this machine."""

    def __init__(self, args: Optional[EngineArgs] = None, **kwargs: Any):
        self.args = args if args is not None else EngineArgs(**kwargs)
        self._client = EngineClient(self.args)
        # Stop the process group when this object is collected or at interpreter exit.
        self._finalizer = weakref.finalize(self, self._client.close)

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
        inbox: queue.SimpleQueue = queue.SimpleQueue()
        results = {r.request_id: GenerationOutput(r.request_id) for r in reqs}
        submitted = []
        try:
            for r in reqs:
                self._client.submit(r, lambda item, rid=r.request_id: inbox.put((rid, item)))
                submitted.append(r.request_id)
            pending = set(submitted)
            while pending:
                rid, item = inbox.get()
                event = event_or_raise(item)
                results[rid].add(event)
                if event.finished:
                    pending.discard(rid)
        except BaseException:
            self._client.abort(submitted)  # a failure or Ctrl-C leaves nothing running
            raise
        return [results[r.request_id] for r in reqs]

    def _stream(self, req: GenerateRequest) -> Iterator[TokenEvent]:
        inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._client.submit(req, inbox.put)

        def events() -> Iterator[TokenEvent]:
            finished = False
            try:
                while not finished:
                    event = event_or_raise(inbox.get())
                    finished = event.finished
                    yield event
            finally:
                if not finished:  # the caller stopped iterating: stop generating
                    self._client.abort([req.request_id])

        return events()

    # ---------------------------------------------------------------- lifecycle

    def shutdown(self) -> None:
        self._finalizer()

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.shutdown()


__all__ = ["LLM", "PocketLLMError"]
