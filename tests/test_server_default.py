"""`pocketllm serve` on the embedded default model: the README's examples, and disconnects."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time

import httpx
import pytest

from machine_speed import seconds_per_token
from server_process import ServerProcess

README = os.path.join(os.path.dirname(__file__), "..", "README.md")


@pytest.fixture(scope="module")
def server(default_model_path):
    srv = ServerProcess()  # no --model: the embedded Gemma 3 270M
    yield srv
    assert srv.stop() == 0


def readme_block(lang: str, needle: str) -> str:
    blocks = re.findall(rf"```{lang}\n(.*?)```", open(README).read(), re.S)
    return next(b for b in blocks if needle in b)


def metric(server, name: str) -> float:
    text = httpx.get(server.url + "/metrics").text
    return float(re.search(rf"^{name}(?:{{[^}}]*}})? ([0-9.e+-]+)$", text, re.M).group(1))


@pytest.mark.slow
def test_readme_curl_example(server):
    if shutil.which("curl") is None:
        pytest.skip("curl is not installed")
    cmd = readme_block("bash", "curl").replace("127.0.0.1:8000", f"127.0.0.1:{server.port}")
    out = subprocess.run(["bash", "-c", cmd], capture_output=True, text=True, check=True)
    reply = json.loads(out.stdout)  # the default is a base model: the README asks for text
    assert reply["object"] == "text_completion" and reply["choices"][0]["text"].strip()
    assert reply["model"] == "gemma-3-270m-q4_k_m"


@pytest.mark.slow
def test_readme_openai_example(server):
    code = readme_block("python", "OpenAI(").replace("127.0.0.1:8000",
                                                      f"127.0.0.1:{server.port}")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, timeout=120)
    assert out.stdout.strip()


@pytest.mark.slow
def test_disconnect_frees_blocks_within_a_second(server):
    # A second on a quiet machine; on a loaded one, ten decode steps at the machine's fastest
    # (the abort lands between steps). Finishing the generation instead would take 20 bounds.
    step = seconds_per_token(server.url)
    bound = max(1.0, 10 * step)
    max_tokens = min(4000, int(20 * bound / step))
    assert (max_tokens - 1) * step > 4 * bound, "the machine is too fast for max_tokens"
    with httpx.stream("POST", server.url + "/v1/completions", timeout=60, json={
            "prompt": "Write a long essay about the ocean.", "max_tokens": max_tokens,
            "ignore_eos": True, "stream": True}) as r:
        lines = r.iter_lines()  # keep the iterator alive: closing it would hang up early
        for line in lines:
            if line.startswith("data: {"):
                break
        deadline = time.monotonic() + 2 * bound
        while metric(server, "pocketllm_kv_blocks_used") == 0 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert metric(server, "pocketllm_kv_blocks_used") > 0
        assert metric(server, "pocketllm_requests_running") == 1
    left = time.monotonic()
    while time.monotonic() - left < bound and metric(server, "pocketllm_kv_blocks_used") > 0:
        time.sleep(0.02)
    assert metric(server, "pocketllm_kv_blocks_used") == 0
    assert metric(server, "pocketllm_requests_running") == 0
    assert metric(server, "pocketllm_requests_waiting") == 0
    text = httpx.get(server.url + "/metrics").text
    assert re.search(r'^pocketllm_requests_total{finish_reason="abort",model_name="[^"]+"} 1.0$',
                     text, re.M)
