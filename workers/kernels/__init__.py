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
import it only after ``kernels_usable(device)`` said yes. The CPU path's own kernels are
C (``cpu_quant`` for the block products, ``cpu_ops`` for the fused operations between
them, with the Triton ones' signatures).

Triton reads ``TRITON_INTERPRET`` when a kernel is *defined* (module import), so the
CPU tests set it while they import the kernel modules (tests/kernel_modules.py).
"""

from __future__ import annotations

import functools
import importlib.util
import os
from typing import TYPE_CHECKING, Optional

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


def fused_kernel(device: torch.device, module: str, name: str,
                 dtype: Optional[torch.dtype] = None):
    """The fused function ``name`` that the layers on ``device`` should use in place of
    their torch ops, else None: on CUDA the Triton one of ``workers/kernels/<module>.py``
    (see kernels_usable); on the CPU, for a float32 model, the C one of ``cpu_ops`` where
    the CPU kernel library loaded."""
    import torch

    if device.type == "cpu":
        if dtype != torch.float32 or not _cpu_ops_usable():
            return None
        from . import cpu_ops

        return getattr(cpu_ops, name)
    if not kernels_usable(device):
        return None
    return getattr(importlib.import_module(f"{__name__}.{module}"), name)


def _cpu_ops_usable() -> bool:
    try:
        from . import cpu_quant
    except ImportError:
        return False
    return cpu_quant.available()


def kernel_activations(device: torch.device) -> frozenset:
    """The HF activation names the fused gated-activation kernel on ``device`` implements."""
    if device.type == "cpu":
        from .cpu_ops import ACTIVATIONS
    else:
        from .gated_act import KERNEL_ACTIVATIONS as ACTIVATIONS

    return frozenset(ACTIVATIONS)
