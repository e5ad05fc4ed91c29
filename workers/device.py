"""Where the worker runs: device and dtype choice, CPU threads, and the KV-cache budget."""

from __future__ import annotations

import math
from typing import Optional

import torch

from pocketllm.config import EngineArgs, cpu_thread_count
from pocketllm.errors import UnsupportedFeatureError

from .kv_plan import populated_zeros

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def to_device(data, device: torch.device, dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """Host data (a tensor or a list) on ``device`` without waiting for the GPU. A plain
    host-to-GPU copy synchronizes the stream: in a step's launch it would stall the host
    until the step before (or this step's own forward) had run, and the overlap of
    planning with computing would be lost. (From pageable memory the driver stages the
    data before the call returns, so the source may change right after.)"""
    t = data if isinstance(data, torch.Tensor) else torch.tensor(data, dtype=dtype)
    return t.to(device, non_blocking=True)


def choose_device(args: EngineArgs) -> torch.device:
    if args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available()):
        if not torch.cuda.is_available():
            raise UnsupportedFeatureError("device='cuda' was asked for but CUDA is not available")
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def choose_dtype(args: EngineArgs, device: torch.device) -> torch.dtype:
    if args.dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return _DTYPES[args.dtype]


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def configure_cpu_threads() -> int:
    """Use every core this process may run on, unless the user pinned a count."""
    wanted = cpu_thread_count()
    if torch.get_num_threads() != wanted:
        torch.set_num_threads(wanted)
    return wanted


def populated_cpu_zeros(shapes: list[tuple[int, ...]], dtype: torch.dtype) -> list[torch.Tensor]:
    """Zero CPU tensors over ``kv_plan.populated_zeros``' buffers (backed in the background)."""
    size = torch.empty((), dtype=dtype).element_size()
    buffers = populated_zeros([math.prod(shape) * size for shape in shapes])
    return [torch.frombuffer(buf, dtype=dtype).view(shape) if len(buf)
            else torch.zeros(shape, dtype=dtype) for buf, shape in zip(buffers, shapes)]


def gpu_free_bytes(device: torch.device) -> Optional[int]:
    """The device's free memory, for a KV budget on a GPU (None: host memory)."""
    return torch.cuda.mem_get_info(device)[0] if device.type == "cuda" else None


def kv_bytes_per_block(num_layers: int, block_size: int, num_kv_heads: int, head_dim: int,
                       dtype: torch.dtype, latent_width: Optional[int] = None) -> int:
    """K and V of ``block_size`` positions; FP8: a code a value and a scale byte a head; an
    MLA layer (``latent_width``): one latent row a position instead."""
    if latent_width is not None:
        return num_layers * block_size * latent_width * dtype.itemsize
    if dtype == torch.float8_e4m3fn:
        return 2 * num_layers * block_size * num_kv_heads * (head_dim + 1)
    elem = torch.empty((), dtype=dtype).element_size()
    return 2 * num_layers * block_size * num_kv_heads * head_dim * elem


def copy_bandwidth(device: torch.device, nbytes: int = 1 << 30, repeats: int = 10) -> float:
    """Bytes/s moved (read + write) by a device-to-device copy of ``nbytes``, median of
    ``repeats``: the memory roofline a batch-1 decode, which reads every weight once, is
    held to."""
    import statistics
    import time

    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    rates = []
    for _ in range(repeats + 1):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            dst.copy_(src)
            end.record()
            end.synchronize()
            seconds = start.elapsed_time(end) / 1000
        else:
            t0 = time.perf_counter()
            dst.copy_(src)
            seconds = time.perf_counter() - t0
        rates.append(2 * nbytes / seconds)
    return statistics.median(rates[1:])  # the first copy warms up
