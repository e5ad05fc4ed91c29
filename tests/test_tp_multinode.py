"""Two "hosts" on one machine: rank 1 runs in its own process group (`serve --node-rank 1`)
and reaches rank 0's scheduler over authenticated TCP on loopback.

The ranks run on the CPU (gloo), said explicitly: on a CUDA machine "auto" would want a
GPU a rank. Their tokens are compared with one rank on the CPU too."""

from __future__ import annotations

import subprocess
import sys

import psutil
import pytest

from pocketllm import LLM, EngineArgs, SamplingParams
from server_process import free_port, free_port_pair

GREEDY = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def llm_cpu(tiny_llama, llm_tiny):
    """One rank on the CPU: ``llm_tiny`` where that runs on the CPU, else an engine of its own."""
    if llm_tiny.capabilities.device == "cpu":
        yield llm_tiny
        return
    with LLM(EngineArgs(model=tiny_llama, device="cpu", seed=0)) as llm:
        yield llm


def test_two_hosts_serve_one_request(tiny_llama, tmp_path, llm_cpu):
    secret = tmp_path / "secret"
    secret.write_text("a-shared-secret-for-this-run-only")
    port = free_port_pair()  # the store's port and the plan link's, the next one
    node1 = subprocess.Popen([
        sys.executable, "-m", "pocketllm", "serve", "--model", tiny_llama, "--device", "cpu",
        "--tensor-parallel-size", "2", "--nnodes", "2", "--node-rank", "1",
        "--tensor-parallel-master-port", str(port),
        "--tensor-parallel-secret-file", str(secret)])
    try:
        with LLM(EngineArgs(model=tiny_llama, device="cpu", tensor_parallel_size=2, nnodes=2,
                            node_rank=0,
                            master_port=port, tensor_parallel_secret_file=str(secret),
                            startup_timeout=120)) as llm:
            assert set(llm._client.supervisor.procs) == {"tokenizer", "detokenizer",
                                                         "scheduler", "worker0"}
            assert llm.capabilities.tensor_parallel_size == 2
            out = llm.generate("two hosts, one answer", GREEDY)[0]
        assert out.token_ids == llm_cpu.generate("two hosts, one answer", GREEDY)[0].token_ids
        children = psutil.Process(node1.pid).children(recursive=True)
        # rank 0's host is gone: rank 1 stops hearing heartbeats and its host exits
        assert node1.wait(60) == 1
        psutil.wait_procs(children, timeout=10)
        assert not [c for c in children if c.is_running() and c.status() != "zombie"]
    finally:
        if node1.poll() is None:
            node1.kill()


def test_ranks_started_by_torchrun(tiny_llama, llm_cpu):
    import os
    import shutil
    import signal

    import httpx

    from server_process import wait_ready

    torchrun = shutil.which("torchrun")
    if torchrun is None:
        pytest.skip("torchrun is not installed")
    http_port = free_port()
    proc = subprocess.Popen(
        # the plan link binds the port after master_port: both must be free
        [torchrun, "--nproc_per_node", "2", "--master_addr", "127.0.0.1", "--master_port",
         str(free_port_pair()), "-m", "pocketllm", "serve", "--model", tiny_llama,
         "--device", "cpu", "--no-tensor-parallel-supervisor", "--port", str(http_port)],
        env={**os.environ, "POCKETLLM_RUN_SECRET": "a-secret-for-this-torchrun-test"},
        start_new_session=True)
    try:
        url = f"http://127.0.0.1:{http_port}"
        wait_ready(url, proc, timeout=120)
        r = httpx.post(url + "/v1/completions", timeout=60, json={
            "prompt": "launched by torchrun", "max_tokens": 16, "temperature": 0,
            "ignore_eos": True})
        expected = llm_cpu.generate("launched by torchrun", GREEDY)[0].text
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == expected
        group = psutil.Process(proc.pid).children(recursive=True)
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(60)
    psutil.wait_procs(group, timeout=15)
    assert not [p for p in group if p.is_running() and p.status() != "zombie"]
