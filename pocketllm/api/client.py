"""The frontend half of the process graph, shared by LLM, AsyncLLM and the HTTP server.

It starts the supervisor, sends requests to the tokenizer and aborts to the
scheduler, and routes every RequestOutput/RequestError arriving on its one
inbound socket to the sink registered for that request.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Callable, Optional, Union

import msgspec
import zmq

from ..config import EngineArgs
from ..errors import EngineDeadError, InvalidRequestError, RequestIdInUseError, error_from_wire
from ..model_info import ModelInfo, load_model_info
from ..proto import codec, endpoints
from ..proto.messages import (Abort, GenerateRequest, Pong, RequestError, RequestOutput,
                              SchedulerStats)
from ..protocol.limits import RequestLimits
from ..supervisor import Supervisor
from .heartbeat import Heartbeat

log = logging.getLogger("pocketllm.client")

# A sink receives RequestOutput deltas, then stops after a finished one or an exception
# (a request that failed, at any stage, ends with the typed exception of its error kind).
Sink = Callable[[Union[RequestOutput, Exception]], None]

__all__ = ["EngineClient", "Sink", "error_from_wire"]


class EngineClient:
    def __init__(self, args: EngineArgs, cancel: Optional[threading.Event] = None,
                 info: Optional[ModelInfo] = None):
        """``cancel``: another thread sets it to abandon the startup (EngineStartupError).
        ``info``: ``load_model_info(args)`` where the caller read it already (the server
        does, first: a Hugging Face id is fetched once)."""
        self.args = args
        # a bad checkpoint fails here, fast
        self.info: ModelInfo = info if info is not None else load_model_info(args)
        # What a request may hold (protocol/limits.py): the engine's settings, the model's bounds.
        self.limits = RequestLimits.from_args(args).for_model(self.info.vocab_size,
                                                              self.info.max_model_len)
        self._sinks: dict[str, Sink] = {}
        self._lock = threading.Lock()  # guards _sinks and the outbound sockets
        self._dead: Optional[str] = None
        self._closed = False
        self.stats = SchedulerStats()  # the scheduler's latest gauges and counters
        t0 = time.monotonic()
        self.supervisor = Supervisor(args, self.info, on_death=self._on_death)
        run_dir = self.supervisor.run_dir
        self._zmq = zmq.Context()
        self._inbox = self._zmq.socket(zmq.PULL)
        self._inbox.bind(endpoints.frontend(run_dir))
        self._to_tokenizer = self._push(endpoints.tokenizer(run_dir))
        self._to_scheduler = self._push(endpoints.scheduler(run_dir))
        self._receiver = threading.Thread(target=self._receive, daemon=True,
                                          name="pocketllm-receiver")
        try:
            self.supervisor.start(cancel=cancel)
        except BaseException:
            self._close_sockets()
            raise
        self.startup_seconds = time.monotonic() - t0
        self.capabilities = self.supervisor.capabilities
        # Owned by the receiver thread, which sends the pings and takes the answers.
        self.heartbeat = Heartbeat(self._zmq, _stage_endpoints(run_dir, self.supervisor.procs),
                                   args.heartbeat_timeout)
        self._receiver.start()

    def _push(self, endpoint: str) -> zmq.Socket:
        sock = self._zmq.socket(zmq.PUSH)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(endpoint)
        return sock

    # ---------------------------------------------------------------- requests

    def submit(self, req: GenerateRequest, sink: Sink) -> None:
        """Send one request; the id is registered only once nothing can fail before the
        tokenizer has it (every later failure reaches the sink and unregisters it)."""
        req.arrival_time = time.time()
        try:
            data = codec.encode(req)
        except (OverflowError, UnicodeEncodeError, TypeError, ValueError) as e:
            raise InvalidRequestError(f"the request holds a value that cannot be sent to the "
                                      f"engine ({e}): integers must fit 64 bits and text must "
                                      "be valid Unicode") from None
        with self._lock:
            self._check_alive()
            if req.request_id in self._sinks:
                raise RequestIdInUseError(
                    f"request_id {req.request_id!r} is already in use by an active request",
                    "request_id")
            self._sinks[req.request_id] = sink
            try:
                self._to_tokenizer.send(data)
            except BaseException:
                del self._sinks[req.request_id]
                raise

    def abort(self, request_ids: list[str]) -> list[str]:
        """Cancel at the next step boundary; returns the ids that were active."""
        with self._lock:
            active = [r for r in request_ids if r in self._sinks]
            if active and self._dead is None and not self._closed:
                try:  # never block here, under the lock: a scheduler that died (Ctrl-C
                    # reaches every stage) reads nothing, and close() needs the lock
                    self._to_scheduler.send(codec.encode(Abort(request_ids=active)), zmq.NOBLOCK)
                except zmq.Again:
                    pass  # not reading: the heartbeat reports it
        return active

    def is_active(self, request_id: str) -> bool:
        return request_id in self._sinks

    def num_active(self) -> int:
        return len(self._sinks)

    def _check_alive(self) -> None:
        if self._dead is not None:
            raise EngineDeadError(f"the engine is dead: {self._dead}")
        if self._closed:
            raise EngineDeadError("the engine has been shut down")

    # ---------------------------------------------------------------- inbound

    def _receive(self) -> None:
        decoder = codec.decoder_for("frontend")
        while not self._closed:
            try:
                self.heartbeat.tick()
                if not self._inbox.poll(100):
                    continue
                msg = decoder.decode(self._inbox.recv())
            except zmq.ZMQError:
                return
            except msgspec.DecodeError:  # never expected; losing one message beats all of them
                log.exception("the frontend received a message it cannot decode")
                continue
            if isinstance(msg, Pong):
                self.heartbeat.on_pong(msg)
                continue
            if isinstance(msg, SchedulerStats):
                self.stats = msg
                continue
            last = isinstance(msg, RequestError) or msg.finished
            with self._lock:
                sink = self._sinks.pop(msg.request_id, None) if last \
                    else self._sinks.get(msg.request_id)
            if sink is None:
                continue
            if isinstance(msg, RequestError):  # refused, or failed before its first output
                sink(error_from_wire(msg))
            elif msg.finished and msg.error is not None:  # it failed after it started
                sink(error_from_wire(msg.error, msg.request_id))
            else:
                sink(msg)

    def _on_death(self, reason: str) -> None:
        with self._lock:
            self._dead = reason
            sinks, self._sinks = self._sinks, {}
        for sink in sinks.values():
            sink(EngineDeadError(f"the engine died: {reason}"))

    # ---------------------------------------------------------------- stop

    def close(self) -> None:
        if self._closed:
            return
        with self._lock:
            self._closed = True
            sinks, self._sinks = self._sinks, {}
        for sink in sinks.values():
            sink(EngineDeadError("the engine was shut down"))
        self.supervisor.shutdown()
        if self._receiver.is_alive():
            self._receiver.join(timeout=2)
        self._close_sockets()

    def _close_sockets(self) -> None:
        for sock in (self._inbox, self._to_tokenizer, self._to_scheduler):
            sock.close(linger=0)
        if getattr(self, "heartbeat", None) is not None:
            self.heartbeat.close()
        self._zmq.destroy(linger=0)  # term() would wait for any socket left open


def _stage_endpoints(run_dir: str, procs) -> dict[str, str]:
    """Each local stage's inbound socket (ranks on other hosts are the scheduler's to watch)."""
    out = {}
    for name in procs:
        if name.startswith("worker"):
            out[name] = endpoints.worker(run_dir, int(name.removeprefix("worker")))
        else:
            out[name] = getattr(endpoints, name)(run_dir)
    return out
