"""`pocketllm serve` as a process group: drain on SIGTERM, reaping on death, timeouts."""

from __future__ import annotations

import json
import os
import signal
import stat
import subprocess
import sys
import threading
import time

import httpx
import psutil

from process_checks import assert_gone
from server_process import ServerProcess, free_port


def group_of(proc: subprocess.Popen) -> list[psutil.Process]:
    return psutil.Process(proc.pid).children(recursive=True)


def test_sigterm_drains_in_flight_requests_then_exits_0(tiny_llama, tmp_path):
    # A drain long enough for the request to finish even on a loaded machine.
    srv = ServerProcess("--model", tiny_llama, "--max-model-len", "4096",
                        "--tensor-parallel-shutdown-timeout", "90",
                        "--tensor-parallel-rendezvous-dir", str(tmp_path))
    children = group_of(srv.proc)
    run_dirs = [p for p in os.listdir(tmp_path) if p.startswith("pocketllm-")]
    assert len(run_dirs) == 1
    assert stat.S_IMODE(os.stat(tmp_path / run_dirs[0]).st_mode) == 0o700
    finish, text = [], []

    def stream():
        with httpx.stream("POST", srv.url + "/v1/completions", timeout=120, json={
                "prompt": "drain", "max_tokens": 300, "ignore_eos": True, "stream": True,
                "stream_options": {"include_usage": True}}) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    chunk = json.loads(line[6:])
                    if chunk["choices"]:
                        text.append(chunk["choices"][0]["text"])
                        finish.append(chunk["choices"][0]["finish_reason"])
                    else:
                        finish.append(chunk["usage"]["completion_tokens"])

    t = threading.Thread(target=stream)
    t.start()
    while not text:
        time.sleep(0.01)
    srv.proc.send_signal(signal.SIGTERM)
    time.sleep(0.2)
    refused = httpx.post(srv.url + "/v1/completions", json={"prompt": "late"}, timeout=10)
    assert refused.status_code == 503
    t.join(120)
    assert finish[-2:] == ["length", 300]  # the in-flight request ran to its end
    assert srv.proc.wait(30) == 0
    assert_gone(children)
    assert tmp_path.exists() and not os.listdir(tmp_path)  # the caller's parent survives


def test_killed_worker_takes_the_server_down_nonzero(tiny_llama):
    srv = ServerProcess("--model", tiny_llama, "--tensor-parallel-shutdown-timeout", "3")
    children = group_of(srv.proc)
    worker = next(p for p in children if "pocketllm.workers" in " ".join(p.cmdline()))
    worker.send_signal(signal.SIGKILL)
    t0 = time.monotonic()
    assert srv.proc.wait(30) == 1
    assert time.monotonic() - t0 < 10
    assert_gone(children)


def test_startup_timeout_exits_nonzero(tiny_llama, tmp_path):
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "pocketllm", "serve", "--model", tiny_llama,
                             "--port", str(port), "--tensor-parallel-startup-timeout", "0.5",
                             "--tensor-parallel-rendezvous-dir", str(tmp_path)])
    try:
        assert proc.wait(60) == 1
    finally:
        if proc.poll() is None:
            proc.kill()
    # every process of that group ran inside its run directory under tmp_path: none is left
    left = [p for p in psutil.process_iter(["cmdline"])
            if any(str(tmp_path) in part for part in (p.info["cmdline"] or []))]
    assert not left and not os.listdir(tmp_path)


def test_tensor_parallel_size_the_heads_do_not_divide_refused_clearly(tiny_llama):
    # tiny llama: 4 attention heads, which 3 ranks cannot split; every rank refuses at startup
    out = subprocess.run([sys.executable, "-m", "pocketllm", "serve", "--model", tiny_llama,
                          "--port", str(free_port()), "--tensor-parallel-size", "3"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 1
    assert "num_attention_heads=4 is not divisible by tensor_parallel_size=3" in out.stderr
    out = subprocess.run([sys.executable, "-m", "pocketllm", "serve", "--model", tiny_llama,
                          "--tensor-parallel-size", "0"], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 2 and "tensor_parallel_size must be a positive integer" in out.stderr
