"""Matrix-vector products for one-row steps, with the op before them fused in.

Reference: ``F.linear`` (bf16 operands, float32 accumulation) after that op's own
reference: ``layers.norm.RMSNorm`` with the decoder layer's residual add before it
(``norm_gemv``), ``layers.activation.act_and_mul`` (``gated_gemv``).

A batch-1 decode step reads every weight once and does almost no arithmetic, so
its time is the weights' streaming plus, for each small op between two
projections, a launch and a ramp-up during which memory idles. Each program here
owns ``BLOCK_N`` output features and walks the whole input row in ``BLOCK_K``
chunks, keeping a ``[BLOCK_N, BLOCK_K]`` float32 partial sum that it reduces once at
the end: no split-K pass and no second kernel. The input row is tiny and read by
every program from cache, so the op before the product is recomputed per program
instead of launched on its own: the RMS of the row is a first pass over it, the
normed (or activated) input is rounded to the model dtype exactly where the unfused
kernels round it, and program 0 writes the new residual. The weights are marked
evict-first so the row stays cached.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from pocketllm.errors import UnsupportedFeatureError

from .gated_act import KERNEL_ACTIVATIONS


@triton.jit
def _input_chunk(X, Res, NormW, ResOut, cols, k_ok, x_half, inv_rms, write_res,
                 PRE: tl.constexpr):
    """The product's input at ``cols`` in float32, after the fused op."""
    x = tl.load(X + cols, mask=k_ok, other=0.0)
    if PRE == "add_norm":
        x = (x.to(tl.float32) + tl.load(Res + cols, mask=k_ok, other=0.0).to(tl.float32)
             ).to(X.dtype.element_ty)
        if write_res:
            tl.store(ResOut + cols, x, mask=k_ok)
    xf = x.to(tl.float32)
    if PRE == "norm" or PRE == "add_norm":
        w = tl.load(NormW + cols, mask=k_ok, other=0.0).to(tl.float32)
        xf = (xf * inv_rms * w).to(X.dtype.element_ty).to(tl.float32)
    elif PRE != "":
        up = tl.load(X + x_half + cols, mask=k_ok, other=0.0).to(tl.float32)
        if PRE == "silu":
            act = xf / (1.0 + tl.exp(-xf))
        elif PRE == "gelu_tanh":
            inner = 0.7978845608028654 * (xf + 0.044715 * xf * xf * xf)
            inner = tl.minimum(tl.maximum(inner, -15.0), 15.0)
            act = 0.5 * xf * (2.0 - 2.0 / (tl.exp(2.0 * inner) + 1.0))
        else:
            act = 0.5 * xf * (1.0 + tl.erf(xf * 0.7071067811865476))
        xf = (act * up).to(X.dtype.element_ty).to(tl.float32)
    return xf


@triton.jit
def _gemv_kernel(X, Res, NormW, ResOut, W, Bias, Y, N, K, stride_w, x_half, eps,
                 BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, ROW_BLOCK: tl.constexpr,
                 EVEN_K: tl.constexpr, HAS_BIAS: tl.constexpr, PRE: tl.constexpr):
    pid = tl.program_id(0)
    rows = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < N
    rows = tl.where(row_ok, rows, 0)  # padded rows reread row 0: no mask on the hot loads
    inv_rms = 1.0
    if PRE == "norm" or PRE == "add_norm":  # the row's RMS, in ROW_BLOCK-wide loads
        sq = tl.zeros([ROW_BLOCK], dtype=tl.float32)
        for r0 in range(0, K, ROW_BLOCK):
            cols = r0 + tl.arange(0, ROW_BLOCK)
            k_ok = cols < K
            x = tl.load(X + cols, mask=k_ok, other=0.0)
            if PRE == "add_norm":
                x = (x.to(tl.float32) + tl.load(Res + cols, mask=k_ok, other=0.0).to(tl.float32)
                     ).to(X.dtype.element_ty)
            sq += x.to(tl.float32) * x.to(tl.float32)
        inv_rms = 1.0 / tl.sqrt(tl.sum(sq, 0) / K + eps)
    ks = tl.arange(0, BLOCK_K)
    w_ptrs = W + rows.to(tl.int64)[:, None] * stride_w + ks[None, :]
    acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        cols = k0 + ks
        k_ok = cols < K
        if EVEN_K:
            w = tl.load(w_ptrs, eviction_policy="evict_first")
        else:
            w = tl.load(w_ptrs, mask=k_ok[None, :], other=0.0, eviction_policy="evict_first")
        xf = _input_chunk(X, Res, NormW, ResOut, cols, k_ok, x_half, inv_rms, pid == 0, PRE)
        acc += w.to(tl.float32) * xf[None, :]
        w_ptrs += BLOCK_K
    y = tl.sum(acc, 1)
    if HAS_BIAS:
        y += tl.load(Bias + rows).to(tl.float32)
    tl.store(Y + rows, y.to(Y.dtype.element_ty), mask=row_ok)


