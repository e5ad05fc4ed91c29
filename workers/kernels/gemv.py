"""Matrix-vector product for one-token steps: ``y = x @ W.T (+ b)``, x one row.

Reference: ``F.linear`` (bf16 operands, float32 accumulation). A batch-1 decode step
reads every weight once and does almost no arithmetic, so its speed is the rate at
which the projections stream their weights. Each program here owns ``BLOCK_N``
output features and walks the whole input row in ``BLOCK_K`` chunks, keeping a
``[BLOCK_N, BLOCK_K]`` float32 partial sum that it reduces once at the end: no
split-K pass and no second kernel. The weights are marked evict-first so the input
row stays cached for the other programs.

``ACT`` optionally computes the input on the fly from a fused ``[gate | up]`` row
(``act(gate) * up``, rounded to the model dtype as ``gated_act`` rounds it), so the
MLP's down projection and the activation before it are one launch.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from pocketllm.errors import UnsupportedFeatureError

from .gated_act import KERNEL_ACTIVATIONS


@triton.jit
def _gemv_kernel(X, W, Bias, Y, N, K, stride_w, x_half,
                 BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
                 HAS_BIAS: tl.constexpr, ACT: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < N
    rows = tl.where(row_ok, rows, 0)  # padded rows reread row 0: no mask on the hot loads
    ks = tl.arange(0, BLOCK_K)
    w_ptrs = W + rows.to(tl.int64)[:, None] * stride_w + ks[None, :]
    acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        cols = k0 + ks
        if EVEN_K:
            w = tl.load(w_ptrs, eviction_policy="evict_first")
            x = tl.load(X + cols)
            if ACT != "":
                up = tl.load(X + x_half + cols)
        else:
            k_ok = cols < K
            w = tl.load(w_ptrs, mask=k_ok[None, :], other=0.0, eviction_policy="evict_first")
            x = tl.load(X + cols, mask=k_ok, other=0.0)
            if ACT != "":
                up = tl.load(X + x_half + cols, mask=k_ok, other=0.0)
        xf = x.to(tl.float32)
        if ACT == "silu":
            xf = (xf / (1.0 + tl.exp(-xf)) * up.to(tl.float32)).to(X.dtype.element_ty).to(tl.float32)
        elif ACT == "gelu_tanh":
            inner = 0.7978845608028654 * (xf + 0.044715 * xf * xf * xf)
            inner = tl.minimum(tl.maximum(inner, -15.0), 15.0)
            act = 0.5 * xf * (2.0 - 2.0 / (tl.exp(2.0 * inner) + 1.0))
            xf = (act * up.to(tl.float32)).to(X.dtype.element_ty).to(tl.float32)
        elif ACT == "gelu":
            act = 0.5 * xf * (1.0 + tl.erf(xf * 0.7071067811865476))
            xf = (act * up.to(tl.float32)).to(X.dtype.element_ty).to(tl.float32)
        acc += w.to(tl.float32) * xf[None, :]
        w_ptrs += BLOCK_K
    y = tl.sum(acc, 1)
    if HAS_BIAS:
        y += tl.load(Bias + rows).to(tl.float32)
    tl.store(Y + rows, y.to(Y.dtype.element_ty), mask=row_ok)


def _config(n: int, k: int) -> tuple[int, int, int]:
    """(BLOCK_N, BLOCK_K, num_warps): enough programs to fill the chip, 16-byte loads."""
    block_k = min(512, triton.next_power_of_2(k))
    block_n = 8 if n <= 8192 else 16
    return block_n, block_k, 4


def gemv(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None,
         hidden_act: str = "", config: Optional[tuple[int, int, int]] = None) -> torch.Tensor:
    """x [1, K] (or, with ``hidden_act``, a ``[gate | up]`` row [1, 2K]) -> [1, N]."""
    if x.dim() != 2 or x.shape[0] != 1:
        raise ValueError(f"gemv takes one row, got x of shape {tuple(x.shape)}")
    act = ""
    if hidden_act:
        act = KERNEL_ACTIVATIONS.get(hidden_act)
        if act is None:
            raise UnsupportedFeatureError(f"activation {hidden_act!r} has no Triton kernel")
    n, k = weight.shape
    if x.shape[1] != (2 * k if act else k):
        raise ValueError(f"x has {x.shape[1]} features; the weight takes {k}"
                         + (" (times two: gate and up)" if act else ""))
    if x.stride(-1) != 1:
        x = x.contiguous()
    if weight.stride(-1) != 1:
        raise ValueError("gemv needs a weight whose rows are contiguous")
    y = torch.empty(1, n, device=x.device, dtype=x.dtype)
    block_n, block_k, warps = config or _config(n, k)
    _gemv_kernel[(triton.cdiv(n, block_n),)](
        x, weight, bias if bias is not None else weight, y, n, k, weight.stride(0), k,
        BLOCK_N=block_n, BLOCK_K=block_k, EVEN_K=k % block_k == 0,
        HAS_BIAS=bias is not None, ACT=act, num_warps=warps)
    return y
