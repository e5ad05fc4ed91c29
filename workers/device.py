"""Where the worker runs: device and dtype choice, CPU threads, and the KV-cache budget."""

from __future__ import annotations

import ctypes
import logging
import math
import mmap
import os
import threading
from typing import Callable, Optional, Union

import torch

from pocketllm.config import EngineArgs, cpu_thread_count
from pocketllm.errors import InvalidRequestError, UnsupportedFeatureError

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
CPU_KV_CAP_BYTES = 4 << 30  # the CPU KV budget never exceeds 4 GiB
EXTRA_BLOCKS = 4  # slack above the most any set of sequences can hold


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
    """Zero CPU tensors (anonymous mappings) whose pages one background thread backs right
    away (``MADV_POPULATE_WRITE``: the kernel zeroes them without the GIL), so that their
    memory is taken once, at start, not request by request as they are first written
    (the worker's memory stays flat: a leak check can tell a leak from the cache), and
    start-up does not wait for it: backing the embedded model's 2.4 GB KV cache takes
    0.8-7 s of a core on the 2-core VM (more where the VM's memory is touched for the
    first time), ~40% of the worker's start (docs/benchmarks.md). Every mapping is made
    before the thread starts: a new mapping waits for the address-space lock that a
    backing call holds, hence ``BACKING_CHUNK``. Where the kernel lacks the call (before
    Linux 5.14) the pages are backed as they are first written.
    ``check_available`` has already refused a cache the RAM cannot hold."""
    size = torch.empty((), dtype=dtype).element_size()
    if not hasattr(mmap, "MAP_ANONYMOUS"):
        return [torch.zeros(shape, dtype=dtype) for shape in shapes]
    tensors, spans = [], []
    for shape in shapes:
        nbytes = math.prod(shape) * size
        if nbytes == 0:
            tensors.append(torch.zeros(shape, dtype=dtype))
            continue
        buf = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        tensors.append(torch.frombuffer(buf, dtype=dtype).view(shape))  # keeps buf alive
        spans.append((tensors[-1].data_ptr(), nbytes))
    threading.Thread(target=_back_pages, args=(spans,), daemon=True, name="kv-cache-backing").start()
    return tensors


_MADV_POPULATE_WRITE = 23  # <linux/mman.h>
# Bytes backed per call. A call holds the address-space lock for its whole span, and any
# mapping the worker makes meanwhile (a first request's allocations) waits for it: one
# call over the 2.4 GB pool kept the first request after ready waiting 2.4-6.8 s on the
# 2-core VM. A chunk holds it for ~10-50 ms.
BACKING_CHUNK = 32 << 20


def _back_pages(spans: list[tuple[int, int]], madvise=None) -> None:
    if madvise is None:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        madvise = libc.madvise
    for addr, nbytes in spans:
        for at in range(0, nbytes, BACKING_CHUNK):  # ctypes drops the GIL in each call
            if madvise(addr + at, min(BACKING_CHUNK, nbytes - at), _MADV_POPULATE_WRITE):
                logging.getLogger("pocketllm.worker").debug(
                    "the KV cache is backed as it is written (madvise: %s)",
                    os.strerror(ctypes.get_errno()))
                return


def check_available(nbytes: int, what: str, param: str) -> None:
    """Refuse at start a CPU buffer larger than the memory available now (it would be
    backed after start-up, and fail mid-serving)."""
    import psutil

    available = psutil.virtual_memory().available
    if nbytes > available:
        raise InvalidRequestError(f"the {what} needs {nbytes / (1 << 30):.2f} GiB and this "
                                  f"machine has {available / (1 << 30):.2f} GiB available; "
                                  f"lower {param}", param)


def kv_bytes_per_block(num_layers: int, block_size: int, num_kv_heads: int, head_dim: int,
                       dtype: torch.dtype) -> int:
    elem = torch.empty((), dtype=dtype).element_size()
    return 2 * num_layers * block_size * num_kv_heads * head_dim * elem  # K and V


def num_kv_blocks(args: EngineArgs, max_model_len: int,
                  cost: Union[int, Callable[[int], int]], device: torch.device) -> int:
    """How many KV blocks to allocate (see EngineArgs for the knobs, in priority order):
    the most whose ``cost`` in bytes fits the budget (``cost``: bytes per block, or a
    function of the block count when a model's cache groups grow unevenly: kv_cache.py).

    An explicit ``num_kv_blocks`` is honoured exactly; a budget in bytes is capped at
    what ``max_num_seqs`` full-length sequences could ever use, since more is waste.
    """
    if args.num_kv_blocks is not None:
        return args.num_kv_blocks
    if isinstance(cost, int):
        per_block = cost
        cost = lambda n: n * per_block  # noqa: E731
    if args.kv_cache_memory_gb is not None:
        budget = int(args.kv_cache_memory_gb * (1 << 30))
    elif device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        budget = int(args.gpu_memory_utilization * free)
    else:
        import psutil

        budget = min(int(args.cpu_kv_cache_fraction * psutil.virtual_memory().available),
                     CPU_KV_CAP_BYTES)
    useful = args.max_num_seqs * math.ceil(max_model_len / args.block_size) + EXTRA_BLOCKS
    if cost(1) > budget:
        raise InvalidRequestError(
            f"the KV cache budget ({budget} bytes) holds no block of {cost(1)} bytes; "
            "raise kv_cache_memory_gb / gpu_memory_utilization or set num_kv_blocks",
            "num_kv_blocks")
    lo, hi = 1, useful  # the largest count whose cost fits (cost grows with the count)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if cost(mid) <= budget else (lo, mid - 1)
    return int(lo)


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