# (BLOCK_N, BLOCK_K, num_warps): the most even of the settings timed on an H200 across
# the Llama-3-8B projections (docs/benchmarks.md); BLOCK_K shrinks for narrow rows.
CONFIG = (8, 512, 4)


def _check_row(x: torch.Tensor, width: int, what: str) -> torch.Tensor:
    if x.dim() != 2 or x.shape[0] != 1:
        raise ValueError(f"a gemv takes one row, got {what} of shape {tuple(x.shape)}")
    if x.shape[1] != width:
        raise ValueError(f"{what} has {x.shape[1]} features; the weight takes {width}")
    return x if x.stride(-1) == 1 else x.contiguous()


def _launch(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], pre: str,
            residual: Optional[torch.Tensor] = None, norm_weight: Optional[torch.Tensor] = None,
            eps: float = 0.0, out_dtype: Optional[torch.dtype] = None,
            config: Optional[tuple[int, int, int]] = None
            ) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    n, k = weight.shape
    if weight.stride(-1) != 1:
        raise ValueError("a gemv needs a weight whose rows are contiguous")
    y = torch.empty(1, n, device=x.device, dtype=out_dtype or x.dtype)
    res_out = torch.empty_like(x) if pre == "add_norm" else None
    block_n, block_k, warps = config or CONFIG
    block_k = min(block_k, triton.next_power_of_2(k))
    _gemv_kernel[(triton.cdiv(n, block_n),)](
        x, residual if residual is not None else x,
        norm_weight if norm_weight is not None else x, res_out if res_out is not None else y,
        weight, bias if bias is not None else weight, y, n, k, weight.stride(0), k, eps,
        BLOCK_N=block_n, BLOCK_K=block_k, ROW_BLOCK=min(triton.next_power_of_2(k), 8192),
        EVEN_K=k % block_k == 0, HAS_BIAS=bias is not None, PRE=pre, num_warps=warps)
    return y, res_out


def gemv(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None,
         out_dtype: Optional[torch.dtype] = None,
         config: Optional[tuple[int, int, int]] = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` for x [1, K] -> [1, N] (``out_dtype``: x's if None)."""
    x = _check_row(x, weight.shape[1], "x")
    return _launch(x, weight, bias, "", out_dtype=out_dtype, config=config)[0]


def gated_gemv(gate_up: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
               hidden_act: str, config: Optional[tuple[int, int, int]] = None) -> torch.Tensor:
    """``F.linear(act_and_mul(gate_up), weight, bias)`` for a ``[gate | up]`` row [1, 2K]."""
    act = KERNEL_ACTIVATIONS.get(hidden_act)
    if act is None:
        raise UnsupportedFeatureError(f"activation {hidden_act!r} has no Triton kernel")
    gate_up = _check_row(gate_up, 2 * weight.shape[1], "gate_up")
    return _launch(gate_up, weight, bias, act, config=config)[0]


def norm_gemv(x: torch.Tensor, residual: Optional[torch.Tensor], norm_weight: torch.Tensor,
              eps: float, weight: torch.Tensor, bias: Optional[torch.Tensor] = None,
              config: Optional[tuple[int, int, int]] = None
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(F.linear(rmsnorm(x + residual), weight, bias), x + residual)``, the sum rounded
    to x's dtype first (``add_rms_norm``'s contract); residual None: ``rmsnorm(x)``, x."""
    x = _check_row(x, weight.shape[1], "x")
    if residual is None:
        return _launch(x, weight, bias, "norm", None, norm_weight, eps, config=config)[0], x
    residual = _check_row(residual, weight.shape[1], "residual")
    return _launch(x, weight, bias, "add_norm", residual, norm_weight, eps, config=config)
