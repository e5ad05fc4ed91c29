"""A CPU decode step's decoder layers, each in one library call (``cpu_quant/layer.c``).

The module path makes ~15 Python-level calls per layer (norms, products, rotary, the
cache write, attention, activation), each 10-30 us once the weight stream has evicted
the interpreter's code and data: a third of the embedded model's decode step. Here each
layer is bound once to a C description (its block parts, norm weights, shape) and a
decode step calls ``pq_decoder_layer`` per layer; the C side runs the same operations
in the same order, so the tokens and logits are those of the module path, bit for bit
(``tests/test_cpu_layer.py``).

A model takes this path where every layer binds: CPU, float32, one rank, every
projection kept as GGUF blocks (no float part), and a family that declares its MLP's
norms (``DecoderLayer.mlp_norms``). A step takes it when it holds only one-token
decodes, fewer than the policy's ``block_float_rows`` (``KernelPolicy.fused_decode``).
"""

from __future__ import annotations

import ctypes
from typing import Optional

import torch

from . import cpu_ops, cpu_quant

_p, _i64, _f32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float


class _Linear(ctypes.Structure):
    _fields_ = [("parts", _p), ("nparts", _i64), ("bias", _p)]


class _Layer(ctypes.Structure):
    _fields_ = ([(name, _i64) for name in ("hidden", "heads", "kv_heads", "head_dim", "inter")]
                + [(name, _f32) for name in ("eps", "scale", "softcap")] + [("act", _i64)]
                + [(name, _p) for name in ("attn_norm", "q_norm", "k_norm", "post_attn_norm",
                                           "ff_norm", "post_ff_norm")]
                + [(name, _Linear) for name in ("qkv", "o", "gate_up", "down")])


def _ptr(t: Optional[torch.Tensor]) -> Optional[int]:
    if t is None:
        return None
    if t.dtype != torch.float32 or t.device.type != "cpu" or not t.is_contiguous():
        raise ValueError("a fused layer's float tensors must be contiguous float32 on the CPU")
    return t.data_ptr()


def _linear(module) -> Optional[_Linear]:
    """A projection's block parts bound for the library, None if it has a float part."""
    blocks = module.blocks
    if blocks is None or any(kind is None for kind in blocks.part_types):
        return None
    bound = blocks.bound()
    return _Linear(ctypes.addressof(bound.parts), len(bound.parts), _ptr(module.bias))


class CpuDecoderLayer:
    """One decoder layer bound for ``pq_decoder_layer``; ``bind`` says None where it cannot."""

    def __init__(self, desc: _Layer):
        # desc points into the layer's own tensors and bound parts, which outlive it (the
        # model binds again after loading new weights)
        self.desc = desc

    @classmethod
    def bind(cls, layer) -> Optional["CpuDecoderLayer"]:
        attn, mlp = layer.self_attn, layer.mlp
        norms = layer.mlp_norms()
        if norms is None:  # a family with no fused form (an MoE layer has no gate_up_proj)
            return None
        linears = [_linear(m) for m in (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)]
        if (norms is None or None in linears or mlp.hidden_act not in cpu_ops.ACTIVATIONS
                or attn.o_proj.tp.world != 1):
            return None
        post_attn, ff, post_ff = norms
        qn, kn = attn.q_norm, attn.k_norm
        desc = _Layer(
            attn.qkv_proj.in_features, attn.num_heads, attn.num_kv_heads, attn.head_dim,
            mlp.down_proj.in_shard.size, layer.input_layernorm.eps, attn.scale,
            attn.softcap or 0.0, cpu_ops.ACTIVATIONS[mlp.hidden_act],
            _ptr(layer.input_layernorm.weight), _ptr(qn.weight if qn else None),
            _ptr(kn.weight if kn else None), _ptr(post_attn.weight if post_attn else None),
            _ptr(ff.weight), _ptr(post_ff.weight if post_ff else None), *linears)
        return cls(desc)

    def __call__(self, x: torch.Tensor, residual: Optional[torch.Tensor],
                 rope: tuple[torch.Tensor, torch.Tensor], kv_cache: tuple[torch.Tensor, torch.Tensor],
                 slots: torch.Tensor, view) -> tuple[torch.Tensor, torch.Tensor]:
        """One-token decode rows x [M, hidden] (+ residual) -> (output, new residual)."""
        m, hidden = x.shape
        cos, sin = rope
        k_cache, v_cache = kv_cache
        x_out = torch.empty(m, hidden, dtype=torch.float32)
        res_out = torch.empty(m, hidden, dtype=torch.float32)
        rc = cpu_quant._lib().pq_decoder_layer(
            ctypes.byref(self.desc), x.data_ptr(), None if residual is None else residual.data_ptr(),
            m, cos.data_ptr(), sin.data_ptr(), cos.stride(0) if m > 1 else self.desc.head_dim // 2,
            k_cache.data_ptr(), v_cache.data_ptr(), slots.data_ptr(), view.gather.data_ptr(),
            view.gather.shape[1], view.lengths.data_ptr(), x_out.data_ptr(), res_out.data_ptr(), 0)
        if rc != 0:
            raise RuntimeError(f"pq_decoder_layer failed (code {rc})")
        return x_out, res_out
