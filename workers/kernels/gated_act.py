"""Gated activation: ``act(gate) * up`` over a fused ``[gate | up]`` projection.

Reference: ``layers.activation.act_and_mul`` (torch rounds after the activation
and again after the product; this computes in float32 and rounds once). SiLU
for Llama/Qwen/Mistral, the tanh GELU for Gemma, the erf GELU for the rest.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pocketllm.errors import UnsupportedFeatureError

from ..models.config import ACTIVATION_KINDS

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
def _act_mul_kernel(GateUp, Out, inter, stride_in, stride_out,
                    ACT: tl.constexpr, BLOCK: tl.constexpr):
    token = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < inter
    row = GateUp + token.to(tl.int64) * stride_in
    gate = tl.load(row + cols, mask=ok, other=0.0).to(tl.float32)
    up = tl.load(row + inter + cols, mask=ok, other=0.0).to(tl.float32)
    tl.store(Out + token.to(tl.int64) * stride_out + cols,
             (activate(gate, ACT) * up).to(Out.dtype.element_ty), mask=ok)


def act_and_mul(gate_up: torch.Tensor, hidden_act: str = "silu") -> torch.Tensor:
    """gate_up [T, 2I] -> act(gate) * up [T, I]; ``hidden_act`` is the HF config name."""
    act = KERNEL_ACTIVATIONS.get(hidden_act)
    if act is None:
        raise UnsupportedFeatureError(f"activation {hidden_act!r} has no Triton kernel")
    if gate_up.stride(-1) != 1:
        gate_up = gate_up.contiguous()
    tokens, width = gate_up.shape
    inter = width // 2
    out = torch.empty(tokens, inter, device=gate_up.device, dtype=gate_up.dtype)
    if tokens == 0:
        return out
    block = min(1024, triton.next_power_of_2(inter))
    _act_mul_kernel[(tokens, triton.cdiv(inter, block))](
        gate_up, out, inter, gate_up.stride(0), out.stride(0), ACT=act, BLOCK=block,
        num_warps=4 if block >= 512 else 1)
    return out


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
