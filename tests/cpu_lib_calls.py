"""The C library's calls on numpy arrays, for the kernel tests: each a thin wrapper over
``cpu_lib.lib()`` (the torch-free worker's binding) that allocates its output and raises
on a return code, so a test reads as the math it checks."""

from __future__ import annotations

import contextlib
import ctypes
from typing import Iterator, Optional

import numpy as np

from pocketllm.workers.kernels import cpu_lib
from pocketllm.workers.kernels.cpu_lib import Part
from pocketllm.workers.loader.gguf_quants import GGML_TYPES


def lib():
    return cpu_lib.lib()


def _f32(x: np.ndarray) -> np.ndarray:
    assert x.dtype == np.float32 and x.flags.c_contiguous
    return x


def quantize(x: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(q int16 [M, K], d float32 [M, K/32], gsum int32 [M, K/16]) of float32 [M, K]."""
    m, k = _f32(x).shape
    q = np.empty((m, k), np.int16)
    d = np.empty((m, k // 32), np.float32)
    gsum = np.empty((m, k // 16), np.int32)
    cpu_lib.raise_for(lib().pq_quantize_act(x.ctypes.data, m, k, k, q.ctypes.data, d.ctypes.data,
                                            gsum.ctypes.data, 0), None, "quantize_act")
    return q, d, gsum


def dequantized_act(q: np.ndarray, d: np.ndarray) -> np.ndarray:
    """float64 [M, K] of the values the kernels multiply: q * d per block of 32."""
    return q.astype(np.float64) * np.repeat(d.astype(np.float64), 32, axis=1)


def mul_mat(ggml_type: int, w: np.ndarray, k: int, act, threads: int = 0) -> np.ndarray:
    """[M, N] = act's rows @ W^T, W the N rows of uint8 ``w`` (row stride from the array)."""
    q, d, gsum = act
    out = np.empty((q.shape[0], w.shape[0]), np.float32)
    cpu_lib.raise_for(lib().pq_mul_mat(ggml_type, w.ctypes.data, w.shape[0], k, w.strides[0],
                                       q.ctypes.data, d.ctypes.data, gsum.ctypes.data, q.shape[0],
                                       out.ctypes.data, out.shape[1], threads),
                      ggml_type, "mul_mat")
    return out


def parts(k: int, weights: list[tuple[int, np.ndarray, int]]):
    """``pq_part``s of (type, contiguous uint8 rows, first column) each (the arrays must
    outlive them)."""
    bound = (Part * len(weights))()
    for j, (t, w, col) in enumerate(weights):
        assert w.flags.c_contiguous and w.shape[1] == k // GGML_TYPES[t][1] * GGML_TYPES[t][2]
        bound[j] = Part(t, w.shape[0], w.shape[1], col, w.ctypes.data)
    return bound


def linear(k: int, weights: list[tuple[int, np.ndarray, int]], x: np.ndarray, out: np.ndarray,
           threads: int = 0) -> np.ndarray:
    """``pq_linear``: out[:, col:col + rows] = x @ W^T for each (type, w, col), one call."""
    m = _f32(x).shape[0]
    bound = parts(k, weights)
    cpu_lib.raise_for(lib().pq_linear(ctypes.addressof(bound), len(weights), k, x.ctypes.data, m,
                                      k, _f32(out).ctypes.data, out.shape[1], threads),
                      None, "linear")
    return out


def linear_rows(k: int, weights, ranges: list[tuple[int, int]], x: np.ndarray,
                out: np.ndarray) -> int:
    """``pq_linear_rows``'s return code: part j over x's rows ``ranges[j]`` (first, count)."""
    bound = parts(k, weights)
    flat = (ctypes.c_int64 * (2 * len(ranges)))(*[v for r in ranges for v in r])
    return lib().pq_linear_rows(ctypes.addressof(bound), flat, len(weights), k,
                                _f32(x).ctypes.data, x.shape[0], k, _f32(out).ctypes.data,
                                out.shape[1], 0)


def dequantize_rows(ggml_type: int, w: np.ndarray, k: int, ids: np.ndarray,
                    out: Optional[np.ndarray] = None) -> np.ndarray:
    ids = np.ascontiguousarray(ids, np.int64)
    out = np.empty((len(ids), k), np.float32) if out is None else out
    cpu_lib.raise_for(lib().pq_dequantize_rows(ggml_type, w.ctypes.data, k, w.strides[0],
                                               ids.ctypes.data, len(ids), out.ctypes.data,
                                               out.strides[0] // 4, 0),
                      ggml_type, "dequantize_rows")
    return out


def isa() -> str:
    return lib().pq_isa().decode()


def supported_isas() -> list[str]:
    return lib().pq_supported_isas().decode().split(",")


def all_isas() -> list[str]:
    return lib().pq_all_isas().decode().split(",")


@contextlib.contextmanager
def forcing_isa(name: str) -> Iterator[None]:
    before = isa()
    assert lib().pq_set_isa(name.encode()) == cpu_lib.OK, name
    try:
        yield
    finally:
        lib().pq_set_isa(before.encode())


def gemm_rows() -> int:
    return int(lib().pq_gemm_rows(0))


@contextlib.contextmanager
def forcing_gemm_rows(rows: int) -> Iterator[None]:
    """The many-row product from ``rows`` rows (1: every product; huge: none)."""
    before = lib().pq_gemm_rows(rows)
    try:
        yield
    finally:
        lib().pq_gemm_rows(before)
