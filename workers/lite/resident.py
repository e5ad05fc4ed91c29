"""The dense block weights moved off the file's mapping onto anonymous memory with huge
pages, in the background, after the model is bound.

A decode step reads every dense weight once and is bound by how fast memory streams in.
Read through the GGUF file's mapping (4 KiB pages of the page cache), the products
streamed 14-16 GB/s on the 2-core Sapphire Rapids VM; from a copy on 2 MiB pages, 21-22
GB/s (a VM walks two page tables on each TLB miss). Decode gained 20% on the embedded
default and 10% on the Qwen3-30B-A3B shape (docs/benchmarks.md, session 22).

Faulting in fresh huge pages costs up to ~2.4 ms each here (the kernel compacts memory to
find them), ~0.6 s for the embedded default's 250 MB: before ready that would break the
start-up budget. So the copying starts with the first step, and the worker adopts each
copy between steps (``adopt``): a step never sees a part change under it. The copy runs
first at ``SCHED_IDLE`` (CPU time no step wants: the gaps between requests), and only
what is left after ``IDLE_FIRST_S`` goes on at nice 10, beside the steps: at nice 10 from
the start, the first request after ready (24 prompt tokens, the embedded default, 2
cores) took 200-240 ms against 50-62 ms with no copy, since each slice the copy gets
stalls a step's other threads at their next barrier. (0.77 GB took 7.7 s of steps back
to back at nice 10 on the Qwen3-30B-A3B shape, 1.3 s on an idle machine.) Routed experts stay
mapped: a step reads 8 of 128, and copying them would take the page cache's size again.
The copy is skipped, and the weights read from the mapping, when the memory available could
not hold it with room to spare."""
import collections
import ctypes
import logging
import mmap
import os
import queue
import threading
import time
from typing import Sequence

import numpy as np

logger = logging.getLogger("pocketllm.worker")

# The copy must leave this much memory available besides (page cache, KV cache backing).
HEADROOM_BYTES = 1 << 30
# How long the copy keeps to idle CPU time from the first step: at SCHED_IDLE it gets
# nothing while steps run back to back (OpenMP's waiting threads leave no idle CPU).
IDLE_FIRST_S = 2.0
# The niceness of what is left after that: against the steps' threads it gets ~10% of a
# core. (A thread cannot leave SCHED_IDLE without privileges: the rest gets a new thread.)
NICE = 10
# Bytes copied per numpy assignment. With whole tensors the first request after ready (a
# 64-token prompt on the embedded model) took 96-248 ms, in 2 MiB slices 85-95 ms, with no
# copy 79-88 ms. Why is not settled: the copy does not hold the GIL (measured).
CHUNK_BYTES = 2 << 20


