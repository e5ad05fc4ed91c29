"""The CPU KV cache's pages are backed once the engine is ready, by a background thread
(``workers.kv_plan.populated_zeros``, under ``device.populated_cpu_zeros``; the worker
calls ``kv_plan.start_backing`` after its first message), one bounded chunk a call, so
a first request never waits for the whole pool (docs/benchmarks.md, "Start-up")."""

from __future__ import annotations

import threading

import torch

from pocketllm.workers import device, kv_plan


def _backing_threads(before: set) -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t not in before and t.name == "kv-cache-backing"]


def test_pools_are_zero_writable_and_backed_by_one_thread_once_started(monkeypatch):
    backed, done = [], threading.Event()
    real = kv_plan._back_pages

    def spy(spans, *args):
        backed.append((threading.current_thread().name, [n for _addr, n in spans]))
        real(spans, *args)
        done.set()

    monkeypatch.setattr(kv_plan, "_back_pages", spy)
    monkeypatch.setattr(kv_plan, "_unbacked", [])  # none of another test's pools
    pools = device.populated_cpu_zeros([(3, 5, 7), (0, 4), (2, 2)], torch.float32)
    assert [tuple(p.shape) for p in pools] == [(3, 5, 7), (0, 4), (2, 2)]
    assert all(p.dtype == torch.float32 and not p.any() for p in pools)
    assert backed == []  # nothing backs them before the engine is ready
    kv_plan.start_backing()
    pools[0].fill_(1.5)  # writable while (or after) the thread backs it
    assert float(pools[0].sum()) == 1.5 * 105
    assert done.wait(30)
    assert backed == [("kv-cache-backing", [105 * 4, 4 * 4])]  # the empty pool is no mapping


def test_a_pool_dropped_before_the_start_is_not_backed(monkeypatch):
    spans = []
    monkeypatch.setattr(kv_plan, "_back_pages", spans.extend)
    monkeypatch.setattr(kv_plan, "_unbacked", [])
    kept, dropped = kv_plan.populated_zeros([8192, 4096])
    del dropped
    before = set(threading.enumerate())
    kv_plan.start_backing()
    for t in _backing_threads(before):
        t.join(timeout=30)
    assert [n for _addr, n in spans] == [8192]
    before = set(threading.enumerate())
    kv_plan.start_backing()  # nothing left: no second thread
    assert not _backing_threads(before)
    assert len(kept) == 8192


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
