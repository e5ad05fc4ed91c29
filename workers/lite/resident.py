"""The dense block weights moved off the file's mapping onto anonymous memory with huge
pages, in the background, after the model is bound.

A decode step reads every dense weight once and is bound by how fast memory streams in.
Read through the GGUF file's mapping (4 KiB pages of the page cache), the products
streamed 14-16 GB/s on the 2-core Sapphire Rapids VM; from a copy on 2 MiB pages, 21-22
GB/s (a VM walks two page tables on each TLB miss). Decode gained 20% on the embedded
default and 10% on the Qwen3-30B-A3B shape (docs/benchmarks.md, session 22).

Faulting in fresh huge pages costs up to ~2.4 ms each here (the kernel compacts memory to
find them), ~0.6 s for the embedded default's 250 MB: before ready that would break the
start-up budget. So the copying starts with the first step, on one thread at nice 10, and
the worker adopts each copy between steps (``adopt``): a step never sees a part change
under it. The first steps share the cores with the copy (0.77 GB took 7.7 s of steps
back to back on the Qwen3-30B-A3B shape, 1.3 s on an idle machine). Routed experts stay
mapped: a step reads 8 of 128, and copying them would take the page cache's size again.
The copy is skipped, and the weights read from the mapping, when the memory available could
not hold it with room to spare."""
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
# The copying thread's niceness: against the steps' threads it gets ~10% of a core (a
# slice of it stalls a step's other threads at their next barrier); SCHED_IDLE, as the KV
# backing has, got nothing while steps ran back to back, and a copy never finished.
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
        # (bound, part index) of each part read through a file's mapping
        self._parts = [(b, j) for b in bounds for j, a in enumerate(b.arrays) if _mapped(a)]
        self._ready: "queue.SimpleQueue[tuple]" = queue.SimpleQueue()
        self.nbytes = sum(b.arrays[j].nbytes for b, j in self._parts)
        self.adopted = 0
        self._thread = None

    def start(self, reserved: int = 0) -> bool:
        """Copy from the first step on (``adopt``), unless the memory available now, less
        ``reserved`` bytes that are promised but perhaps not yet taken (the KV cache being
        backed), could not hold the copies with ``HEADROOM_BYTES`` to spare. Whether it
        will copy."""
        import psutil

        if not self.nbytes or self._thread is not None:
            return False
        available = psutil.virtual_memory().available - reserved
        if available < self.nbytes + HEADROOM_BYTES:
            logger.info("dense weights stay in the file's mapping: copying their %.2f GiB "
                        "would leave less than %.1f GiB of the %.2f GiB available",
                        self.nbytes / (1 << 30), HEADROOM_BYTES / (1 << 30),
                        available / (1 << 30))
            return False
        self._thread = threading.Thread(target=self._copy_all, daemon=True,
                                        name="resident-weights")
        return True

    def _copy_all(self) -> None:
        try:  # this thread only (Linux; elsewhere it keeps the default priority)
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), NICE)
        except (AttributeError, OSError):
            pass
        started = time.perf_counter()
        try:
            for bound, j in self._parts:
                src = bound.arrays[j].reshape(-1)
                dst = np.empty_like(src)  # numpy asks for huge pages on large allocations
                for at in range(0, len(src), CHUNK_BYTES):
                    dst[at:at + CHUNK_BYTES] = src[at:at + CHUNK_BYTES]
                self._ready.put((bound, j, dst.reshape(bound.arrays[j].shape)))
            logger.info("dense weights copied off the file's mapping: %.2f GiB in %.1f s",
                        self.nbytes / (1 << 30), time.perf_counter() - started)
        except MemoryError:
            logger.info("dense weights: the copy stopped (out of memory); the rest stay "
                        "in the file's mapping")

    def _launch(self) -> None:
        if self._thread is not None and self._thread.ident is None:
            self._thread.start()

    def join(self) -> None:
        """Wait until every copy is made (tests, and a caller that wants them all)."""
        if self._thread is not None:
            self._launch()
            self._thread.join()

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
