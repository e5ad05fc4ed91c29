"""ctypes binding of the CPU quantized kernels (the C library in ``cpu_quant/``).

Weights stay in their GGUF block format (uint8 tensors, one row of blocks per
output feature); activations are quantized to int16 per block of 32
(``quantize_activations``) and multiplied with integer dot products
(``mul_mat``); ``dequantize_rows`` reads single rows back as float32 (the
embedding lookup). docs/cpu_kernels.md describes the design.

Types with a decoder in this library: Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2_K, Q3_K, Q4_K,
Q5_K, Q6_K, IQ4_NL, IQ4_XS (``QUANT_KERNEL_TYPES`` asks the built library which are
linked in; a type whose decoder is missing is refused, never computed wrong).

The library is loaded by ``cpu_lib.py`` (``available()``, ``unavailable_reason()``:
nothing raises at import). Every shape, dtype and stride is checked here (``ValueError``)
so the C side never sees a bad pointer.
"""

from __future__ import annotations

import contextlib
import ctypes
from dataclasses import dataclass
from typing import Iterator, Optional

import torch

from ...errors import UnsupportedFeatureError
from ..loader.gguf_quants import GGML_TYPES, type_name

# torch first: its libgomp.so.1 is then the one the library's NEEDED entry binds to
# (one OpenMP pool, sized by torch.set_num_threads).
from .cpu_lib import (KNOWN_TYPES, OK, QUANT_KERNEL_TYPES, Part,  # noqa: F401
                      available, lib as _lib, raise_for as _raise_for,
                      unavailable_reason)


def gemm_rows() -> int:
    """From how many rows ``BlockLinear`` takes the many-row product (gemm_i16.c)."""
    return int(_lib().pq_gemm_rows(0))


def isa() -> str:
    """The SIMD variant in use: 'avx512vnni', 'avxvnni', 'avx2' or 'scalar'."""
    return _lib().pq_isa().decode()


def supported_isas() -> list[str]:
    """The variants this CPU can run, best first (always ends with 'scalar')."""
    return _lib().pq_supported_isas().decode().split(",")


def all_isas() -> list[str]:
    """Every variant compiled into the library, best first."""
    return _lib().pq_all_isas().decode().split(",")


def set_isa(name: Optional[str]) -> None:
    """Force a variant by name (None or 'auto': the best one); refused when the CPU lacks it."""
    lib = _lib()
    if lib.pq_set_isa((name or "auto").encode()) != OK:
        raise UnsupportedFeatureError(
            f"CPU kernel variant {name!r} is unknown or not supported by this CPU "
            f"(supported: {', '.join(supported_isas())}; compiled: {', '.join(all_isas())})")


@contextlib.contextmanager
def forcing_isa(name: str) -> Iterator[None]:
    """Run a block with one variant forced (tests); the previous one is restored after."""
    before = isa()
    set_isa(name)
    try:
        yield
    finally:
        set_isa(before)


@contextlib.contextmanager
def forcing_gemm_rows(rows: int) -> Iterator[None]:
    """Run a block with the many-row product taken from ``rows`` rows (tests: 1 for every
    product, a huge count for none); the previous threshold is restored after."""
    before = int(_lib().pq_gemm_rows(rows))
    try:
        yield
    finally:
        _lib().pq_gemm_rows(before)


@dataclass(frozen=True)
class QuantizedActivations:
    """Activations quantized per block of 32: q int16 [M, K], d float32 [M, K/32]
    (value = d * q), gsum int32 [M, K/16] (sum of q per 16, for the weights' offsets)."""

    q: torch.Tensor
    d: torch.Tensor
    gsum: torch.Tensor

    @property
    def m(self) -> int:
        return self.q.shape[0]

    @property
    def k(self) -> int:
        return self.q.shape[1]

    def dequantized(self) -> torch.Tensor:
        """float32 [M, K] of the values the kernels actually multiply (tests)."""
        return (self.q.float().view(self.m, -1, 32) * self.d.unsqueeze(-1)).view(self.m, self.k)


def _check_threads(threads: int) -> int:
    if not isinstance(threads, int) or threads < 0:
        raise ValueError(f"threads must be an int >= 0 (0: torch's thread count), got {threads!r}")
    return threads


