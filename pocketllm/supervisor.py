"""The process group's lifecycle: private run directory, spawning without a shell,
readiness, liveness, and reaping everything on death, timeout or shutdown."""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import signal
import site
import socket
import subprocess
import sys
import sysconfig
import tempfile
import threading
import time
from typing import Callable, Optional

import zmq

from . import _source_layout
from .config import EngineArgs
from .draft_info import with_draft
from .errors import CheckpointError, EngineStartupError, UnsupportedFeatureError
from .model_info import ModelInfo
from .process import write_settings
from .remote import read_secret
from .proto import PROTOCOL_VERSION, codec, endpoints
from .proto.messages import StageFailed, StageReady

log = logging.getLogger("pocketllm.supervisor")


def _free_port(addr: str) -> int:
    with socket.socket() as s:
        s.bind((addr, 0))
        return s.getsockname()[1]


def stage_command(module: str, *argv: str) -> tuple[list[str], dict]:
    """``python -m module argv...`` importing the same ``pocketllm`` as this process.

    ``-m`` puts the current directory first on the child's ``sys.path``, so in a clone
    root the checkout would shadow an installed wheel: ``-P`` (Python 3.11+) leaves it
    off. The folder this process imported the package from goes on ``PYTHONPATH``
    unless it is a site directory the child searches anyway (a checkout, a test tree)."""
    root = _source_layout.package_root()
    env = {}
    sites = {os.path.realpath(p) for p in (*site.getsitepackages(), site.getusersitepackages(),
                                           sysconfig.get_path("purelib"),
                                           sysconfig.get_path("platlib"))}
    if os.path.realpath(root) not in sites:
        env["PYTHONPATH"] = os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p)
    safe_path = ["-P"] if sys.version_info >= (3, 11) else []
    return [sys.executable, *safe_path, "-m", module, *argv], env


