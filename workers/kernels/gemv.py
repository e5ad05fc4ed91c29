"""Matrix-vector products for steps of one to eight rows, with the op before them fused in.

Reference: ``F.linear`` (bf16 operands, float32 accumulation) after that op's own
reference: ``layers.norm.RMSNorm`` with the decoder layer's residual add before it
(``norm_gemv``), ``layers.activation.act_and_mul`` (``gated_gemv``).

A batch-1 decode step reads every weight once and does almost no arithmetic, so
its time is the weights' streaming plus, for each small op between two
projections, a launch and a ramp-up during which memory idles. Each program here
owns ``BLOCK_N`` output features and walks the whole input row in ``BLOCK_K``
chunks, keeping float32 partial sums per (feature, column) that it reduces once at
the end: no split-K pass and no second kernel. The input row is tiny and read by
every program from cache, so the op before the product is recomputed per program
instead of launched on its own: the RMS of the row is a first pass over it, the
normed (or activated) input is rounded to the model dtype exactly where the unfused
kernels round it, and program 0 writes the new residual. The q/k/v projection can
also leave q and k rotated: a program then owns the same dims of both halves of a
head, the pairs that rotary embedding mixes. The weights are marked
evict-first so the row stays cached.

Two to eight rows (a small batch, or a speculative step's last token and its drafts,
docs/speculative.md) share each weight chunk in ``_rows_kernel``, which gives every row
the bits the one-row kernel gives it alone: the same partial sums per (feature, column)
and the same fixed-order sum of them (``fixed_sum.py``); its norm and rotary run in their
own launches, whose rounding is the fused ones'. A draft is then verified with exactly the
arithmetic that would have decoded it.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from pocketllm.errors import UnsupportedFeatureError

from . import pdl
from .fixed_sum import lane_sum
from .gated_act import KERNEL_ACTIVATIONS, act_and_mul, activate
from .pdl import wait_for_prior
from .rmsnorm import add_rms_norm, rms_norm
from .rotary import apply_rotary_qk

# (cos, sin, head_dim, rows): see norm_gemv.
# 2^120: e4m3's exponent bias (7) against float32's (127), see _weights
E4M3_UNBIAS: tl.constexpr = tl.constexpr(2.0 ** 120)
Rotary = tuple[torch.Tensor, torch.Tensor, int, int]


@triton.jit
def _input_chunk(X, Res, NormW, ResOut, NormOut, cols, k_ok, x_half, inv_rms, write_res,
                 PRE: tl.constexpr, WRITE_NORMED: tl.constexpr):
    """The product's input at ``cols`` in float32, after the fused op (program 0 also
    writes the new residual and, with WRITE_NORMED, the normed row)."""
    x = tl.load(X + cols, mask=k_ok, other=0.0)
    if PRE == "add_norm":
        x = (x.to(tl.float32) + tl.load(Res + cols, mask=k_ok, other=0.0).to(tl.float32)
             ).to(X.dtype.element_ty)
        if write_res:
            tl.store(ResOut + cols, x, mask=k_ok)
    xf = x.to(tl.float32)
    if PRE == "norm" or PRE == "add_norm":
        w = tl.load(NormW + cols, mask=k_ok, other=0.0).to(tl.float32)
        xn = (xf * inv_rms * w).to(X.dtype.element_ty)
        if WRITE_NORMED:
            if write_res:
                tl.store(NormOut + cols, xn, mask=k_ok)
        xf = xn.to(tl.float32)
    elif PRE != "":
        up = tl.load(X + x_half + cols, mask=k_ok, other=0.0).to(tl.float32)
        xf = (activate(xf, PRE) * up).to(X.dtype.element_ty).to(tl.float32)
    return xf


@triton.jit
def _weights(w, SCALED: tl.constexpr):
    """A chunk of weights as float32. FP8 (e4m3 bytes, SCALED): the byte's exponent and
    mantissa moved into float32's, which is the value times 2^-120, exact for subnormals
    too (``E4M3_UNBIAS`` restores it on the sum): two logic ops a weight, where a converting
    instruction (e4m3 -> f16 -> f32) runs at a quarter of the ALU's rate and bounds the
    kernel below the memory's."""
    if SCALED:
        b = w.to(tl.int32)
        return (((b & 0x80) << 24) | ((b & 0x7F) << 20)).to(tl.float32, bitcast=True)
    return w.to(tl.float32)


