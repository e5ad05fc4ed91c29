"""What every engine process does at start: read the run's settings, tie its life to
the supervisor's, report ready or failed. Each stage's ``__main__`` calls ``run_stage``.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import signal
import sys
import threading
import time
import traceback
from typing import Callable

import zmq

from .config import EngineArgs
from .errors import CheckpointError, UnsupportedFeatureError
from .model_info import ModelInfo
from .proto import codec, endpoints
from .proto.messages import StageFailed, StageReady

SETTINGS_FILE = "engine.json"


def write_settings(run_dir: str, args: EngineArgs, info: ModelInfo) -> None:
    path = os.path.join(run_dir, SETTINGS_FILE)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump({"args": args.to_dict(), "info": info.to_dict()}, f)


def read_settings(run_dir: str) -> tuple[EngineArgs, ModelInfo]:
    with open(os.path.join(run_dir, SETTINGS_FILE)) as f:
        data = json.load(f)
    return EngineArgs(**data["args"]), ModelInfo(**data["info"])


def die_with_parent() -> None:
    """Ask the kernel to SIGKILL us when the supervisor dies, even by SIGKILL; and poll as a
    fallback for platforms without prctl."""
    parent = os.getppid()
    with contextlib.suppress(OSError, AttributeError):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    if os.getppid() != parent:  # the parent died before prctl took effect
        os._exit(1)

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(0.5)
        os._exit(1)

    threading.Thread(target=watch, daemon=True, name="parent-watch").start()


class StageContext:
    """Sockets and settings handed to a stage's main loop."""

    def __init__(self, stage: str, run_dir: str):
        self.stage = stage
        self.run_dir = run_dir
        self.args, self.info = read_settings(run_dir)
        self.zmq = zmq.Context()
        self._supervisor = self.push(endpoints.supervisor(run_dir))

    def pull(self, endpoint: str) -> zmq.Socket:
        sock = self.zmq.socket(zmq.PULL)
        sock.bind(endpoint)
        return sock

    def push(self, endpoint: str) -> zmq.Socket:
        sock = self.zmq.socket(zmq.PUSH)
        sock.setsockopt(zmq.LINGER, 1000)
        sock.connect(endpoint)
        return sock

    def ready(self, info: dict | None = None, **fields) -> None:
        # torch_loaded lets tests check that only workers import torch.
        info = {**(info or {}), "torch_loaded": "torch" in sys.modules}
        self._supervisor.send(codec.encode(
            StageReady(stage=self.stage, pid=os.getpid(), info=info, **fields)))

    def failed(self, message: str, kind: str) -> None:
        self._supervisor.send(codec.encode(StageFailed(stage=self.stage, message=message,
                                                       kind=kind)))


def _exit_on_sigterm() -> None:
    signal.sigwait({signal.SIGTERM})
    os._exit(0)


def run_stage(stage: str, main: Callable[[StageContext], None]) -> None:
    """Entry point of a stage process: ``python -m pocketllm.<stage> RUN_DIR [...]``."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the supervisor decides when we stop
    # SIGTERM is taken by one thread that waits for nothing else: a handler in the main
    # thread can be missed while it sits inside a blocking socket call. Blocked before any
    # thread starts, so every thread (torch's included) inherits the mask.
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
    threading.Thread(target=_exit_on_sigterm, daemon=True, name="sigterm").start()
    die_with_parent()
    ctx = StageContext(stage, sys.argv[1])
    try:
        main(ctx)
    except (CheckpointError, UnsupportedFeatureError) as e:
        kind = "checkpoint" if isinstance(e, CheckpointError) else "unsupported"
        ctx.failed(str(e), kind)
        time.sleep(0.2)  # let the message leave before exiting
        sys.exit(1)
    except Exception:
        ctx.failed(traceback.format_exc(limit=20), "startup")
        time.sleep(0.2)
        raise