class Supervisor:
    def __init__(self, args: EngineArgs, info: ModelInfo,
                 on_death: Callable[[str], None] = lambda reason: None):
        self.args = args
        self.info = with_draft(args, info)
        self.on_death = on_death
        if args.nnodes > 1:
            read_secret(args.tensor_parallel_secret_file)  # fail now, not inside a stage
        if args.rendezvous_dir is not None and not os.path.isdir(args.rendezvous_dir):
            raise EngineStartupError(f"rendezvous directory {args.rendezvous_dir!r} does not exist")
        # A fresh private directory (mode 0700), inside the caller's parent if one was given.
        self.run_dir = tempfile.mkdtemp(prefix="pocketllm-", dir=args.rendezvous_dir)
        self.procs: dict[str, subprocess.Popen] = {}
        self.ready: dict[str, StageReady] = {}
        self._stopping = threading.Event()
        self._hurry = threading.Event()  # a second Ctrl-C: SIGKILL without waiting
        self._shutdown_lock = threading.Lock()
        self._started = time.monotonic()  # for the start-up's debug log lines
        self._zmq = zmq.Context()
        self._inbox = self._zmq.socket(zmq.PULL)
        self._inbox.bind(endpoints.supervisor(self.run_dir))
        write_settings(self.run_dir, args, self.info)

    # ---------------------------------------------------------------- start

    def _spawn(self, name: str, module: str, *extra: str, env: Optional[dict] = None) -> None:
        cmd, stage_env = stage_command(module, self.run_dir, *extra)
        self.procs[name] = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, close_fds=True,
                                            env={**os.environ, **stage_env, **(env or {})})
        log.debug("%s spawned after %.2f s", name, time.monotonic() - self._started)

    def start(self, cancel: Optional[threading.Event] = None) -> None:
        """Start every stage and wait for each to report ready; on failure reap all and raise.
        ``cancel``: set from another thread (a signal while loading) to stop waiting."""
        world = self.args.tensor_parallel_size
        # torch.distributed rendezvous of the ranks (only used when world > 1).
        dist_env = {"MASTER_ADDR": self.args.master_addr,
                    "MASTER_PORT": str(self.args.master_port or _free_port(self.args.master_addr))}
        local = world // self.args.nnodes
        first = self.args.node_rank * local  # this host's ranks: first .. first + local - 1
        try:
            if self.args.node_rank == 0:  # the control plane lives with rank 0
                self._spawn("tokenizer", "pocketllm.tokenizer")
            for rank in range(first, first + local):
                # A launcher (torchrun) that started this process already chose its device.
                local_rank = int(os.environ.get("LOCAL_RANK", 0)) + rank - first
                rank_env = {"RANK": str(rank), "LOCAL_RANK": str(local_rank),
                            "WORLD_SIZE": str(world), "TP_RANK": str(rank),
                            "TP_WORLD": str(world), **dist_env}
                self._spawn(f"worker{rank}", "pocketllm.workers", str(rank), env=rank_env)
            # The scheduler's and the detokenizer's starts are short (0.1-0.3 s of CPU), the
            # tokenizer's (its vocabulary) and the workers' (weights) the long ones, and a
            # start is CPU-bound: on fewer cores than starting stages, the short ones only
            # stretch the longest (on two cores, all four at once took the tokenizer's from
            # ~0.9 to ~1.1 s). So each of them waits for a core that a finished start frees.
            short = [("scheduler", "pocketllm.scheduler"),
                     ("detokenizer", "pocketllm.detokenizer")] if self.args.node_rank == 0 else []
            self._await_ready(self.args.startup_timeout, cancel, short)
        except BaseException:
            self.shutdown()
            raise
        threading.Thread(target=self._monitor, daemon=True, name="pocketllm-monitor").start()

    def _await_ready(self, timeout: float, cancel: Optional[threading.Event] = None,
                     waiting: list[tuple[str, str]] = ()) -> None:
        """Wait for every stage's ready; spawn each of ``waiting`` (name, module) once fewer
        stages are starting than this process may use cores."""
        deadline = time.monotonic() + timeout
        decoder = codec.decoder_for("supervisor")
        waiting = list(waiting)
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
        while waiting or len(self.ready) < len(self.procs):
            while waiting and len(self.procs) - len(self.ready) < (cores or 1):
                self._spawn(*waiting.pop(0))
            if cancel is not None and cancel.is_set():
                raise EngineStartupError("startup was interrupted (the server is stopping)")
            for name, proc in self.procs.items():
                if proc.poll() is not None and name not in self.ready:
                    while self._inbox.poll(300):  # it may have said why just before exiting
                        self._on_message(decoder.decode(self._inbox.recv()))
                    raise EngineStartupError(
                        f"the {name} process exited with status {proc.returncode} during startup")
            if time.monotonic() > deadline:
                missing = sorted(set(self.procs) - set(self.ready)) + [n for n, _m in waiting]
                raise EngineStartupError(
                    f"the engine did not become ready within {timeout:.0f} s "
                    f"(still waiting for: {', '.join(missing)})")
            if self._inbox.poll(100):
                self._on_message(decoder.decode(self._inbox.recv()))

    def _on_message(self, msg) -> None:
        if isinstance(msg, StageFailed):
            if msg.kind == "checkpoint":
                raise CheckpointError(msg.message)
            if msg.kind == "unsupported":
                raise UnsupportedFeatureError(msg.message)
            raise EngineStartupError(f"the {msg.stage} process failed to start:\n{msg.message}")
        if msg.protocol_version != PROTOCOL_VERSION:
            raise EngineStartupError(
                f"the {msg.stage} process speaks protocol {msg.protocol_version}, "
                f"this frontend {PROTOCOL_VERSION}: mixed installations?")
        self.ready[msg.stage] = msg
        log.debug("%s ready after %.2f s", msg.stage, time.monotonic() - self._started)

    @property
    def capabilities(self):
        return self.ready["scheduler"].capabilities

    # ---------------------------------------------------------------- run

    def _monitor(self) -> None:
        while not self._stopping.is_set():
            for name, proc in list(self.procs.items()):
                if proc.poll() is not None and not self._stopping.is_set():
                    reason = f"the {name} process (pid {proc.pid}) exited with status {proc.returncode}"
                    log.error("%s; stopping the engine", reason)
                    self.on_death(reason)
                    self.shutdown()
                    return
            self._stopping.wait(0.05)

    def alive(self) -> bool:
        return not self._stopping.is_set() and all(p.poll() is None for p in self.procs.values())

    # ---------------------------------------------------------------- stop

    def hurry(self) -> None:
        """Make a shutdown in progress (or the next one) SIGKILL at once; any thread."""
        self._hurry.set()

    def shutdown(self) -> None:
        """Stop and reap every process (SIGTERM, SIGKILL after shutdown_timeout); idempotent."""
        with self._shutdown_lock:
            self._stopping.set()
            for proc in self.procs.values():
                if proc.poll() is None:
                    with contextlib.suppress(ProcessLookupError):
                        proc.send_signal(signal.SIGTERM)
            deadline = time.monotonic() + self.args.shutdown_timeout
            for proc in self.procs.values():
                while proc.poll() is None and not self._hurry.is_set():
                    left = deadline - time.monotonic()
                    if left <= 0:
                        break
                    with contextlib.suppress(subprocess.TimeoutExpired):
                        proc.wait(min(left, 0.05))
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()
            if not self._inbox.closed:
                self._inbox.close(linger=0)
                self._zmq.term()
            shutil.rmtree(self.run_dir, ignore_errors=True)


def run_worker_node(args: EngineArgs) -> int:
    """`pocketllm serve --node-rank K` (K > 0): this host's ranks only, no HTTP.

    Runs until SIGINT/SIGTERM (exit 0) or until a rank exits (exit 1) — which is also how
    it ends when rank 0's host goes away: its ranks stop hearing heartbeats and exit.
    """
    from .model_info import load_model_info

    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    died: list[str] = []
    sup = Supervisor(args, load_model_info(args), on_death=lambda reason: (died.append(reason),
                                                                          stop.set()))
    sup.start()
    log.info("node %d: ranks ready", args.node_rank)
    stop.wait()
    sup.shutdown()
    if died:
        log.error("stopping: %s", died[0])
    return 1 if died else 0
