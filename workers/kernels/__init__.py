"""Triton kernels for the GPU path, each beside the torch reference it must match.

| kernel module              | torch reference                                   |
|----------------------------|---------------------------------------------------|
| ``kv_write``               | ``index_copy_`` in ``TorchAttention.forward``     |
| ``paged_decode_attention`` | the decode group of ``TorchAttention``            |
| ``prefill_attention``      | the prefill groups of ``TorchAttention``          |
| ``rmsnorm``                | ``layers.norm.RMSNorm`` (+ the residual add)      |
| ``rotary``                 | ``layers.rotary.apply_rotary``                    |
| ``gated_act``              | ``layers.activation.act_and_mul``                 |
| ``gemv``                   | ``F.linear`` of one row (+ the norm / activation  |
|                            | before it, the rotary after q/k/v)                |
| ``bi_matmul``              | ``F.linear``, each row as in any other batch      |
|                            | (the batch-invariant mode)                        |
| ``fused_moe``              | ``layers.moe.torch_experts`` (routed experts:     |
|                            | a grouped GEMM, one launch for all experts)       |

``attention_backend.TritonAttention`` puts the first three behind the
``AttentionBackend`` interface; ``bench`` checks and times them all on a GPU
against the torch references (``python -m pocketllm.workers.kernels.bench``). No Triton
module is imported by the CPU path: a kernel module imports triton at module level, so
import it only after ``kernels_usable(device)`` said yes. The CPU's C library
(``cpu_quant/``, loaded by ``cpu_lib``) serves the torch-free worker (``workers/lite``)
only: on the CPU the torch worker runs the torch references.

Triton reads ``TRITON_INTERPRET`` when a kernel is *defined* (module import), so the
CPU tests set it while they import the kernel modules (tests/kernel_modules.py).
"""

from __future__ import annotations

import functools
import importlib.util
import os
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # torch is imported by what calls these, not for them (workers/lite)
    import torch


@functools.lru_cache(maxsize=None)
def triton_available() -> bool:
    """Triton can be imported (it is an optional dependency: Linux x86_64 only)."""
    if importlib.util.find_spec("triton") is None:
        return False
    try:
        import triton  # noqa: F401
        import triton.language  # noqa: F401
    except Exception:  # a broken install is the same as none
        return False
    return True


def kernels_usable(device: torch.device) -> bool:
    """Whether the runner should take the Triton path on ``device``: CUDA only (CPU
    keeps the torch path; the interpreter is for tests, never for serving).
    ``POCKETLLM_TRITON=0`` turns them off, to compare against the torch path."""
    if os.environ.get("POCKETLLM_TRITON", "1") == "0":
        return False
    return device.type == "cuda" and triton_available()


def fused_kernel(device: torch.device, module: str, name: str):
    """The fused function ``name`` that the layers on ``device`` should use in place of
    their torch ops, else None: on CUDA the Triton one of ``workers/kernels/<module>.py``
    (see kernels_usable)."""
    if not kernels_usable(device):
        return None
    return getattr(importlib.import_module(f"{__name__}.{module}"), name)


def kernel_activations() -> frozenset:
    """The HF activation names the fused gated-activation kernel implements."""
    from .gated_act import KERNEL_ACTIVATIONS

    return frozenset(KERNEL_ACTIVATIONS)
