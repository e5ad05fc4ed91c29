"""The KV cache's plan, before any memory: what each layer caches, the cache groups, how
many blocks each pool gets from the budget (kv_cache.py's docstring says how the budget is
split), and the host memory a CPU pool lives in. No torch here: the torch-free worker
(``workers/lite``) sizes and backs its pools with these too.
"""

from __future__ import annotations

import ctypes
import logging
import math
import mmap
import os
import threading
from dataclasses import dataclass
from typing import Callable, Optional, Union

from pocketllm.config import EngineArgs
from pocketllm.errors import InvalidRequestError
from pocketllm.proto.messages import CacheSpec

CPU_KV_CAP_BYTES = 4 << 30  # the CPU KV budget never exceeds 4 GiB
EXTRA_BLOCKS = 4  # slack above the most any set of sequences can hold


def layer_spec(window: Optional[int], max_model_len: int, latent: bool = False,
               state: bool = False) -> CacheSpec:
    """What a layer caches: a window at least as long as any sequence is full attention;
    ``latent``: an MLA layer's compressed latent (always over the whole context);
    ``state``: a linear-attention layer's recurrent state (a slot per sequence)."""
    if state:
        return CacheSpec("state")
    if latent:
        if window is not None:
            raise ValueError("an MLA layer attends to the whole context: no sliding window")
        return CacheSpec("mla")
    if window is None or window >= max_model_len:
        return CacheSpec()
    return CacheSpec("sliding", window)


@dataclass
class CacheLayout:
    specs: list[CacheSpec]  # per group, full attention first
    layer_group: list[int]  # per layer: its group
    # per group: its layers' windows (None: full), shortest first; the torch metadata
    # builds a view for each
    layer_windows: list[list[Optional[int]]]

    def num_layers(self, group: int) -> int:
        return self.layer_group.count(group)

    def is_state(self, group: int) -> bool:
        return self.specs[group].kind == "state"

    def window(self, group: int) -> Optional[int]:
        spec = self.specs[group]
        return spec.window if spec.kind == "sliding" else None


def cache_layout(layer_windows: list[Optional[int]], max_model_len: int,
                 latent: bool = False, state_layers: Optional[list[bool]] = None) -> CacheLayout:
    """The groups of a model whose layer ``i`` attends within ``layer_windows[i]``
    (``latent``: every layer caches an MLA latent; ``state_layers[i]``: layer i keeps a
    recurrent state instead). Full attention's group comes first, a state group last."""
    state_layers = state_layers or [False] * len(layer_windows)
    per_layer = [layer_spec(w, max_model_len, latent, s)
                 for w, s in zip(layer_windows, state_layers)]
    specs = sorted(set(per_layer), key=lambda s: (s.kind == "state", s.kind == "sliding",
                                                  s.window))
    groups = [specs.index(s) for s in per_layer]
    windows = [sorted({w for w, g in zip(layer_windows, groups) if g == group},
                      key=lambda w: -1 if w is None else w) for group in range(len(specs))]
    return CacheLayout(specs, groups, windows)


def sliding_cap(window: int, args: EngineArgs, max_model_len: int) -> int:
    """The blocks a sliding group needs at most: each of ``max_num_seqs`` sequences' window
    (+1: it rarely starts on a block boundary), and two steps' prefill chunks (the one
    computed, and with prefix caching under overlap the one before, freed a step later)."""
    bs = args.block_size
    chunk = args.max_num_batched_tokens if args.enable_chunked_prefill else max_model_len
    return args.max_num_seqs * (math.ceil(window / bs) + 1) + 2 * math.ceil(chunk / bs) + 2


def plan_blocks(layout: CacheLayout, args: EngineArgs, max_model_len: int,
                bytes_per_layer_block: int, gpu_free_bytes: Optional[int] = None,
                state_slot_bytes: int = 0, first_group_extra_bytes: int = 0) -> list[int]:
    """Each group's pool size (the module docstring says how the budget is split); a state
    group's is its slots (``state_slots``; ``state_slot_bytes``: one slot of all its
    layers), taken from the budget first. ``first_group_extra_bytes``: what each block of
    the first group costs besides its layers' (a draft model's pool, read through the same
    tables)."""
    groups = range(len(layout.specs))
    caps = [None if layout.window(g) is None else sliding_cap(layout.window(g), args, max_model_len)
            for g in groups]
    layers = [0 if layout.is_state(g) else layout.num_layers(g) for g in groups]
    has_state = any(layout.is_state(g) for g in groups)
    slots = 0
    if has_state:
        slots = state_slots(args, state_slot_bytes,
                            sum(k * bytes_per_layer_block for k in layers),
                            kv_budget_bytes(args, gpu_free_bytes))

    def counts(n: int) -> list[int]:
        return [slots if layout.is_state(g) else n if cap is None else min(n, cap)
                for g, cap in zip(groups, caps)]

    def cost(n: int) -> int:
        return (slots * state_slot_bytes + counts(n)[0] * first_group_extra_bytes
                + sum(c * k * bytes_per_layer_block for c, k in zip(counts(n), layers)))

    return counts(num_kv_blocks(args, max_model_len, cost, gpu_free_bytes))


