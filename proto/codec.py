"""One msgpack codec per socket: encode any message, decode only the union the socket expects."""

from __future__ import annotations

from typing import Any

import msgspec

from . import messages as m

_encoder = msgspec.msgpack.Encoder()


def encode(msg: Any) -> bytes:
    return _encoder.encode(msg)


class Decoder:
    """Decodes the tagged union ``inbound`` (a ``typing.Union`` of message types)."""

    def __init__(self, inbound: Any):
        self._decoder = msgspec.msgpack.Decoder(inbound)

    def decode(self, data: bytes) -> Any:
        return self._decoder.decode(data)


def decoder_for(stage: str) -> Decoder:
    return Decoder(_INBOUND[stage])


_INBOUND = {
    "frontend": m.FrontendInbound,
    "tokenizer": m.TokenizerInbound,
    "scheduler": m.SchedulerInbound,
    "worker": m.WorkerInbound,
    "detokenizer": m.DetokenizerInbound,
    "supervisor": m.SupervisorInbound,
}