def quantize_activations(x: torch.Tensor, threads: int = 0) -> QuantizedActivations:
    """float32 [M, K] (rows may be strided, unit column stride) -> QuantizedActivations; K % 32 == 0."""
    if x.dtype != torch.float32 or x.dim() != 2 or x.device.type != "cpu":
        raise ValueError(f"x must be a 2-D float32 CPU tensor, got {x.dtype} {tuple(x.shape)} on {x.device}")
    m, k = x.shape
    if k == 0 or k % 32 != 0:
        raise ValueError(f"K must be a positive multiple of 32, got {k}")
    if m > 0 and x.stride(1) != 1:
        raise ValueError("x must have unit column stride")
    ldx = x.stride(0) if m > 1 else k
    q = torch.empty((m, k), dtype=torch.int16)
    d = torch.empty((m, k // 32), dtype=torch.float32)
    gsum = torch.empty((m, k // 16), dtype=torch.int32)
    if m:
        rc = _lib().pq_quantize_act(x.data_ptr(), m, k, ldx, q.data_ptr(), d.data_ptr(),
                                    gsum.data_ptr(), _check_threads(threads))
        _raise_for(rc, None, "quantize_activations")
    return QuantizedActivations(q, d, gsum)


def _check_weights(ggml_type: int, w: torch.Tensor, k: int) -> tuple[int, int]:
    """-> (rows, row_bytes) of a weight tensor of GGUF blocks."""
    if ggml_type not in GGML_TYPES or ggml_type not in KNOWN_TYPES:
        raise NotImplementedError(f"no CPU quantized kernel for GGUF type {type_name(ggml_type)}")
    name, block_elems, block_bytes = GGML_TYPES[ggml_type]
    if w.dtype != torch.uint8 or w.dim() != 2 or w.device.type != "cpu":
        raise ValueError(f"w must be a 2-D uint8 CPU tensor of {name} blocks, got {w.dtype} {tuple(w.shape)}")
    if not isinstance(k, int) or k <= 0 or k % block_elems != 0:
        raise ValueError(f"K={k!r} is not a positive multiple of {name}'s block of {block_elems}")
    need = k // block_elems * block_bytes
    if w.shape[1] != need:
        raise ValueError(f"w rows hold {w.shape[1]} bytes; {name} rows of K={k} take {need}")
    if w.shape[0] > 0 and w.stride(1) != 1:
        raise ValueError("w rows must be contiguous bytes (unit column stride)")
    row_bytes = w.stride(0) if w.shape[0] > 1 else need
    if row_bytes < need:
        raise ValueError(f"w row stride {row_bytes} is smaller than a row ({need} bytes)")
    if ggml_type not in QUANT_KERNEL_TYPES:
        _lib()
        raise NotImplementedError(f"no CPU quantized kernel for GGUF type {name} in this build")
    return w.shape[0], row_bytes


def _check_out(out: torch.Tensor, rows: int, cols: int, what: str) -> int:
    """-> row stride of a float32 [rows, cols] output view with unit column stride."""
    if out.dtype != torch.float32 or out.device.type != "cpu" or tuple(out.shape) != (rows, cols):
        raise ValueError(f"{what} must be float32 [{rows}, {cols}] on CPU, got {out.dtype} {tuple(out.shape)}")
    if rows and cols and out.stride(1) != 1 and cols > 1:
        raise ValueError(f"{what} must have unit column stride")
    ld = out.stride(0) if rows > 1 else cols
    if rows > 1 and ld < cols:
        raise ValueError(f"{what} row stride {ld} is smaller than its {cols} columns")
    return ld


def mul_mat(ggml_type: int, w: torch.Tensor, k: int, act: QuantizedActivations, out: torch.Tensor,
            threads: int = 0) -> torch.Tensor:
    """out[M, N] = x @ W^T, x the activations ``act`` (M rows of K), W the N rows of ``w``
    (uint8 [N, row bytes] of GGUF type ``ggml_type``). ``out`` may be a column slice of a
    wider tensor. Returns ``out``."""
    n, row_bytes = _check_weights(ggml_type, w, k)
    if not isinstance(act, QuantizedActivations) or act.k != k:
        raise ValueError(f"act must be QuantizedActivations of K={k}, got {type(act).__name__}"
                         f" of K={getattr(act, 'k', '?')}")
    m = act.m
    ld = _check_out(out, m, n, "out")
    if m == 0 or n == 0:
        return out
    rc = _lib().pq_mul_mat(ggml_type, w.data_ptr(), n, k, row_bytes, act.q.data_ptr(),
                           act.d.data_ptr(), act.gsum.data_ptr(), m, out.data_ptr(), ld,
                           _check_threads(threads))
    _raise_for(rc, ggml_type, "mul_mat")
    return out


class BlockLinear:
    """A linear layer's block parts bound once: ``(ggml_type, w, first output column)`` per
    part, checked here, so a product is one library call (quantize the rows, then every
    part's rows in one parallel region) with nothing left to check but x and out."""

    def __init__(self, k: int, parts: list[tuple[int, torch.Tensor, int]]):
        if not parts:
            raise ValueError("a BlockLinear needs at least one part")
        self.k = k
        self.width = max(col + w.shape[0] for _, w, col in parts)
        self._weights = [w for _, w, _ in parts]  # the pointers below stay valid
        self.parts = (Part * len(parts))()  # pq_part[]: what cpu_layer.py binds too
        for j, (ggml_type, w, col) in enumerate(parts):
            rows, row_bytes = _check_weights(ggml_type, w, k)
            if not isinstance(col, int) or col < 0:
                raise ValueError(f"part {j}: column {col!r} must be an int >= 0")
            self.parts[j] = Part(ggml_type, rows, row_bytes, col, w.data_ptr())
        self._lib = _lib()

    def __call__(self, x: torch.Tensor, out: torch.Tensor, threads: int = 0) -> torch.Tensor:
        """out[:, col:col + rows] = x @ W_j^T for each part j; x float32 [M, K] with unit
        column stride, out float32 [M, >= every part's last column]. Returns ``out``.
        x is quantized to int16 per block of 32 and the sums are integers per block (the
        row dots, or from ``gemm_rows()`` rows the many-row product)."""
        if x.dtype != torch.float32 or x.dim() != 2 or x.shape[1] != self.k or x.device.type != "cpu":
            raise ValueError(f"x must be float32 [M, {self.k}] on CPU, got {x.dtype} {tuple(x.shape)}")
        m = x.shape[0]
        if x.stride(1) != 1:
            raise ValueError("x must have unit column stride")
        if out.dtype != torch.float32 or out.dim() != 2 or out.shape[0] != m or out.shape[1] < self.width:
            raise ValueError(f"out must be float32 [{m}, >= {self.width}], got {out.dtype} {tuple(out.shape)}")
        if out.stride(1) != 1:
            raise ValueError("out must have unit column stride")
        if m == 0:
            return out
        ldx = x.stride(0) if m > 1 else self.k
        ldy = out.stride(0) if m > 1 else out.shape[1]
        rc = self._lib.pq_linear(ctypes.addressof(self.parts), len(self.parts), self.k,
                                 x.data_ptr(), m, ldx, out.data_ptr(), ldy, _check_threads(threads))
        _raise_for(rc, None, "BlockLinear")
        return out


MAX_PARTS = 128  # PQ_MAX_PARTS: the most parts one product takes


def linear_rows(parts: list[Part], ranges: list[tuple[int, int]], k: int, x: torch.Tensor,
                out: torch.Tensor, threads: int = 0) -> torch.Tensor:
    """out[r, col_j:col_j + rows_j] = x[r] @ W_j^T for each part j and each row r of its run
    ``ranges[j]`` = (first row, row count), in one library call: ``parts`` are
    ``BlockLinear.parts`` entries (already checked, bound to weights their owners keep
    alive); x float32 [M, K], out float32 [M, >= every part's last column], both
    contiguous. Routed experts: a part per expert and projection over its rows (sorted
    by expert), or per (token, expert) pair over the pair's row."""
    n = len(parts)
    if not 0 < n <= MAX_PARTS or len(ranges) != n:
        raise ValueError(f"linear_rows takes 1 to {MAX_PARTS} parts with one row range each, "
                         f"got {n} parts and {len(ranges)} ranges")
    m = x.shape[0]
    if (x.dtype != torch.float32 or x.dim() != 2 or x.shape[1] != k or not x.is_contiguous()
            or x.device.type != "cpu"):
        raise ValueError(f"x must be contiguous float32 [M, {k}] on CPU, got {x.dtype} {tuple(x.shape)}")
    width = max(p.col + p.rows for p in parts)
    if (out.dtype != torch.float32 or out.dim() != 2 or out.shape[0] != m or out.shape[1] < width
            or not out.is_contiguous()):
        raise ValueError(f"out must be contiguous float32 [{m}, >= {width}], got {out.dtype} "
                         f"{tuple(out.shape)}")
    flat = [v for first, count in ranges for v in (first, count)]
    if any(first < 0 or count < 1 or first + count > m for first, count in ranges):
        raise ValueError(f"each row range must be a run of at least one row inside [0, {m})")
    bound = (Part * n)(*parts)
    rc = _lib().pq_linear_rows(ctypes.addressof(bound), (ctypes.c_int64 * (2 * n))(*flat), n, k,
                               x.data_ptr(), m, k, out.data_ptr(), out.shape[1],
                               _check_threads(threads))
    _raise_for(rc, None, "linear_rows")
    return out


def dequantize_rows(ggml_type: int, w: torch.Tensor, k: int, ids: torch.Tensor,
                    out: torch.Tensor, threads: int = 0) -> torch.Tensor:
    """out[i] = float32 values of row ids[i] of ``w`` (GGUF type ``ggml_type``, K elements
    a row), bit-exact with the loader's dequantization. Returns ``out``."""
    rows, row_bytes = _check_weights(ggml_type, w, k)
    if ids.dtype != torch.int64 or ids.dim() != 1 or not ids.is_contiguous() or ids.device.type != "cpu":
        raise ValueError(f"ids must be a contiguous 1-D int64 CPU tensor, got {ids.dtype} {tuple(ids.shape)}")
    n = ids.shape[0]
    ld = _check_out(out, n, k, "out")
    if n == 0:
        return out
    lo, hi = int(ids.min()), int(ids.max())
    if lo < 0 or hi >= rows:
        raise ValueError(f"row ids must lie in [0, {rows}), got [{lo}, {hi}]")
    rc = _lib().pq_dequantize_rows(ggml_type, w.data_ptr(), k, row_bytes, ids.data_ptr(), n,
                                   out.data_ptr(), ld, _check_threads(threads))
    _raise_for(rc, ggml_type, "dequantize_rows")
    return out
