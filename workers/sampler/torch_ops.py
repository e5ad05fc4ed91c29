"""The sampling rules' array backend on torch (``rules.py`` names what each function does),
for the torch worker on the CPU or a GPU. Host arrays travel with ``to_device``, which
never waits for the GPU."""

from __future__ import annotations

import numpy as np
import torch
from torch import exp, where  # noqa: F401  (part of the backend)

from ..device import to_device


def put(a: np.ndarray, like: torch.Tensor) -> torch.Tensor:
    return to_device(torch.from_numpy(a if a.flags.writeable else a.copy()), like.device)


def float64(x: torch.Tensor) -> torch.Tensor:
    return x.double()


def rowmax(x: torch.Tensor) -> torch.Tensor:
    return x.amax(-1, keepdim=True)


def argmax(x: torch.Tensor) -> torch.Tensor:
    """Each row's first maximum. On the CPU numpy's (0.02 ms a row of 262k, against 0.22
    for torch's argmax: a batch-1 decode step pays it every token); CUDA keeps argmax,
    whose kernels its graphs captured."""
    if x.is_cpu and x.dtype == torch.float32:
        return torch.from_numpy(x.numpy().argmax(axis=-1))
    return x.argmax(dim=-1)


def gather(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    return x.gather(-1, index)


def cumsum(x: torch.Tensor) -> torch.Tensor:
    return x.cumsum(-1)


def logsumexp(x: torch.Tensor) -> torch.Tensor:
    return x.logsumexp(-1, keepdim=True)


# Extra best values ``top`` takes before it orders equal values by id: its answer is
# exact unless more than this many tokens share the value at its last rank.
TIE_MARGIN = 64


def top(x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(values, ids) of each row's ``k`` largest, largest first; equal values in id order.
    A float32 top-k (fast) picks ``k + TIE_MARGIN`` candidates, in no defined order among
    equal values; sorting them by (value, id) orders those, and every token equal to the
    k-th value is among them unless more than TIE_MARGIN share it. Near the whole row, a
    stable sort keeps equal values in id order by itself."""
    if k + TIE_MARGIN >= x.shape[-1]:
        values, ids = x.sort(dim=-1, descending=True, stable=True)
        return values[:, :k], ids[:, :k]
    values, ids = x.topk(k + TIE_MARGIN, dim=-1)
    ids = ids.gather(-1, _order_keys(values, ids).argsort(dim=-1, descending=True)[:, :k])
    return x.gather(-1, ids), ids


def _order_keys(values: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """int64 keys that sort as (float32 value, then the lower id first): the value's bits
    made order-preserving in the high half, ``2**31 - 1 - id`` in the low half."""
    bits = values.float().view(torch.int32).long()
    bits = bits ^ ((bits >> 31) & 0x7FFFFFFF)
    return (bits << 32) | (0x7FFFFFFF - ids)


def argsort(x: torch.Tensor) -> torch.Tensor:
    return x.argsort(dim=-1)


def first_above(cdf: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Per row, the first index whose value exceeds ``target`` [R, 1]."""
    return torch.searchsorted(cdf, target, right=True)[:, 0]


def unpack_bits(words: torch.Tensor) -> torch.Tensor:
    """Int32 words [R, W] -> bool [R, 32W]: bit j of word w is entry 32w + j."""
    shifts = torch.arange(32, dtype=torch.int32, device=words.device)
    return ((words.unsqueeze(-1) >> shifts) & 1).bool().view(len(words), -1)


def to_host(tensors: list[torch.Tensor]) -> "HostCopy":
    return HostCopy(tensors)


def lists(copy: "HostCopy") -> list[list]:
    return copy.lists()


class HostCopy:
    """A step's tokens (and logprob tables) on their way to the host. On CUDA the copies
    are queued behind the sampling, so waiting for them does not wait for whatever the
    stream runs next (the following step's forward, when steps overlap)."""

    def __init__(self, tensors: list[torch.Tensor]):
        self.event = None
        if tensors and tensors[0].is_cuda:
            tensors = [torch.empty(t.shape, dtype=t.dtype, pin_memory=True).copy_(
                t, non_blocking=True) for t in tensors]
            self.event = torch.cuda.Event()
            self.event.record()
        self.tensors = tensors

    def lists(self) -> list[list]:
        if self.event is not None:
            self.event.synchronize()
        return [t.tolist() for t in self.tensors]
