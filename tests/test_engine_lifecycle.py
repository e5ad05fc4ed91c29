"""The process graph's lifecycle: startup, torch isolation, death, shutdown, no leftovers."""

from __future__ import annotations

import gc
import os
import shutil
import subprocess
import sys
import threading
import time

import psutil
import pytest
import zmq

from pocketllm import LLM, EngineArgs, EngineDeadError, SamplingParams
from pocketllm import supervisor as sv
from pocketllm.model_info import load_model_info
from pocketllm.proto import codec, endpoints
from pocketllm.proto.messages import StageReady
from process_checks import assert_gone, assert_kill_fails_everything, engine_procs


def assert_pids_gone(pids: list[int]) -> None:
    assert_gone([psutil.Process(p) for p in pids if psutil.pid_exists(p)])


def test_import_does_not_load_torch():
    code = "import sys, pocketllm, pocketllm.cli; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_only_workers_load_torch(llm_tiny):
    ready = llm_tiny._client.supervisor.ready
    assert set(ready) == {"tokenizer", "detokenizer", "scheduler", "worker0"}
    for stage, msg in ready.items():
        assert msg.info["torch_loaded"] == (stage == "worker0"), stage


def test_capabilities_declared(llm_tiny):
    caps = llm_tiny.engine_caps()
    assert caps.num_kv_blocks > 0 and caps.block_size == 16
    assert caps.continuous_batching and caps.paged_kv and caps.chunked_prefill
    assert caps.vocab_size == llm_tiny.model_info.vocab_size


def test_killed_worker_fails_requests_and_reaps_group(tiny_llama):
    llm = LLM(EngineArgs(model=tiny_llama))
    stream = llm.generate_stream("hello", SamplingParams(max_tokens=200,
                                                         ignore_eos=True, temperature=0))
    assert_kill_fails_everything(llm, stream, "worker0")


def test_shutdown_with_block_and_gc_stop_everything(tiny_llama):
    with LLM(EngineArgs(model=tiny_llama)) as llm:
        pids = [p.pid for p in engine_procs(llm)]
        run_dir = llm._client.supervisor.run_dir
        assert oct(os.stat(run_dir).st_mode & 0o777) == "0o700"
        llm.generate("hi", SamplingParams(max_tokens=2))
    assert_pids_gone(pids)
    assert not os.path.exists(run_dir)
    with pytest.raises(EngineDeadError):
        llm.generate("after", SamplingParams(max_tokens=2))

    llm = LLM(EngineArgs(model=tiny_llama))
    pids = [p.pid for p in engine_procs(llm)]
    del llm
    gc.collect()
    assert_pids_gone(pids)


def test_interpreter_exit_stops_everything(tiny_llama):
    code = (f"from pocketllm import LLM, EngineArgs; llm = LLM(EngineArgs(model={tiny_llama!r}));"
            "print(' '.join(str(p.pid) for p in llm._client.supervisor.procs.values()), flush=True)")
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True,
                         timeout=120)
    pids = [int(p) for p in out.stdout.split()]
    assert len(pids) == 4
    assert_pids_gone(pids)


def test_parent_killed_takes_children(tiny_llama):
    code = (f"import time; from pocketllm import LLM, EngineArgs; llm = LLM(EngineArgs(model={tiny_llama!r}));"
            "print(' '.join(str(p.pid) for p in llm._client.supervisor.procs.values()), flush=True);"
            "time.sleep(60)")
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    pids = [int(p) for p in proc.stdout.readline().split()]
    assert len(pids) == 4
    proc.kill()
    proc.wait()
    assert_pids_gone(pids)


def test_short_starts_wait_for_a_free_core(monkeypatch, default_model_path):
    """On two cores the tokenizer and the worker start at once; the scheduler, then the
    detokenizer, each once a start has finished (docs/architecture.md, start-up)."""
    class Running:  # a stage process that never exits
        pid = 0

        def poll(self):
            return None

    spawned: list[str] = []
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1})
    monkeypatch.setattr(sv.Supervisor, "_spawn", lambda self, name, *a, **k: (
        spawned.append(name), self.procs.__setitem__(name, Running())))
    monkeypatch.setattr(sv.Supervisor, "shutdown", lambda self: None)
    args = EngineArgs()
    sup = sv.Supervisor(args, load_model_info(args))
    starting = threading.Thread(target=sup.start)
    starting.start()
    ctx = zmq.Context()
    push = ctx.socket(zmq.PUSH)
    push.connect(endpoints.supervisor(sup.run_dir))

    def after(stage: str) -> list[str]:
        if stage:
            push.send(codec.encode(StageReady(stage=stage, pid=0)))
        time.sleep(0.5)
        return list(spawned)

    try:
        assert after("") == ["tokenizer", "worker0"]
        assert after("worker0") == ["tokenizer", "worker0", "scheduler"]
        assert after("scheduler") == ["tokenizer", "worker0", "scheduler", "detokenizer"]
        after("detokenizer")
        after("tokenizer")
        starting.join(timeout=10)
        assert not starting.is_alive() and set(sup.ready) == set(spawned)
    finally:
        push.close(linger=0)
        ctx.term()
        sup._stopping.set()
        sup._inbox.close(linger=0)
        sup._zmq.term()
        shutil.rmtree(sup.run_dir, ignore_errors=True)
