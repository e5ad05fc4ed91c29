"""Starting `pocketllm serve` as a real subprocess for tests."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time

import httpx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def free_port_pair() -> int:
    """A port p with p + 1 free too (multi-host tensor parallelism's plan link takes
    master_port + 1): a lone free port's neighbour may be another test's socket."""
    for _ in range(100):
        with socket.socket() as a, socket.socket() as b:
            a.bind(("127.0.0.1", 0))
            port = a.getsockname()[1]
            try:
                b.bind(("127.0.0.1", port + 1))
            except (OSError, OverflowError):  # taken, or past 65535
                continue
            return port
    raise RuntimeError("no two consecutive free ports")


def wait_ready(url: str, proc: subprocess.Popen, timeout: float) -> None:
    """Poll /ready until 200; fail if the process exits first."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}")
        try:
            if httpx.get(url + "/ready", timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.1)
    raise RuntimeError("server did not become ready")


class ServerProcess:
    def __init__(self, *args: str, ready_timeout: float = 180.0, stderr=None):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [sys.executable, "-m", "pocketllm", "serve", "--port", str(self.port), *args]
        self.proc = subprocess.Popen(cmd, env={**os.environ, "PYTHONUNBUFFERED": "1"},
                                     stderr=stderr)  # a file: the server's logs, to read
        self.first_ready_status = None
        deadline = time.monotonic() + ready_timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}")
            try:
                status = httpx.get(self.url + "/ready", timeout=2).status_code
            except httpx.TransportError:
                time.sleep(0.05)
                continue
            if self.first_ready_status is None:
                self.first_ready_status = status
            if status == 200:
                return
            time.sleep(0.1)
        self.stop()
        raise RuntimeError("server did not become ready")

    def openai_client(self):
        """The official client on this server (no retries: a failure must show)."""
        import openai

        return openai.OpenAI(base_url=self.url + "/v1", api_key="unused", max_retries=0)

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode
