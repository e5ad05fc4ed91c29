"""Gated activation: ``act(gate) * up`` over a fused ``[gate | up]`` projection.

Reference: ``layers.activation.act_and_mul`` (torch rounds after the activation
and again after the product; this computes in float32 and rounds once). SiLU
for Llama/Qwen/Mistral, the tanh GELU for Gemma, the erf GELU for the rest.

``act_and_mul_int8``: the same launch writes the product as the int8 blocks of 32 that a
GGUF layer's integer dots read (``int8_blocks.py``), in place of the product itself: the
activation and the rounding as one launch before the down projection.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pocketllm.errors import UnsupportedFeatureError

from ..models.config import ACTIVATION_KINDS
from .int8_blocks import store_int8_blocks

# HF ``hidden_act`` name -> the kernel's activation (every name the torch path knows).
KERNEL_ACTIVATIONS = ACTIVATION_KINDS


@triton.jit
def activate(gate, ACT: tl.constexpr):
    """``ACT`` (a KERNEL_ACTIVATIONS value) of float32 ``gate``; also used by ``gemv``."""
    if ACT == "silu":
        return gate / (1.0 + tl.exp(-gate))
    elif ACT == "gelu_tanh":
        inner = 0.7978845608028654 * (gate + 0.044715 * gate * gate * gate)
        inner = tl.minimum(tl.maximum(inner, -15.0), 15.0)  # tanh is +-1 there; exp stays finite
        return 0.5 * gate * (2.0 - 2.0 / (tl.exp(2.0 * inner) + 1.0))  # 1 + tanh(inner)
    else:
        return 0.5 * gate * (1.0 + tl.erf(gate * 0.7071067811865476))


@triton.jit
def _act_mul_kernel(GateUp, Out, Q, QD, QS, inter, stride_in, stride_out,
                    ACT: tl.constexpr, BLOCK: tl.constexpr, QUANTIZE: tl.constexpr):
    token = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < inter
    row = GateUp + token.to(tl.int64) * stride_in
    gate = tl.load(row + cols, mask=ok, other=0.0).to(tl.float32)
    up = tl.load(row + inter + cols, mask=ok, other=0.0).to(tl.float32)
    h = (activate(gate, ACT) * up).to(GateUp.dtype.element_ty)  # Out's dtype is gate_up's
    if QUANTIZE:  # whole blocks of 32 (inter and BLOCK multiples of 32): int8 in place of h
        store_int8_blocks(tl.reshape(h.to(tl.float32), [BLOCK // 32, 32]),
                          tl.program_id(1) * (BLOCK // 32) + tl.arange(0, BLOCK // 32), token,
                          inter, Q, QD, QS, BLOCK // 32)
    else:
        tl.store(Out + token.to(tl.int64) * stride_out + cols, h, mask=ok)


def _check(gate_up: torch.Tensor, hidden_act: str) -> tuple[str, torch.Tensor]:
    act = KERNEL_ACTIVATIONS.get(hidden_act)
    if act is None:
        raise UnsupportedFeatureError(f"activation {hidden_act!r} has no Triton kernel")
    return act, gate_up if gate_up.stride(-1) == 1 else gate_up.contiguous()


def _block(inter: int) -> int:
    return min(1024, triton.next_power_of_2(inter))


def act_and_mul(gate_up: torch.Tensor, hidden_act: str = "silu") -> torch.Tensor:
    """gate_up [T, 2I] -> act(gate) * up [T, I]; ``hidden_act`` is the HF config name."""
    act, gate_up = _check(gate_up, hidden_act)
    tokens, width = gate_up.shape
    inter = width // 2
    out = torch.empty(tokens, inter, device=gate_up.device, dtype=gate_up.dtype)
    if tokens == 0:
        return out
    block = _block(inter)
    _act_mul_kernel[(tokens, triton.cdiv(inter, block))](
        gate_up, out, out, out, out, inter, gate_up.stride(0), out.stride(0), ACT=act,
        BLOCK=block, QUANTIZE=False, num_warps=4 if block >= 512 else 1)
    return out


def act_and_mul_int8(gate_up: torch.Tensor, hidden_act: str = "silu"
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``gguf_dot.quantize_rows(act_and_mul(gate_up, hidden_act))``, the same bits, in one
    launch: act(gate) * up is rounded to the model dtype and then to int8 blocks of 32
    (``int8_blocks.py``), never written. I (half of gate_up's width) a multiple of 32."""
    act, gate_up = _check(gate_up, hidden_act)
    tokens, width = gate_up.shape
    inter = width // 2
    if width % 64:
        raise ValueError(f"act_and_mul_int8 takes [T, 2I] rows, I a multiple of 32, got "
                         f"{tuple(gate_up.shape)}")
    q = torch.empty(tokens, inter, dtype=torch.int8, device=gate_up.device)
    d = torch.empty(tokens, inter // 32, dtype=torch.float32, device=gate_up.device)
    s = torch.empty_like(d)
    if tokens:
        block = _block(inter)
        _act_mul_kernel[(tokens, triton.cdiv(inter, block))](
            gate_up, q, q, d, s, inter, gate_up.stride(0), 0, ACT=act, BLOCK=block,
            QUANTIZE=True, num_warps=4 if block >= 512 else 1)
    return q, d, s


@triton.jit
def _sigmoid_gate_kernel(X, Gate, stride_xt, stride_xh, stride_gt, stride_gh,
                         D: tl.constexpr, BLOCK: tl.constexpr):
    token, head = tl.program_id(0).to(tl.int64), tl.program_id(1)
    d = tl.arange(0, BLOCK)
    ok = d < D
    g = tl.load(Gate + token * stride_gt + head * stride_gh + d, mask=ok, other=0.0)
    # torch's roundings: the sigmoid in the model dtype, then the product
    s = (1.0 / (1.0 + tl.exp(-g.to(tl.float32)))).to(X.dtype.element_ty).to(tl.float32)
    at = X + token * stride_xt + head * stride_xh + d
    x = tl.load(at, mask=ok, other=0.0).to(tl.float32)
    tl.store(at, (x * s).to(X.dtype.element_ty), mask=ok)


def sigmoid_gate_(x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """``x *= sigmoid(gate)`` in place, one launch: x and gate [T, H, D] (any token and head
    strides, unit stride along D: gated attention's gates sit beside the queries in
    q_proj's row). Returns x."""
    if x.shape != gate.shape or x.stride(-1) != 1 or gate.stride(-1) != 1:
        raise ValueError("sigmoid_gate_ needs equal [T, H, D] shapes with unit stride along D")
    tokens, heads, dim = x.shape
    if tokens:
        block = triton.next_power_of_2(dim)
        _sigmoid_gate_kernel[(tokens, heads)](
            x, gate, x.stride(0), x.stride(1), gate.stride(0), gate.stride(1), dim, block,
            num_warps=2 if block >= 256 else 1)
    return x