class ResidentCopies:
    """Copies each part of ``bounds`` (``model._Bound``) in the background; ``adopt`` points
    the parts at the copies made so far. Each copy equals its source byte for byte, so
    adopting changes no result."""

    def __init__(self, bounds: Sequence):
        # (bound, part index, its copy so far, bytes copied) of each part read through a
        # file's mapping, in copying order
        self._todo = collections.deque([b, j, None, 0] for b in bounds
                                       for j, a in enumerate(b.arrays) if _mapped(a))
        self._ready: "queue.SimpleQueue[tuple]" = queue.SimpleQueue()
        self.nbytes = sum(b.arrays[j].nbytes for b, j, _, _ in self._todo)
        self.adopted = 0
        self._copying = False
        self._threads: list[threading.Thread] = []
        self._started = 0.0

    def start(self, reserved: int = 0) -> bool:
        """Copy from the first step on (``adopt``), unless the memory available now, less
        ``reserved`` bytes that are promised but perhaps not yet taken (the KV cache being
        backed), could not hold the copies with ``HEADROOM_BYTES`` to spare. Whether it
        will copy."""
        import psutil

        if not self.nbytes or self._copying:
            return False
        available = psutil.virtual_memory().available - reserved
        if available < self.nbytes + HEADROOM_BYTES:
            logger.info("dense weights stay in the file's mapping: copying their %.2f GiB "
                        "would leave less than %.1f GiB of the %.2f GiB available",
                        self.nbytes / (1 << 30), HEADROOM_BYTES / (1 << 30),
                        available / (1 << 30))
            return False
        self._copying = True
        return True

    def _copy(self, idle: bool) -> None:
        """Copy the parts left, in order; ``idle``: at SCHED_IDLE, until IDLE_FIRST_S."""
        try:  # this thread only (Linux; elsewhere it keeps the default priority)
            if idle:
                os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
            else:
                os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), NICE)
        except (AttributeError, OSError):
            pass
        until = time.perf_counter() + IDLE_FIRST_S if idle else float("inf")
        try:
            while self._todo:
                part = self._todo[0]
                bound, j = part[0], part[1]
                src = bound.arrays[j].reshape(-1)
                if part[2] is None:
                    part[2] = np.empty_like(src)  # numpy asks for huge pages on large ones
                while part[3] < len(src):
                    if time.perf_counter() > until:
                        return  # the rest at NICE, on a new thread (``_launch``)
                    at = part[3]
                    part[2][at:at + CHUNK_BYTES] = src[at:at + CHUNK_BYTES]
                    part[3] = at + CHUNK_BYTES
                self._todo.popleft()
                self._ready.put((bound, j, part[2].reshape(bound.arrays[j].shape)))
            logger.info("dense weights copied off the file's mapping: %.2f GiB in %.1f s",
                        self.nbytes / (1 << 30), time.perf_counter() - self._started)
        except MemoryError:
            self._todo.clear()
            logger.info("dense weights: the copy stopped (out of memory); the rest stay "
                        "in the file's mapping")

    def _launch(self, idle_first: bool = True) -> None:
        """Start a copying thread unless one runs or nothing is left: the first at
        SCHED_IDLE (``idle_first``), any later one (the first stopped at its time) at NICE."""
        if not self._copying or not self._todo or any(t.is_alive() for t in self._threads):
            return
        if not self._threads:
            self._started = time.perf_counter()
        idle = idle_first and not self._threads
        thread = threading.Thread(target=self._copy, args=(idle,), daemon=True,
                                  name="resident-weights")
        self._threads.append(thread)
        thread.start()

    def join(self) -> None:
        """Wait until every copy is made (tests, and a caller that wants them all)."""
        while self._copying and self._todo:
            self._launch(idle_first=False)
            self._threads[-1].join()

    def adopt(self) -> None:
        """Point the parts at the copies made so far. Call between steps, from the thread
        that runs them. The first call starts the copying: nothing of it runs before the
        worker is ready."""
        self._launch()
        while True:
            try:
                bound, j, dst = self._ready.get_nowait()
            except queue.Empty:
                return
            src, bound.arrays[j] = bound.arrays[j], dst
            bound.parts[j].w = dst.ctypes.data
            _unmap_pages(src)
            self.adopted += 1


def _mapped(a: np.ndarray) -> bool:
    """Whether ``a`` is a view of a file's mapping (``np.memmap``)."""
    while a is not None:
        if isinstance(a, (np.memmap, mmap.mmap)):
            return True
        a = getattr(a, "base", None)
    return False


_MADV_DONTNEED = 4


def _unmap_pages(src: np.ndarray) -> None:
    """Take the source's whole pages out of this process (``MADV_DONTNEED``): the file's
    page cache keeps them, reclaimable, and the worker's resident memory does not count the
    weights twice. A page shared with a neighbouring tensor stays mapped; nothing writes
    the mapping, so a page read again is the file's."""
    page = mmap.PAGESIZE
    start = -(-src.ctypes.data // page) * page
    end = (src.ctypes.data + src.nbytes) // page * page
    if end > start and _madvise is not None:
        _madvise(start, end - start, _MADV_DONTNEED)


try:
    _madvise = ctypes.CDLL(None, use_errno=True).madvise
    _madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
except (AttributeError, OSError, TypeError):  # no libc madvise (Windows)
    _madvise = None