def state_slots(args: EngineArgs, slot_bytes: int, block_bytes: int, budget: int) -> int:
    """Recurrent-state slots: one per running sequence (``max_num_seqs``), and with prefix
    caching as many again for snapshots (the scheduler's kv_groups.py); as many as half
    the budget holds when it holds fewer (the rest stays for the KV blocks); at least one,
    with a KV block beside it, or the engine cannot start (and says what one sequence
    needs)."""
    if slot_bytes + block_bytes > budget and args.num_kv_blocks is None:
        raise InvalidRequestError(
            f"the recurrent state of one sequence needs {slot_bytes / (1 << 20):.1f} MiB (and "
            f"a KV block {block_bytes / (1 << 20):.2f} MiB) but the cache budget is "
            f"{budget / (1 << 20):.1f} MiB; raise kv_cache_memory_gb / gpu_memory_utilization",
            "kv_cache_memory_gb")
    wanted = args.max_num_seqs * (2 if args.enable_prefix_caching else 1)
    if args.num_kv_blocks is not None:  # an explicit KV size: every slot wanted
        return wanted
    return max(1, min(wanted, (budget // 2) // slot_bytes))


def num_kv_blocks(args: EngineArgs, max_model_len: int,
                  cost: Union[int, Callable[[int], int]], gpu_free_bytes: Optional[int] = None
                  ) -> int:
    """How many KV blocks to allocate (see EngineArgs for the knobs, in priority order):
    the most whose ``cost`` in bytes fits the budget (``cost``: bytes per block, or a
    function of the block count when a model's cache groups grow unevenly: kv_cache.py).
    ``gpu_free_bytes``: the GPU's free memory, for pools on a GPU (None: host memory).

    An explicit ``num_kv_blocks`` is honoured exactly; a budget in bytes is capped at
    what ``max_num_seqs`` full-length sequences could ever use, since more is waste.
    """
    if args.num_kv_blocks is not None:
        return args.num_kv_blocks
    if isinstance(cost, int):
        per_block = cost
        cost = lambda n: n * per_block  # noqa: E731
    budget = kv_budget_bytes(args, gpu_free_bytes)
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


def kv_budget_bytes(args: EngineArgs, gpu_free_bytes: Optional[int] = None) -> int:
    """The cache's budget: ``kv_cache_memory_gb``, else a share of the GPU's free memory,
    else of the host's available memory (capped)."""
    if args.kv_cache_memory_gb is not None:
        return int(args.kv_cache_memory_gb * (1 << 30))
    if gpu_free_bytes is not None:  # a GPU's pools: a share of its free memory
        return int(args.gpu_memory_utilization * gpu_free_bytes)
    import psutil

    return min(int(args.cpu_kv_cache_fraction * psutil.virtual_memory().available),
               CPU_KV_CAP_BYTES)


def check_available(nbytes: int, what: str, param: str) -> None:
    """Refuse at start a CPU buffer larger than the memory available now (it would be
    backed after start-up, and fail mid-serving)."""
    import psutil

    available = psutil.virtual_memory().available
    if nbytes > available:
        raise InvalidRequestError(f"the {what} needs {nbytes / (1 << 30):.2f} GiB and this "
                                  f"machine has {available / (1 << 30):.2f} GiB available; "
                                  f"lower {param}", param)


def populated_zeros(sizes: list[int]) -> list[Union[mmap.mmap, bytearray]]:
    """Zeroed host buffers of ``sizes`` bytes (anonymous mappings) whose pages one
    background thread backs right away (``MADV_POPULATE_WRITE``: the kernel zeroes them
    without the GIL) on CPU time nothing else wants (``SCHED_IDLE``), so that their memory
    is taken once, soon after start, not request by request as they are first written (the
    worker's memory stays flat: a leak check can tell a leak from the cache), while neither
    the start-up nor a step shares a core with it: backing the embedded model's 2.4 GB KV
    cache takes ~0.6 s of a core on the 2-core VM (more where the VM's memory is touched
    for the first time). At the default priority the thread made ready ~0.25 s later,
    and started after ready it made the first requests' steps slower (docs/benchmarks.md).
    Every mapping is made before the thread starts: a new mapping waits for the
    address-space lock that a backing call holds, hence ``BACKING_CHUNK``. Where the
    kernel lacks the call (before Linux 5.14) the pages are backed as they are first
    written. ``check_available`` has already refused a cache the RAM cannot hold."""
    if not hasattr(mmap, "MAP_ANONYMOUS"):
        return [bytearray(n) for n in sizes]
    buffers, spans = [], []
    for nbytes in sizes:
        if nbytes == 0:
            buffers.append(bytearray(0))
            continue
        buf = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        buffers.append(buf)
        spans.append((ctypes.addressof(ctypes.c_char.from_buffer(buf)), nbytes))
    threading.Thread(target=_back_in_idle_time, args=(spans,), daemon=True,
                     name="kv-cache-backing").start()
    return buffers


_MADV_POPULATE_WRITE = 23  # <linux/mman.h>
# Bytes backed per call (~0.25 ms of a core). A call holds the address-space lock for its
# span, and any mapping the worker makes meanwhile waits for it: one call over the 2.4 GB
# pool kept the first request after ready waiting 2.4-6.8 s on the 2-core VM.
BACKING_CHUNK = 1 << 20


def _back_in_idle_time(spans: list[tuple[int, int]]) -> None:
    if hasattr(os, "SCHED_IDLE"):  # this thread only (Linux): below every other one
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
    _back_pages(spans)


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
