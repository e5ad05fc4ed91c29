"""The CPU KV cache's pages are backed by a background thread on idle CPU time
(``workers.kv_plan.populated_zeros``, under ``device.populated_cpu_zeros``), one bounded
chunk a call, so neither the start-up nor a first request waits for the whole pool
(docs/benchmarks.md, "Start-up")."""

from __future__ import annotations

import threading

import torch

from pocketllm.workers import device, kv_plan


def test_pools_are_zero_writable_and_backed_by_one_thread():
    before = set(threading.enumerate())
    pools = device.populated_cpu_zeros([(3, 5, 7), (0, 4), (2, 2)], torch.float32)
    assert [tuple(p.shape) for p in pools] == [(3, 5, 7), (0, 4), (2, 2)]
    assert all(p.dtype == torch.float32 and not p.any() for p in pools)
    pools[0].fill_(1.5)  # writable while (or after) the thread backs it
    assert float(pools[0].sum()) == 1.5 * 105
    backing = [t for t in threading.enumerate() if t not in before and t.name == "kv-cache-backing"]
    for t in backing:  # idle-priority, it still finishes on this (possibly busy) machine
        t.join(timeout=30)
        assert not t.is_alive()


def test_backing_goes_chunk_by_chunk_and_stops_where_the_kernel_refuses():
    chunk, advice = kv_plan.BACKING_CHUNK, kv_plan._MADV_POPULATE_WRITE
    calls = []

    def ok(addr, nbytes, how):
        calls.append((addr, nbytes, how))
        return 0

    kv_plan._back_pages([(1 << 30, 2 * chunk + 4096), (1 << 40, 8192)], ok)
    assert calls == [(1 << 30, chunk, advice), ((1 << 30) + chunk, chunk, advice),
                     ((1 << 30) + 2 * chunk, 4096, advice), (1 << 40, 8192, advice)]

    calls.clear()
    kv_plan._back_pages([(0, 3 * chunk), (1 << 40, 4096)],
                       lambda addr, nbytes, how: calls.append(addr) or -1)
    assert calls == [0]  # an old kernel: the pages are then backed as they are written
