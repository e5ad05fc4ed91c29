"""AsyncLLM: the offline API for asyncio applications, over the same process graph."""

from __future__ import annotations

import asyncio
import weakref
from typing import Any, AsyncIterator, Optional

from ..config import EngineArgs
from ..outputs import GenerationOutput, TokenEvent
from ..proto.messages import GenerateRequest
from .client import EngineClient
from .requests import Frontend
from .lifecycle import Generation


class AsyncLLM(Frontend):
    """``async with AsyncLLM(EngineArgs(...)) as llm:`` — startup runs off the event loop."""

    def __init__(self, args: Optional[EngineArgs] = None, **kwargs: Any):
        self.args = args if args is not None else EngineArgs(**kwargs)
        self._finalizer: Optional[weakref.finalize] = None

    async def start(self) -> "AsyncLLM":
        if self._client is None:
            self._client = await asyncio.to_thread(EngineClient, self.args)
            self._finalizer = weakref.finalize(self, self._client.close)
        return self

    # ---------------------------------------------------------------- waiting

    async def _whole(self, reqs: list[GenerateRequest]) -> list[GenerationOutput]:
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
