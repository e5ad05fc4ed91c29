"""Checks on an engine's process group shared by the lifecycle tests."""

from __future__ import annotations

import os
import signal
import time

import psutil
import pytest

from pocketllm import EngineDeadError, SamplingParams


def engine_procs(llm) -> list[psutil.Process]:
    return [psutil.Process(p.pid) for p in llm._client.supervisor.procs.values()]


def assert_gone(procs: list[psutil.Process], timeout: float = 10.0) -> None:
    _gone, alive = psutil.wait_procs(procs, timeout=timeout)
    assert not alive, f"left behind: {alive}"


def assert_kill_fails_everything(llm, stream, victim: str) -> None:
    """SIGKILL one process mid-stream: the stream and every later request fail with
    EngineDeadError within 5 s, and no process of the group is left."""
    procs = engine_procs(llm)
    os.kill(llm._client.supervisor.procs[victim].pid, signal.SIGKILL)
    t0 = time.monotonic()
    with pytest.raises(EngineDeadError):
        for _ in stream:
            pass
        # the stream may have finished before the kill landed: a later request must fail
        llm.generate("again", SamplingParams(max_tokens=4))
    assert time.monotonic() - t0 < 5
    with pytest.raises(EngineDeadError):
        llm.generate("later", SamplingParams(max_tokens=4))
    assert_gone(procs)
    llm.shutdown()
