"""The CPU KV cache is backed by the OS as it is written (``workers.device.lazy_cpu_zeros``):
start-up spends nothing on it, and a request pays only for the rows it writes."""

from __future__ import annotations

import psutil
import torch

from pocketllm.workers import device

MIB = 1 << 20


def test_pools_are_zero_writable_and_take_memory_only_where_written():
    rss = psutil.Process().memory_info().rss
    pools = device.lazy_cpu_zeros([(64, 1024, 1024), (0, 4), (2, 2)], torch.float32)
    assert [tuple(p.shape) for p in pools] == [(64, 1024, 1024), (0, 4), (2, 2)]
    assert pools[0].dtype == torch.float32
    grown = psutil.Process().memory_info().rss - rss
    assert grown < 64 * MIB, grown / MIB  # 256 MiB mapped, none of it backed yet
    pools[0][3].fill_(1.5)  # 4 MiB written
    assert float(pools[0][3].sum()) == 1.5 * 1024 * 1024
    assert not pools[0][4:].any() and not pools[2].any()  # reading backs nothing new
    grown = psutil.Process().memory_info().rss - rss
    assert grown < 96 * MIB, grown / MIB
