"""Stopping: SIGTERM drains and then ends every request properly; a second signal stops at
once; a signal while loading stops the load; Ctrl-C in an offline script does not hang."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import httpx
import psutil

from process_checks import assert_gone
from server_process import ServerProcess, free_port

LONG = 30000  # tokens: far more than any stream here can produce before the signal


def group_of(proc: subprocess.Popen) -> list[psutil.Process]:
    return psutil.Process(proc.pid).children(recursive=True)


class Stream(threading.Thread):
    """One long streaming completion; records its chunks and how it ended."""

    def __init__(self, url: str, i: int):
        super().__init__(daemon=True)
        self.url, self.i = url, i
        self.chunks: list = []  # parsed data: payloads, and "[DONE]"
        self.error = None

    def run(self) -> None:
        try:
            with httpx.stream("POST", self.url + "/v1/completions", timeout=120, json={
                    "prompt": f"drain {self.i}", "max_tokens": LONG, "ignore_eos": True,
                    "stream": True, "stream_options": {"include_usage": True}}) as r:
                assert r.status_code == 200, r.read()
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        data = line[6:]
                        self.chunks.append(data if data == "[DONE]" else json.loads(data))
        except Exception as e:  # a cut connection shows here
            self.error = e

    def started(self) -> bool:
        return any(isinstance(c, dict) and c["choices"] and c["choices"][0]["text"]
                   for c in self.chunks)

    def finish_reason(self):
        return next((c["choices"][0]["finish_reason"] for c in self.chunks
                     if isinstance(c, dict) and c["choices"]
                     and c["choices"][0]["finish_reason"]), None)


def running(url: str) -> float:
    metrics = httpx.get(url + "/metrics", timeout=10).text
    return float(next(line.split()[-1] for line in metrics.splitlines()
                      if line.startswith("pocketllm_requests_running")))


def start_streams(url: str, n: int = 8) -> list[Stream]:
    streams = [Stream(url, i) for i in range(n)]
    for s in streams:
        s.start()
    deadline = time.monotonic() + 60
    while not all(s.started() for s in streams):
        assert time.monotonic() < deadline, "the streams did not start"
        time.sleep(0.05)
    return streams


def assert_ended_properly(streams: list[Stream], reasons: tuple) -> None:
    for s in streams:
        assert s.error is None, f"stream {s.i}: {s.error!r}"
        assert s.chunks[-1] == "[DONE]", s.chunks[-3:]
        assert s.finish_reason() in reasons, s.chunks[-3:]
        usage = s.chunks[-2]["usage"]  # include_usage: the engine's count, after the cut
        assert 0 < usage["completion_tokens"] < LONG and usage["prompt_tokens"] > 0


def test_sigterm_drains_then_ends_each_stream_with_a_closing_chunk(tiny_llama):
    srv = ServerProcess("--model", tiny_llama, "--max-model-len", "32768",
                        "--shutdown-timeout", "3")
    children = group_of(srv.proc)
    whole: dict = {}

    def whole_request():  # a non-streaming request in flight gets an answer too
        r = httpx.post(srv.url + "/v1/completions", timeout=120, json={
            "prompt": "whole", "max_tokens": LONG, "ignore_eos": True})
        whole["status"], whole["body"] = r.status_code, r.json()

    t = threading.Thread(target=whole_request, daemon=True)
    t.start()
    streams = start_streams(srv.url)
    deadline = time.monotonic() + 30
    while running(srv.url) < 9:  # the whole request too is in the engine's batch
        assert time.monotonic() < deadline
        time.sleep(0.05)
    t0 = time.monotonic()
    srv.proc.send_signal(signal.SIGTERM)
    time.sleep(0.3)
    ready = httpx.get(srv.url + "/ready", timeout=10)
    assert ready.status_code == 503 and ready.json()["status"] == "draining"
    late = httpx.post(srv.url + "/v1/completions", json={"prompt": "late"}, timeout=10)
    assert late.status_code == 503 and late.json()["error"]["code"] == "shutting_down"
    assert srv.proc.wait(30) == 0
    # the drain waited its 3 s, then ended the rest promptly
    assert 2.5 < time.monotonic() - t0 < 15
    for s in streams:
        s.join(10)
    t.join(10)
    assert_ended_properly(streams, ("abort",))
    assert whole["status"] == 200, whole
    choice = whole["body"]["choices"][0]
    assert choice["finish_reason"] == "abort" and choice["text"]
    assert 0 < whole["body"]["usage"]["completion_tokens"] < LONG
    assert_gone(children)


def test_second_signal_stops_at_once(tiny_llama):
    # A drain of 60 s: only the second signal can make this quick.
    srv = ServerProcess("--model", tiny_llama, "--max-model-len", "32768",
                        "--shutdown-timeout", "60")
    children = group_of(srv.proc)
    streams = start_streams(srv.url)
    srv.proc.send_signal(signal.SIGTERM)
    time.sleep(1.0)
    assert srv.proc.poll() is None  # draining
    t0 = time.monotonic()
    srv.proc.send_signal(signal.SIGINT)
    assert srv.proc.wait(30) == 0
    assert time.monotonic() - t0 < 5
    for s in streams:
        s.join(10)
    for s in streams:  # even the quick stop closes each stream, it does not cut it
        assert s.error is None, f"stream {s.i}: {s.error!r}"
        assert s.chunks[-1] == "[DONE]" and s.finish_reason() == "abort", s.chunks[-3:]
    assert_gone(children)


def test_signal_while_loading_stops_the_load(tiny_llama, tmp_path):
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "pocketllm", "serve", "--model", tiny_llama,
                             "--port", str(port), "--tensor-parallel-rendezvous-dir",
                             str(tmp_path)])
    try:
        deadline = time.monotonic() + 60
        while True:  # HTTP is up while the engine loads
            assert time.monotonic() < deadline and proc.poll() is None
            try:
                r = httpx.get(f"http://127.0.0.1:{port}/ready", timeout=2)
            except httpx.TransportError:
                time.sleep(0.05)
                continue
            assert r.status_code == 503 and r.json()["status"] == "loading"
            break
        children = group_of(proc)
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
        assert time.monotonic() - t0 < 10
        assert_gone(children)
        assert not os.listdir(tmp_path)  # the run directory went with it
    finally:
        if proc.poll() is None:
            proc.kill()


def test_ctrl_c_in_an_offline_script_does_not_hang(tiny_llama, tmp_path):
    script = tmp_path / "offline.py"
    # SIGINT as a terminal's foreground job has it: a harness that started pytest in the
    # background may leave it ignored, and an ignored signal stays ignored across exec.
    script.write_text(textwrap.dedent(f"""
        import signal
        signal.signal(signal.SIGINT, signal.default_int_handler)
        from pocketllm import LLM, EngineArgs, SamplingParams
        llm = LLM(EngineArgs(model={tiny_llama!r}, max_model_len=32768))
        for i, event in enumerate(llm.generate_stream(
                "hi", SamplingParams(max_tokens={LONG}, ignore_eos=True))):
            if i == 5:
                print("STREAMING", flush=True)
    """))
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        p for p in (root, os.environ.get("PYTHONPATH")) if p)}
    # Its own session, as a terminal's foreground group: Ctrl-C reaches every process.
    proc = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True,
                            env=env, start_new_session=True)
    try:
        assert proc.stdout.readline().strip() == "STREAMING"
        children = group_of(proc)
        t0 = time.monotonic()
        os.killpg(proc.pid, signal.SIGINT)
        proc.wait(30)
        assert time.monotonic() - t0 < 10
        assert proc.returncode != 0  # KeyboardInterrupt, as Python reports it
        assert_gone(children)
    finally:
        if proc.poll() is None:
            proc.kill()
