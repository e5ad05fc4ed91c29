"""The sampling rules' array backend on numpy (``rules.py`` names what each function does),
for the torch-free CPU worker. Everything lives on the host already."""

from __future__ import annotations

import numpy as np
from numpy import exp, where  # noqa: F401  (part of the backend)


def put(a: np.ndarray, like: np.ndarray) -> np.ndarray:
    return a


def float64(x: np.ndarray) -> np.ndarray:
    return x.astype(np.float64)


def rowmax(x: np.ndarray) -> np.ndarray:
    return x.max(axis=-1, keepdims=True)


def argmax(x: np.ndarray) -> np.ndarray:
    return x.argmax(axis=-1)  # each row's first maximum


def gather(x: np.ndarray, index: np.ndarray) -> np.ndarray:
    return np.take_along_axis(x, index, axis=-1)


def cumsum(x: np.ndarray) -> np.ndarray:
    return np.cumsum(x, axis=-1)


def logsumexp(x: np.ndarray) -> np.ndarray:
    m = rowmax(x)
    m = np.where(np.isinf(m), 0.0, m)  # a row of -inf stays -inf, not nan
    return np.log(np.exp(x - m).sum(axis=-1, keepdims=True)) + m


def top(x: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """(values, ids) of each row's ``k`` largest, largest first; equal values in id order."""
    vocab = x.shape[-1]
    if k == 0:
        ids = np.zeros((len(x), 0), dtype=np.int64)
    elif k < vocab:
        ids = np.stack([_best_ids(row, k) for row in x])
    else:
        ids = np.broadcast_to(np.arange(vocab), x.shape)
    ids = gather(ids, np.lexsort((ids, -gather(x, ids)), axis=-1))
    return gather(x, ids), ids


def _best_ids(row: np.ndarray, k: int) -> np.ndarray:
    """The ids of the ``k`` largest values of ``row``; of values equal to the k-th largest,
    the lowest ids (a partition alone would keep any of them)."""
    ids = np.argpartition(-row, k - 1)[:k]
    edge = row[ids].min()
    above = np.flatnonzero(row > edge)
    if len(above) + np.count_nonzero(row == edge) > k:  # ties across the edge
        ids = np.concatenate([above, np.flatnonzero(row == edge)[:k - len(above)]])
    return ids


def argsort(x: np.ndarray) -> np.ndarray:
    return np.argsort(x, axis=-1)


def first_above(cdf: np.ndarray, target: np.ndarray) -> np.ndarray:
    """Per row, the first index whose value exceeds ``target`` [R, 1]."""
    return np.array([np.searchsorted(c, t, side="right") for c, t in zip(cdf, target[:, 0])],
                    dtype=np.int64)


def unpack_bits(words: np.ndarray) -> np.ndarray:
    """Int32 words [R, W] -> bool [R, 32W]: bit j of word w is entry 32w + j."""
    as_bytes = words.astype("<i4", copy=False).view(np.uint8)
    return np.unpackbits(as_bytes, axis=-1, bitorder="little").astype(bool)


def to_host(arrays: list) -> list:
    return arrays


def lists(arrays: list) -> list[list]:
    return [a.tolist() for a in arrays]
