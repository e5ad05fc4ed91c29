"""Endpoint names. Local processes talk over ``ipc://`` inside a private run directory."""

from __future__ import annotations

import os


def ipc(run_dir: str, name: str) -> str:
    return "ipc://" + os.path.join(run_dir, name + ".sock")


def frontend(run_dir: str) -> str:  # PULL bound by the frontend: outputs and errors
    return ipc(run_dir, "frontend")


def tokenizer(run_dir: str) -> str:  # PULL bound by the tokenizer
    return ipc(run_dir, "tokenizer")


def scheduler(run_dir: str) -> str:  # PULL bound by the scheduler: requests, aborts, results
    return ipc(run_dir, "scheduler")


def worker(run_dir: str, rank: int) -> str:  # PULL bound by each rank: step plans
    return ipc(run_dir, f"worker{rank}")


def detokenizer(run_dir: str) -> str:  # PULL bound by the detokenizer
    return ipc(run_dir, "detokenizer")


def supervisor(run_dir: str) -> str:  # PULL bound by the supervisor: readiness
    return ipc(run_dir, "supervisor")