@triton.jit
def _gemv_kernel(X, Res, NormW, ResOut, NormOut, W, Scale, Bias, Y, Cos, Sin, N, K, stride_w,
                 x_half, eps, rot_rows, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 ROW_BLOCK: tl.constexpr, HAS_BIAS: tl.constexpr, SCALED: tl.constexpr,
                 PRE: tl.constexpr, HALF: tl.constexpr, WRITE_NORMED: tl.constexpr,
                 PDL: tl.constexpr):
    pid = tl.program_id(0)
    # Each program owns two groups of BLOCK_N / 2 rows: adjacent ones, or (HALF > 0) the
    # same dims of the two halves of a head, the pairs the rotary epilogue rotates.
    HB: tl.constexpr = BLOCK_N // 2
    if HALF > 0:
        per_head: tl.constexpr = HALF // HB
        rows_a = (pid // per_head) * (2 * HALF) + (pid % per_head) * HB + tl.arange(0, HB)
        rows_b = rows_a + HALF
    else:
        rows_a = pid * BLOCK_N + tl.arange(0, HB)
        rows_b = rows_a + HB
    a_ok, b_ok = rows_a < N, rows_b < N
    rows_a = tl.where(a_ok, rows_a, 0)  # padded rows reread row 0: no mask on the hot loads
    rows_b = tl.where(b_ok, rows_b, 0)
    # The first chunk of weights is in flight before the wait (pdl.py): the weights are
    # no kernel's output. Each step then loads the next chunk before using this one.
    ks = tl.arange(0, BLOCK_K)
    wa_ptrs = W + rows_a.to(tl.int64)[:, None] * stride_w + ks[None, :]
    wb_ptrs = W + rows_b.to(tl.int64)[:, None] * stride_w + ks[None, :]
    wa = tl.load(wa_ptrs, mask=(ks < K)[None, :], other=0.0, eviction_policy="evict_first")
    wb = tl.load(wb_ptrs, mask=(ks < K)[None, :], other=0.0, eviction_policy="evict_first")
    wait_for_prior(PDL)
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
        inv_rms = 1.0 / tl.sqrt(tl.sum(lane_sum(sq[None, :], 1, ROW_BLOCK), 0) / K + eps)
    acc_a = tl.zeros([HB, BLOCK_K], dtype=tl.float32)
    acc_b = tl.zeros([HB, BLOCK_K], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        cols = k0 + ks
        k_ok = cols < K
        wa_ptrs += BLOCK_K
        wb_ptrs += BLOCK_K
        next_ok = (cols + BLOCK_K < K)[None, :]  # none on the last step: nothing is read
        wa_next = tl.load(wa_ptrs, mask=next_ok, other=0.0, eviction_policy="evict_first")
        wb_next = tl.load(wb_ptrs, mask=next_ok, other=0.0, eviction_policy="evict_first")
        xf = _input_chunk(X, Res, NormW, ResOut, NormOut, cols, k_ok, x_half, inv_rms, pid == 0,
                          PRE, WRITE_NORMED)
        acc_a += _weights(wa, SCALED) * xf[None, :]
        acc_b += _weights(wb, SCALED) * xf[None, :]
        wa, wb = wa_next, wb_next
    ya, yb = lane_sum(acc_a, HB, BLOCK_K), lane_sum(acc_b, HB, BLOCK_K)
    if SCALED:  # FP8 weights: each row's scale, once, on its sum
        ya = ya * E4M3_UNBIAS * tl.load(Scale + rows_a)
        yb = yb * E4M3_UNBIAS * tl.load(Scale + rows_b)
    if HAS_BIAS:
        ya += tl.load(Bias + rows_a).to(tl.float32)
        yb += tl.load(Bias + rows_b).to(tl.float32)
    if HALF > 0:  # rotary on q/k heads: round first, rotate in float32 (as the rotary kernel)
        ya = ya.to(Y.dtype.element_ty).to(tl.float32)
        yb = yb.to(Y.dtype.element_ty).to(tl.float32)
        d = rows_a % (2 * HALF)
        cos = tl.load(Cos + d).to(tl.float32)
        sin = tl.load(Sin + d).to(tl.float32)
        rotate = rows_a < rot_rows
        ya, yb = tl.where(rotate, ya * cos - yb * sin, ya), tl.where(rotate, yb * cos + ya * sin, yb)
    tl.store(Y + rows_a, ya.to(Y.dtype.element_ty), mask=a_ok)
    tl.store(Y + rows_b, yb.to(Y.dtype.element_ty), mask=b_ok)


@triton.jit
def _row_sums(acc, ms, M, rows, n_ok, Scale, Bias, Y, stride_y, ROWS: tl.constexpr,
              BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, HAS_BIAS: tl.constexpr,
              SCALED: tl.constexpr):
    """Stores rows ``ms``' sums of ``acc`` [ROWS, BLOCK_N, BLOCK_K] (lanes summed in the
    one-row kernel's fixed order), scaled and biased as it does."""
    y = tl.reshape(lane_sum(tl.reshape(acc, [ROWS * BLOCK_N, BLOCK_K]), ROWS * BLOCK_N, BLOCK_K),
                   [ROWS, BLOCK_N])
    if SCALED:
        y = y * E4M3_UNBIAS * tl.load(Scale + rows)[None, :]
    if HAS_BIAS:
        y += tl.load(Bias + rows).to(tl.float32)[None, :]
    tl.store(Y + ms.to(tl.int64)[:, None] * stride_y + rows[None, :], y.to(Y.dtype.element_ty),
             mask=(ms < M)[:, None] & n_ok[None, :])


@triton.jit
def _rows_kernel(X, W, Scale, Bias, Y, M, N, K, stride_x, stride_w, stride_y,
                 ROWS: tl.constexpr, ROWS_B: tl.constexpr, BLOCK_N: tl.constexpr,
                 BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr, HAS_BIAS: tl.constexpr,
                 SCALED: tl.constexpr, PDL: tl.constexpr):
    """``_gemv_kernel``'s product for 1 < M <= ROWS + ROWS_B rows at once (their norm,
    activation or rotary run in launches of their own, ``_rows``): each weight chunk is read
    once for all rows, and each row's sum is the one-row kernel's, bit for bit, given its
    BLOCK_K: the same partial sum per (feature, column), the same fixed-order lane_sum.
    Weights and rows are loaded as [1, BLOCK_N, BLOCK_K] and [ROWS, 1, BLOCK_K] tiles,
    which (with the warps along BLOCK_K only) share the product's layout: no shuffle
    through shared memory in the loop.

    The rows are two power-of-two groups (5 = 4 + 1, 8 = 4 + 4), so five rows cost five
    rows' multiply-adds, not eight. The loop's instructions bound it, not the memory: rows
    past M reread the last row and the last step rereads its own chunk (EVEN_K), so no
    load takes a mask."""
    pid = tl.program_id(0)
    rows = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = rows < N
    rows = tl.where(n_ok, rows, 0)
    ks = tl.arange(0, BLOCK_K)[None, None, :]
    w_ptrs = W + rows.to(tl.int64)[None, :, None] * stride_w + ks
    ms = tl.arange(0, ROWS)
    x_at = tl.minimum(ms, M - 1)[:, None, None] * stride_x + ks
    ms_b = ROWS + tl.arange(0, ROWS_B)
    xb_at = tl.minimum(ms_b, M - 1)[:, None, None] * stride_x + ks
    if EVEN_K:
        w = tl.load(w_ptrs, eviction_policy="evict_first")
    else:
        w = tl.load(w_ptrs, mask=ks < K, other=0.0, eviction_policy="evict_first")
    wait_for_prior(PDL)
    acc = tl.zeros([ROWS, BLOCK_N, BLOCK_K], dtype=tl.float32)
    acc_b = tl.zeros([ROWS_B, BLOCK_N, BLOCK_K], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        if EVEN_K:
            w_ptrs += tl.where(k0 + BLOCK_K < K, BLOCK_K, 0)
            w_next = tl.load(w_ptrs, eviction_policy="evict_first")
            x = tl.load(X + x_at + k0)
            xb = tl.load(X + xb_at + k0)
        else:
            k_ok = k0 + ks < K
            w_ptrs += BLOCK_K
            w_next = tl.load(w_ptrs, mask=k0 + BLOCK_K + ks < K, other=0.0,
                             eviction_policy="evict_first")
            x = tl.load(X + x_at + k0, mask=k_ok, other=0.0)
            xb = tl.load(X + xb_at + k0, mask=k_ok, other=0.0)
        wf = _weights(w, SCALED)
        acc += wf * x.to(tl.float32)
        acc_b += wf * xb.to(tl.float32)
        w = w_next
    _row_sums(acc, ms, M, rows, n_ok, Scale, Bias, Y, stride_y, ROWS, BLOCK_N, BLOCK_K,
              HAS_BIAS, SCALED)
    _row_sums(acc_b, ms_b, M, rows, n_ok, Scale, Bias, Y, stride_y, ROWS_B, BLOCK_N, BLOCK_K,
              HAS_BIAS, SCALED)


# (BLOCK_N, BLOCK_K, num_warps), timed on an H200 over the projections of the shipped
# models, launched with PDL (``bench_gemv --tune``, docs/benchmarks.md): taller tiles for
# wide outputs (fewer programs redo the norm); for narrow products (o, a shared expert's
# down) four rows a program and eight warps, unless each must redo a norm; a router (at
# most ROUTER outputs) four rows and four warps either way. BLOCK_K shrinks for narrow
# rows.
CONFIG, WIDE_CONFIG, NARROW_CONFIG = (8, 512, 4), (16, 256, 4), (4, 1024, 8)
ROUTER_CONFIG = (4, 1024, 4)
# q/k/v with the rotary epilogue: shorter chunks and two warps (Llama-3-8B's, 6144 x 4096:
# 17.0 us against 19.0 with CONFIG, bench_gemv --tune)
ROTARY_CONFIG = (8, 256, 2)
WIDE, NARROW, ROUTER = 16384, 4096, 512
# FP8 weights (one byte each): taller tiles than bf16's (a program's norm is redone over
# fewer of them), longer chunks for a long input (Llama-3-8B's down); narrow products as
# bf16's. bench_gemv --fp8 --tune on an H100 (docs/benchmarks.md)
FP8_CONFIG, FP8_LONG_CONFIG, FP8_NARROW_CONFIG = (16, 512, 4), (16, 1024, 4), (8, 512, 8)


def _config(n: int, k: int, pre: str, rotates: bool = False, fp8: bool = False
            ) -> tuple[int, int, int]:
    if fp8:
        if n <= NARROW and k <= NARROW and pre not in ("norm", "add_norm"):
            return FP8_NARROW_CONFIG
        return FP8_LONG_CONFIG if k > NARROW else FP8_CONFIG
    if rotates:
        return ROTARY_CONFIG
    if n >= WIDE:
        return WIDE_CONFIG
    if n <= ROUTER:
        return ROUTER_CONFIG
    if n <= NARROW and k <= NARROW and pre not in ("norm", "add_norm"):
        return NARROW_CONFIG
    return CONFIG


def rotary_block_n(block_n: int, head_dim: int) -> int:
    """The tile a rotary launch uses: narrowed until a program's rows stay in one head."""
    while block_n > 2 and (head_dim // 2) % (block_n // 2):
        block_n //= 2
    return block_n


MAX_ROWS = 8  # the most rows one launch takes (rows of x, each computed as alone)


def _check_rows(x: torch.Tensor, width: int, what: str) -> torch.Tensor:
    if x.dim() != 2 or not 1 <= x.shape[0] <= MAX_ROWS:
        raise ValueError(f"a gemv takes 1 to {MAX_ROWS} rows, got {what} of shape "
                         f"{tuple(x.shape)}")
    if x.shape[1] != width:
        raise ValueError(f"{what} has {x.shape[1]} features; the weight takes {width}")
    return x if x.stride(-1) == 1 else x.contiguous()


def _check_weight(weight: torch.Tensor, scale: Optional[torch.Tensor]) -> None:
    n = weight.shape[0]
    if weight.stride(-1) != 1:
        raise ValueError("a gemv needs a weight whose rows are contiguous")
    if (scale is None) == (weight.dtype == torch.float8_e4m3fn):
        raise ValueError("an FP8 weight takes its row scales, and only it")
    if scale is not None and (scale.shape != (n,) or scale.dtype != torch.float32):
        raise ValueError(f"row scales {tuple(scale.shape)} {scale.dtype} for {n} float32 rows")


def _launch(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], pre: str,
            residual: Optional[torch.Tensor] = None, norm_weight: Optional[torch.Tensor] = None,
            eps: float = 0.0, out_dtype: Optional[torch.dtype] = None,
            rotary: Optional["Rotary"] = None, config: Optional[tuple[int, int, int]] = None,
            normed_out: Optional[torch.Tensor] = None, scale: Optional[torch.Tensor] = None
            ) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    n, k = weight.shape
    _check_weight(weight, scale)
    y = torch.empty(1, n, device=x.device, dtype=out_dtype or x.dtype)
    res_out = torch.empty_like(x) if pre == "add_norm" else None
    block_n, block_k, warps = config or _config(n, k, pre, rotary is not None,
                                                 weight.element_size() == 1)
    if normed_out is not None and (normed_out.shape != x.shape or normed_out.dtype != x.dtype
                                   or not normed_out.is_contiguous()):
        raise ValueError("normed_out must be a contiguous tensor like x")
    block_k = min(block_k, triton.next_power_of_2(k))
    half, cos, sin, rot_rows = 0, y, y, 0
    if rotary is not None:
        cos, sin, head_dim, rot_rows = rotary
        half = head_dim // 2
        if head_dim % 2 or n % head_dim or rot_rows % head_dim:
            raise ValueError(f"rotary over heads of {head_dim} does not tile {n} rows")
        block_n = rotary_block_n(block_n, head_dim)
        cos, sin = cos.reshape(half), sin.reshape(half)
    _gemv_kernel[(triton.cdiv(n, block_n),)](
        x, residual if residual is not None else x,
        norm_weight if norm_weight is not None else x, res_out if res_out is not None else y,
        normed_out if normed_out is not None else y,
        weight if scale is None else weight.view(torch.uint8),  # FP8 read as bytes: _weights
        scale if scale is not None else weight, bias if bias is not None else weight, y, cos,
        sin, n, k, weight.stride(0), k, eps, rot_rows, BLOCK_N=block_n, BLOCK_K=block_k,
        ROW_BLOCK=min(triton.next_power_of_2(k), 8192), HAS_BIAS=bias is not None,
        SCALED=scale is not None, PRE=pre, HALF=half, WRITE_NORMED=normed_out is not None,
        num_warps=warps,
        **pdl.launch_options(x.device))
    return y, res_out


def _rows(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], lanes_pre: str,
          rotates: bool = False, out_dtype: Optional[torch.dtype] = None,
          config: Optional[tuple[int, int, int]] = None,
          scale: Optional[torch.Tensor] = None) -> torch.Tensor:
    """x [M, K] (1 < M <= MAX_ROWS) through ``_rows_kernel``. Its BLOCK_K is the one a
    one-row launch of the same product takes (``_config`` with that launch's ``lanes_pre``
    and ``rotates``), so each row's sums are that launch's; a warp covers 256 columns
    (eight a thread), so BLOCK_K sets the warps, and BLOCK_N the partial sums a thread
    holds (rows x BLOCK_N x 8)."""
    m, n, k = x.shape[0], weight.shape[0], weight.shape[1]
    _check_weight(weight, scale)
    lanes = min(_config(n, k, lanes_pre, rotates, weight.element_size() == 1)[1],
                triton.next_power_of_2(k))
    rows_a = 1 << ((m - 1).bit_length() - 1)  # two power-of-two groups: 5 = 4 + 1, 8 = 4 + 4
    rows_b = triton.next_power_of_2(m - rows_a)
    # up to 20 rows x features of partial sums (eight lanes a thread each): five rows take
    # four features a program, the fastest on an H100 (bench_gemv --rows 5 --tune, session 35)
    block_n = 1 << ((20 // (rows_a + rows_b)).bit_length() - 1)
    block_n, block_k, warps = config or (block_n, lanes, max(1, lanes // 256))
    y = torch.empty(m, n, device=x.device, dtype=out_dtype or x.dtype)
    _rows_kernel[(triton.cdiv(n, block_n),)](
        x, weight if scale is None else weight.view(torch.uint8),
        scale if scale is not None else weight, bias if bias is not None else weight, y,
        m, n, k, x.stride(0), weight.stride(0), y.stride(0), ROWS=rows_a, ROWS_B=rows_b,
        BLOCK_N=block_n, BLOCK_K=block_k, EVEN_K=k % block_k == 0,
        HAS_BIAS=bias is not None, SCALED=scale is not None,
        num_warps=warps, **pdl.launch_options(x.device))
    return y


def gemv(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None,
         out_dtype: Optional[torch.dtype] = None,
         config: Optional[tuple[int, int, int]] = None,
         scale: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` for x [M, K] -> [M, N], M <= MAX_ROWS (``out_dtype``:
    x's if None). ``scale``: float32 [N] for an FP8 (e4m3) weight, w = weight * scale[:, None].
    Each row's result is the same whatever M."""
    x = _check_rows(x, weight.shape[1], "x")
    if x.shape[0] > 1:
        return _rows(x, weight, bias, "", out_dtype=out_dtype, config=config, scale=scale)
    return _launch(x, weight, bias, "", out_dtype=out_dtype, config=config, scale=scale)[0]


def gated_gemv(gate_up: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
               hidden_act: str, config: Optional[tuple[int, int, int]] = None,
               scale: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``F.linear(act_and_mul(gate_up), weight, bias)`` for ``[gate | up]`` rows [M, 2K]
    (``scale``: as ``gemv``'s)."""
    act = KERNEL_ACTIVATIONS.get(hidden_act)
    if act is None:
        raise UnsupportedFeatureError(f"activation {hidden_act!r} has no Triton kernel")
    gate_up = _check_rows(gate_up, 2 * weight.shape[1], "gate_up")
    if gate_up.shape[0] > 1:  # the activation as its own launch, rounded as the fused one
        return _rows(act_and_mul(gate_up, hidden_act), weight, bias, act, config=config,
                     scale=scale)
    return _launch(gate_up, weight, bias, act, config=config, scale=scale)[0]


def norm_gemv(x: torch.Tensor, residual: Optional[torch.Tensor], norm_weight: torch.Tensor,
              eps: float, weight: torch.Tensor, bias: Optional[torch.Tensor] = None,
              rotary: Optional[Rotary] = None, config: Optional[tuple[int, int, int]] = None,
              normed_out: Optional[torch.Tensor] = None, scale: Optional[torch.Tensor] = None
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(F.linear(rmsnorm(x + residual), weight, bias), x + residual)``, the sum rounded
    to x's dtype first (``add_rms_norm``'s contract); residual None: ``rmsnorm(x)``, x.
    ``rotary`` = (cos, sin, head_dim, rows): the first ``rows`` outputs are heads of
    ``head_dim`` that leave rotated by each token's cos/sin ([M, 1, D/2] each), as
    ``rotary.apply_rotary_qk`` rotates q and k. ``normed_out`` (like x): receives the
    normed rows themselves, for a second product of them (the experts after their router).
    ``scale``: as ``gemv``'s. One row is one launch; more rows take the norm, the product
    and the rotary as three, each row's bits those of the one-row launch (the norm sums
    as this kernel does, fixed_sum.py)."""
    x = _check_rows(x, weight.shape[1], "x")
    if residual is not None:
        residual = _check_rows(residual, weight.shape[1], "residual")
        if residual.shape != x.shape:
            raise ValueError(f"residual {tuple(residual.shape)} does not match x {tuple(x.shape)}")
    pre = "norm" if residual is None else "add_norm"
    if x.shape[0] == 1:
        y, res_out = _launch(x, weight, bias, pre, residual, norm_weight, eps, rotary=rotary,
                             config=config, normed_out=normed_out, scale=scale)
        return y, x if residual is None else res_out
    if residual is None:
        h = rms_norm(x, norm_weight, eps)
    else:
        h, x = add_rms_norm(x, residual, norm_weight, eps)
    if normed_out is not None:
        normed_out.copy_(h)
    y = _rows(h, weight, bias, pre, rotary is not None, config=config, scale=scale)
    if rotary is not None:
        cos, sin, head_dim, rot_rows = rotary
        apply_rotary_qk(y[:, :rot_rows].unflatten(1, (-1, head_dim)),
                        y.new_empty(y.shape[0], 0, head_dim), cos, sin)
    return y, x
