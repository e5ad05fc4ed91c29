"""LLM: the synchronous offline API, a thin wrapper running the one request lifecycle
(``lifecycle.Generation``) on an event loop of its own thread."""

from __future__ import annotations

import asyncio
import threading
import weakref
from typing import Any, Coroutine, Iterator, Optional

from ..config import EngineArgs
from ..errors import EngineDeadError, PocketLLMError
from ..outputs import GenerationOutput, TokenEvent
from ..proto.messages import GenerateRequest
from .client import EngineClient
from .requests import Frontend
from .lifecycle import Generation


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
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(timeout=5)  # a callback stuck in a dead engine must not hang exit
            if not self._thread.is_alive():
                self.loop.close()


def _close(client: EngineClient, loop: LoopThread) -> None:
    client.close()  # first: its last EngineDeadErrors still reach the loop
    loop.close()


class LLM(Frontend):
    """``LLM(EngineArgs(...))``; ``LLM()`` serves the embedded Gemma 3 270M on this machine."""

    def __init__(self, args: Optional[EngineArgs] = None, **kwargs: Any):
        self.args = args if args is not None else EngineArgs(**kwargs)
        self._client = EngineClient(self.args)
        self._loop = LoopThread()
        # Stop the process group when this object is collected or at interpreter exit.
        self._finalizer = weakref.finalize(self, _close, self._client, self._loop)

    # ---------------------------------------------------------------- waiting

    def _whole(self, reqs: list[GenerateRequest]) -> list[GenerationOutput]:
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
