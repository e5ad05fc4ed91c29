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
from .cpu_lib import Layer, Linear, StackLayer, StepRope, StepView

def _ptr(t: Optional[torch.Tensor]) -> Optional[int]:
    if t is None:
        return None
    if t.dtype != torch.float32 or t.device.type != "cpu" or not t.is_contiguous():
        raise ValueError("a fused layer's float tensors must be contiguous float32 on the CPU")
    return t.data_ptr()


def _linear(module) -> Optional[Linear]:
    """A projection's block parts bound for the library, None if it has a float part."""
    blocks = module.blocks
    if blocks is None or any(kind is None for kind in blocks.part_types):
        return None
    bound = blocks.bound()
    return Linear(ctypes.addressof(bound.parts), len(bound.parts), _ptr(module.bias))


class CpuDecoderLayer:
    """One decoder layer bound for ``pq_decoder_layer``; ``bind`` says None where it cannot."""

    def __init__(self, desc: Layer):
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
        desc = Layer(
            attn.qkv_proj.in_features, attn.num_heads, attn.num_kv_heads, attn.head_dim,
            mlp.down_proj.in_shard.size, layer.input_layernorm.eps, attn.scale,
            attn.softcap or 0.0, cpu_ops.ACTIVATIONS[mlp.hidden_act],
            _ptr(layer.input_layernorm.weight), _ptr(qn.weight if qn else None),
            _ptr(kn.weight if kn else None), _ptr(post_attn.weight if post_attn else None),
            _ptr(ff.weight), _ptr(post_ff.weight if post_ff else None), *linears)
        return cls(desc)


class CpuDecoderStack:
    """Every decoder layer of a model in one ``pq_decoder_stack`` call per decode step.

    A call per layer cost ~40 us of Python around each (the tensors, their pointers, the
    call), ~0.7 ms of an 18 ms step on the embedded model. Here the per-layer part is
    bound once: each layer's description, its KV cache and which of the step's views
    (KV cache group, window) and rope tables it reads; a step fills a few views."""

    def __init__(self, layers: list[CpuDecoderLayer], views: list[tuple[int, Optional[int]]],
                 ropes: list[str]):
        self.layers = layers  # their descriptions must outlive the bound array
        self.view_keys = sorted(set(views), key=repr)  # (group, window) per distinct view
        self.rope_keys = sorted(set(ropes))
        self.stack = (StackLayer * len(layers))()
        for i, layer in enumerate(layers):
            self.stack[i] = StackLayer(ctypes.addressof(layer.desc), None, None,
                                        self.view_keys.index(views[i]),
                                        self.rope_keys.index(ropes[i]))
        self.views = (StepView * len(self.view_keys))()
        self.ropes = (StepRope * len(self.rope_keys))()
        self.head_dim = layers[0].desc.head_dim
        self._caches: Optional[list] = None

    def _bind_caches(self, kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        for i, (k, v) in enumerate(kv_caches):
            self.stack[i].k_cache, self.stack[i].v_cache = k.data_ptr(), v.data_ptr()
        self._caches = kv_caches

    def __call__(self, x: torch.Tensor, metas, rope: dict[str, tuple[torch.Tensor, torch.Tensor]],
                 kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        """One-token decode rows x [M, hidden] (the embedded tokens) -> the last layer's
        output plus its residual. ``metas``: the step's metadata per KV cache group."""
        m, hidden = x.shape
        if kv_caches is not self._caches:  # the runner's list, built once with its pools
            self._bind_caches(kv_caches)
        for j, (group, window) in enumerate(self.view_keys):
            meta = metas[group]
            view = meta.groups[0].views[window]
            self.views[j] = StepView(meta.slot_mapping.data_ptr(), view.gather.data_ptr(),
                                      view.lengths.data_ptr(), view.gather.shape[1])
        for j, kind in enumerate(self.rope_keys):
            cos, sin = rope[kind]
            self.ropes[j] = StepRope(cos.data_ptr(), sin.data_ptr(),
                                      cos.stride(0) if m > 1 else self.head_dim // 2)
        out = torch.empty(m, hidden, dtype=torch.float32)
        rc = cpu_quant._lib().pq_decoder_stack(self.stack, len(self.layers), self.views, self.ropes,
                                               x.data_ptr(), m, out.data_ptr(), 0)
        if rc != 0:
            raise RuntimeError(f"pq_decoder_stack failed (code {rc})")
        return out
