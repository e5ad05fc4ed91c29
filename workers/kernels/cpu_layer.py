"""A CPU decode step's decoder layers, each in one library call (``cpu_quant/layer.c``).

The module path makes ~15 Python-level calls per layer (norms, products, rotary, the
cache write, attention, activation), each 10-30 us once the weight stream has evicted
the interpreter's code and data: a third of the embedded model's decode step. Here each
layer is bound once to a C description (its block parts, norm weights, shape) and a
decode step calls ``pq_decoder_layer`` per layer; the C side runs the same operations
in the same order, so the tokens and logits are those of the module path, bit for bit
(``tests/test_cpu_layer.py``). Routed experts (Qwen3-MoE kept in blocks) run in the same
call: the router, its softmax top-k and each (token, expert) pair's products
(``pq_linear_rows``), equal to the module path's to float rounding
(``tests/test_qwen3_moe_gguf.py``).

A model takes this path where every layer binds: CPU, float32, one rank, every
projection kept as GGUF blocks (no float part), and a family that declares its MLP's
norms (``DecoderLayer.mlp_norms``). A step takes it when it holds only one-token
decodes (``KernelPolicy.fused_decode``).
"""

from __future__ import annotations

import ctypes
from typing import Optional

import torch

from ..layers.moe import FusedMoE, SoftmaxTopK
from . import cpu_ops, cpu_quant
from .cpu_lib import Experts, Layer, Linear, Part, StackLayer, StepRope, StepView

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


def _experts(moe) -> Optional[tuple[Experts, tuple]]:
    """Routed experts kept in blocks, bound for the library (with the part arrays its
    description points into), or None where the library's experts cannot compute them:
    softmax top-k routing only, no biases, one rank, every part a block type."""
    blocks = moe.blocks
    if (blocks is None or not blocks.all_blocks or not isinstance(moe.routing, SoftmaxTopK)
            or moe.b13 is not None or moe.gate_bias is not None or moe.tp.world != 1
            or not isinstance(moe.act, str) or moe.gate.dtype != torch.float32):
        return None
    count = moe.spec.num_experts
    gate_up = (Part * (2 * count))(*[p for w in blocks.gate_up for p in w.bound().parts])
    down = (Part * count)(*[w.bound().parts[0] for w in blocks.down])
    desc = Experts(count, moe.spec.top_k, int(moe.routing.renormalize), _ptr(moe.gate),
                   ctypes.addressof(gate_up), ctypes.addressof(down))
    return desc, (gate_up, down)


class CpuDecoderLayer:
    """One decoder layer bound for ``pq_decoder_layer``; ``bind`` says None where it cannot."""

    def __init__(self, desc: Layer, keep: tuple = ()):
        # desc points into the layer's own tensors and bound parts (and ``keep``'s arrays),
        # which outlive it (the model binds again after loading new weights)
        self.desc, self.keep = desc, keep

    @classmethod
    def bind(cls, layer) -> Optional["CpuDecoderLayer"]:
        attn, mlp = layer.self_attn, layer.mlp
        norms = layer.mlp_norms()
        if norms is None or attn.o_proj.tp.world != 1 or attn.sinks is not None:
            return None  # a family with no fused form (DeepSeek's, gpt-oss's attention)
        experts, keep = Experts(), ()
        if isinstance(mlp, FusedMoE):  # routed experts: no dense gate/up and down
            bound = _experts(mlp)
            if bound is None:
                return None
            experts, keep = bound
            act, inter, mlp_linears = mlp.act, mlp.inter.size, [Linear(), Linear()]
        else:
            act, inter = mlp.hidden_act, mlp.down_proj.in_shard.size
            mlp_linears = [_linear(mlp.gate_up_proj), _linear(mlp.down_proj)]
        linears = [_linear(attn.qkv_proj), _linear(attn.o_proj), *mlp_linears]
        if None in linears or act not in cpu_ops.ACTIVATIONS:
            return None
        post_attn, ff, post_ff = norms
        qn, kn = attn.q_norm, attn.k_norm
        desc = Layer(
            attn.qkv_proj.in_features, attn.num_heads, attn.num_kv_heads, attn.head_dim,
            inter, layer.input_layernorm.eps, attn.scale,
            attn.softcap or 0.0, cpu_ops.ACTIVATIONS[act],
            _ptr(layer.input_layernorm.weight), _ptr(qn.weight if qn else None),
            _ptr(kn.weight if kn else None), _ptr(post_attn.weight if post_attn else None),
            _ptr(ff.weight), _ptr(post_ff.weight if post_ff else None), *linears, experts)
        return cls(desc, keep)


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
