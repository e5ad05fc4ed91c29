"""Programmatic dependent launch (PDL, Hopper and later): a kernel's programs start while
the kernel before it in the stream drains, and wait for it only where they read what it
wrote.

A batch-1 decode step is ~400 small launches. Without PDL each one starts when the one
before has finished, so every boundary costs the last programs' drain, the launch and the
ramp-up of the new grid, during which memory idles: ~3.5 us over what a 20 MB gemv's
bytes need (docs/benchmarks.md). With PDL the next grid is resident before that: a gemv
issues its first weight loads (weights are never written during a step) and only then
waits (``griddepcontrol.wait``) for the kernel before it to finish and flush.

The contract a kernel launched with ``launch_options`` keeps, via ``wait_for_prior``:
before the wait it reads nothing a kernel of the step writes and writes nothing; right
after it, it lets the next kernel launch (``griddepcontrol.launch_dependents``). So at most
two kernels overlap and a waiting one always follows a running one. Kernels launched
without the option (torch's, and the rest of ours) keep full stream order, and a wait in a
kernel launched without it returns at once.

``POCKETLLM_PDL=0`` turns it off, to compare. Off the GPU (the interpreter) it is off.
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl


@functools.lru_cache(maxsize=None)
def _capable(device_index: int) -> bool:
    return torch.cuda.get_device_capability(device_index)[0] >= 9


def enabled(device: torch.device) -> bool:
    """Whether kernels on ``device`` launch with PDL (the kernels' ``PDL`` constexpr)."""
    if device.type != "cuda" or os.environ.get("POCKETLLM_PDL", "1") == "0":
        return False
    return _capable(device.index if device.index is not None else torch.cuda.current_device())


def launch_options(device: torch.device) -> dict:
    """The launch keywords of a kernel that calls ``wait_for_prior``: its ``PDL`` flag and,
    where on, Triton's ``launch_pdl`` (the interpreter takes no such option)."""
    return {"PDL": True, "launch_pdl": True} if enabled(device) else {"PDL": False}


@triton.jit
def wait_for_prior(PDL: tl.constexpr):
    """Wait until the kernel before this one has finished and its writes are visible, then
    let the kernel after this one start its programs."""
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
