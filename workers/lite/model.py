"""A dense decoder over a GGUF file's blocks, computed by the C library: no torch.

A step of fewer than ``stack_rows`` rows, prefill or decode, goes through
``pq_decoder_stack`` in one call: a row attends to the cache slots of its own gather row
(its sequence's positions up to its own, cut to its layer's window), so a prompt's rows
see each other once the layer has written their keys. A longer step takes the same
products with attention as matrix products per sequence (``prefill.py``). Qwen3-MoE's
routed experts run in both (``experts.py``).

The weights are the file's own bytes, mapped (q/k rows of a llama.cpp-permuted file are
unpermuted into a copy; ``loader/gguf.py``), or random blocks of a config's shape
(``--load-format dummy --quantization``: ``dummy.py``); the norm weights are float32
copies. This is the one CPU worker for GGUF blocks: a model it cannot run is refused with
``UnsupportedFeatureError`` before its weights are bound, and the torch worker serves
it with the blocks dequantized (docs/cpu_kernels.md, "The torch-free worker").
"""

from __future__ import annotations

import ctypes
import math
import os
import sys
from dataclasses import dataclass, field
from typing import Optional, Sequence

import numpy as np

from pocketllm.errors import CheckpointError, UnsupportedFeatureError
from pocketllm.model_info import ModelInfo

from ..kernels import cpu_lib
from ..kernels.cpu_lib import Layer, Linear, Part, StackLayer, StepRope, StepView
from ..loader.block_tensor import BlockTensor
from ..loader.gguf import load_gguf_weights
from ..loader.gguf_hybrid import value_heads_tiled
from ..loader.gguf_quants import GGML_TYPES, type_name
from ..models.config import ACTIVATION_KINDS, MoeArchConfig, arch_config
from .experts import RoutedExperts, experts_refusal
from .prefill import FloatLayers
from .resident import ResidentCopies

# The norms each family applies around its MLP (post-attention, pre-MLP, post-MLP), by
# HF name under ``model.layers.N.``.
MLP_NORMS = {
    "llama": (None, "post_attention_layernorm", None),
    "qwen2": (None, "post_attention_layernorm", None),
    "qwen3": (None, "post_attention_layernorm", None),
    "qwen3_moe": (None, "post_attention_layernorm", None),  # routed experts: experts.py
    "gemma3": ("post_attention_layernorm", "pre_feedforward_layernorm",
               "post_feedforward_layernorm"),
    # hybrid: Gated DeltaNet layers (gdn.c) between gated full-attention layers
    "qwen3_5": (None, "post_attention_layernorm", None),
    "qwen3_5_moe": (None, "post_attention_layernorm", None),  # and a shared expert
    "qwen3_next": (None, "post_attention_layernorm", None),  # as Qwen3.5-MoE's
}
# The linear-attention in projections the mixer reads: Qwen3.5's b and a rows apart, or
# Qwen3-Next's interleaved per key head (``_gdn`` regroups them)
GDN_LAYOUTS = ("qkv_z_b_a", "qkv_z_ba")
ROPE_TYPES = ("default", "linear", "llama3")
# From this many rows a step attends by matrix products per sequence (prefill.py) rather
# than through a gather row per row (the decode stack): about even at 256 rows on the
# embedded model, the matrix products 10% ahead at 502 (docs/cpu_kernels.md). With routed
# experts the stack multiplies each (token, expert) pair on its own, where prefill.py reads
# each expert once for its run of tokens, so an MoE model leaves the stack sooner (a
# choice not yet measured on a real MoE shape).
STACK_ROWS, STACK_ROWS_MOE = 256, 16


def refusal(info: ModelInfo, dummy: bool = False) -> Optional[str]:
    """Why this model cannot run here (None: it can), from the config alone; ``dummy``:
    with random block weights rather than the checkpoint's."""
    if info.format != "gguf" and not dummy:
        return "not a GGUF checkpoint"
    if info.family not in MLP_NORMS:
        return f"the {info.family} family has no torch-free forward"
    if not cpu_lib.available():
        return cpu_lib.unavailable_reason()
    cfg = arch_config(info)
    if cfg.hidden_act not in ACTIVATION_KINDS:
        return f"activation {cfg.hidden_act!r}"
    kinds = {p.get("rope_type", "default") for p in cfg.rope.values()}
    if not kinds <= set(ROPE_TYPES) or rotary_dim(cfg) is None:
        factors = sorted({p.get("partial_rotary_factor", 1.0) for p in cfg.rope.values()})
        return f"rope {sorted(kinds)} turning {factors} of each head"
    if cfg.attn_sinks:
        return "attention sinks"
    if any(getattr(cfg, "linear_layers", ())):
        if cfg.gdn.in_proj_layout not in GDN_LAYOUTS:
            return f"linear-attention projections laid out as {cfg.gdn.in_proj_layout}"
        if dummy:
            return "random weights for linear-attention layers"
    if _sparse(cfg):
        return experts_refusal(info.family, cfg)
    return None


def rotary_dim(cfg) -> Optional[int]:
    """The leading dims of a head that the rotary turns (Qwen3.5: a quarter): one even
    width for every rope kind of the model, else None (the library cannot)."""
    widths = {int(cfg.head_dim * float(p.get("partial_rotary_factor", 1.0)))
              for p in cfg.rope.values()}
    return widths.pop() if len(widths) == 1 and next(iter(widths)) % 2 == 0 else None


def _sparse(cfg) -> list[bool]:
    """Per layer: whether it routes to experts (an MoE config's sparse layers)."""
    if isinstance(cfg, MoeArchConfig) and cfg.moe is not None:
        return list(cfg.sparse_layers)
    return []


def worker_refusal(info: ModelInfo, args, world: int) -> Optional[str]:
    """Why the torch-free worker cannot serve this engine (None: it can): a CPU, float32,
    one rank, the checkpoint's own weights or dummy ones in block types
    (``quantization``), and a model ``refusal`` lets through.
    ``POCKETLLM_TORCH_WORKER=1`` keeps the torch worker, to compare."""
    if os.environ.get("POCKETLLM_TORCH_WORKER") == "1":
        return "POCKETLLM_TORCH_WORKER=1"
    if world != 1:
        return "tensor parallelism"
    if args.device == "cuda" or (args.device == "auto" and _has_nvidia_gpu()):
        return "a GPU"  # whether torch can use it is torch's to say
    if args.dtype not in ("auto", "float32"):
        return f"dtype {args.dtype}"
    if args.quantization == "fp8":
        return "FP8 weights"  # the torch worker says why they cannot run here
    if args.load_format == "dummy" and args.quantization is None:
        return "dummy float weights (no quantization)"
    if args.kv_cache_dtype != "auto":
        return f"kv_cache_dtype {args.kv_cache_dtype}"  # the torch worker says why not here
    if args.speculative_method in ("draft", "mtp"):
        return "a drafting model (the torch worker runs a draft model or MTP layer)"
    if args.dequantize_weights or args.batch_invariant:
        return "dequantize_weights or batch_invariant"
    return refusal(info, dummy=args.load_format == "dummy")


def _has_nvidia_gpu() -> bool:
    return any(os.path.exists(f"/dev/nvidia{i}") for i in range(16)) or os.path.exists(
        "/dev/nvidiactl")


def rope_inv_freq(head_dim: int, params: dict) -> np.ndarray:
    """float32 inverse frequencies of one rope kind, as ``layers/rotary.rope_inv_freq``
    computes them for the default, linear and llama3 kinds (``refusal`` keeps out the rest)."""
    base = float(params["rope_theta"])
    inv = (1.0 / (base ** (np.arange(0, head_dim, 2).astype(np.float32) / head_dim))
           ).astype(np.float32)
    kind = params.get("rope_type", "default")
    if kind == "linear":
        return (inv / float(params["factor"])).astype(np.float32)
    if kind == "llama3":
        factor, low, high = (float(params[k]) for k in ("factor", "low_freq_factor",
                                                         "high_freq_factor"))
        original = int(params["original_max_position_embeddings"])
        wavelen = 2 * math.pi / inv
        scaled = np.where(wavelen > original / low, inv / factor, inv)
        smooth = (original / wavelen - low) / (high - low)
        middle = (wavelen >= original / high) & (wavelen <= original / low)
        inv = np.where(middle, (1 - smooth) * scaled / factor + smooth * scaled, scaled)
    return inv.astype(np.float32)


@dataclass
class StepViews:
    """One (KV cache group, window) view of a step. For ``pq_decoder_stack``: ``slots`` [M]
    the slot each row's new key goes to, ``gather`` [M, Lk] the slots each row attends to,
    the first ``lengths[m]`` of its row valid (int64, contiguous). For the float path
    (``prefill.py``): ``seqs``, per sequence (first row, end row, its key slots, their
    positions), ``positions`` [M] and the ``window`` (None: full). A state group's view
    holds its rows' ``slots`` and, per row, the slot its states are snapshotted into
    after it (``snapshots``, -1: none)."""

    slots: np.ndarray
    gather: np.ndarray
    lengths: np.ndarray
    seqs: list = field(default_factory=list)
    positions: Optional[np.ndarray] = None
    window: Optional[int] = None
    snapshots: Optional[np.ndarray] = None


def step_view(seqs, window: Optional[int], block_size: int, pad_slot: int, num_rows: int
              ) -> StepViews:
    """A view of a step's ``seqs`` (``step_rows.ScheduledSeq``: rows, first position, block
    table) in one group's pool: each row attends to its sequence's positions up to its
    own, the last ``window`` of them (None: all)."""
    bs = block_size
    slots = np.empty(num_rows, dtype=np.int64)
    lengths = np.empty(num_rows, dtype=np.int64)
    positions = np.empty(num_rows, dtype=np.int64)
    per_seq, gathers = [], []
    for s in seqs:
        table = np.asarray(s.block_ids, dtype=np.int64)
        pos = s.start + np.arange(s.num_tokens)
        lo = np.maximum(0, pos + 1 - window) if window else np.zeros_like(pos)
        rows = slice(s.row, s.row + s.num_tokens)
        slots[rows] = table[pos // bs] * bs + pos % bs
        lengths[rows] = pos + 1 - lo
        positions[rows] = pos
        keys = lo[:, None] + np.arange(int(lengths[rows].max()))[None, :]
        valid = keys <= pos[:, None]
        keys = np.where(valid, keys, 0)
        gathers.append((rows, np.where(valid, table[keys // bs] * bs + keys % bs, pad_slot)))
        key_pos = np.arange(int(lo[0]), int(pos[-1]) + 1)
        per_seq.append((rows.start, rows.stop, table[key_pos // bs] * bs + key_pos % bs, key_pos))
    gather = np.full((num_rows, max(g.shape[1] for _, g in gathers)), pad_slot, dtype=np.int64)
    for rows, g in gathers:
        gather[rows, :g.shape[1]] = g
    return StepViews(slots, gather, lengths, per_seq, positions, window)


class _Weights(dict):
    """A file's tensors by HF name; a name the forward needs and the file lacks is a
    ``CheckpointError`` that says which."""

    def __missing__(self, name: str):
        raise CheckpointError(f"the GGUF file has no tensor for {name} (HF name)")


class _Bound:
    """A projection's parts bound for the library (kept alive with their arrays)."""

    def __init__(self, k: int, tensors: Sequence[BlockTensor], bias: Optional[np.ndarray],
                 name: str):
        self.arrays = []
        self.parts = (Part * len(tensors))()
        col = 0
        for j, t in enumerate(tensors):
            if not isinstance(t, BlockTensor) or t.ggml_type not in cpu_lib.QUANT_KERNEL_TYPES:
                kind = t.type_name if isinstance(t, BlockTensor) else "a float type"
                raise UnsupportedFeatureError(f"{name}: {kind} has no CPU block kernel")
            _, elems, nbytes = GGML_TYPES[t.ggml_type]
            blocks = np.ascontiguousarray(t.blocks)
            if t.shape[-1] != k or blocks.shape[1] != k // elems * nbytes:
                raise CheckpointError(f"{name}: part {j} of shape {t.shape} for {k} inputs")
            self.arrays.append(blocks)
            self.parts[j] = Part(t.ggml_type, blocks.shape[0], blocks.shape[1], col,
                                 blocks.ctypes.data)
            col += blocks.shape[0]
        self.width = col
        self.bias = None if bias is None else np.ascontiguousarray(bias, dtype=np.float32)
        self.linear = Linear(ctypes.addressof(self.parts), len(tensors),
                             None if self.bias is None else self.bias.ctypes.data)


def _ptr(a: Optional[np.ndarray]) -> Optional[int]:
    return None if a is None else a.ctypes.data


class LiteModel:
    """The checkpoint's decoder, embedding and LM head, bound for the library."""

    def __init__(self, info: ModelInfo, quantization: Optional[str] = None, seed: int = 0):
        """``quantization``: random weights in these block types (``--load-format dummy``,
        drawn from ``seed``) instead of the checkpoint's."""
        why = refusal(info, dummy=quantization is not None)
        if why is not None:
            raise UnsupportedFeatureError(f"the torch-free CPU worker cannot run this model: {why}")
        self.cfg = cfg = arch_config(info)
        self.lib = cpu_lib.lib()
        self.stack_rows = STACK_ROWS_MOE if any(_sparse(cfg)) else STACK_ROWS
        if quantization is None:
            w = _Weights(load_gguf_weights(info.path, info, as_stored=True))
        else:
            from .dummy import dummy_weights

            w = dummy_weights(cfg, info.family, quantization, seed)

        def norm(name: str) -> np.ndarray:
            return (np.asarray(w[name], dtype=np.float32) + np.float32(cfg.norm_weight_offset))

        def linear(names: Sequence[str], k: int) -> _Bound:
            biases = [w.get(n + ".bias") for n in names]
            bias = None if all(b is None for b in biases) else np.concatenate(
                [np.asarray(b, dtype=np.float32) for b in biases])
            return _Bound(k, [w[n + ".weight"] for n in names], bias, names[0])

        E, D = cfg.hidden_size, cfg.head_dim
        self.norms, self.bound, self.descs = [], [], []
        self.experts: list[Optional[RoutedExperts]] = []  # per layer (None: a dense MLP)
        self.gdn: list[Optional[tuple]] = []  # per layer: a linear-attention mixer's description and arrays
        self.mlp_norm_names = post_attn, ff, post_ff = MLP_NORMS[info.family]
        act = cpu_lib.ACT_IDS[ACTIVATION_KINDS[cfg.hidden_act]]
        sparse, linear_layers = _sparse(cfg), list(getattr(cfg, "linear_layers", ()))
        self.hybrid = any(linear_layers)
        q_gate = int(self.hybrid)  # Qwen3.5's full attention gates its output
        for i in range(cfg.num_layers):
            p = f"model.layers.{i}."
            a = p + "self_attn."
            n = {key: norm(p + key + ".weight") if key else None
                 for key in ("input_layernorm", post_attn, ff, post_ff)}
            if linear_layers and linear_layers[i]:
                gdn, bound = self._gdn(w, p + "linear_attn.", linear, info.hf_config)
                qn = kn = None
                qkv, o = Linear(), Linear()
            else:
                gdn = None
                qn = norm(a + "q_norm.weight") if cfg.qk_norm else None
                kn = norm(a + "k_norm.weight") if cfg.qk_norm else None
                bound = (linear([a + "q_proj", a + "k_proj", a + "v_proj"], E),
                         linear([a + "o_proj"], cfg.num_heads * D))
                qkv, o = (b.linear for b in bound)
            if sparse and sparse[i]:  # routed experts in place of the MLP (no gate/up, down)
                experts = self._experts(w, p + "mlp.", linear)
                mlp, inter, mlp_act = (Linear(), Linear()), experts.inter, experts.act
            else:
                experts, inter, mlp_act = None, cfg.intermediate_size, act
                gate_up = linear([p + "mlp.gate_proj", p + "mlp.up_proj"], E)
                down = linear([p + "mlp.down_proj"], cfg.intermediate_size)
                mlp = (gate_up.linear, down.linear)
                bound += (gate_up, down)
            self.bound.append(bound)
            self.norms.append((n, qn, kn))
            self.experts.append(experts)
            self.gdn.append(gdn)
            self.descs.append(Layer(
                E, cfg.num_heads, cfg.num_kv_heads, D, inter, cfg.rms_norm_eps,
                cfg.attn_scale, cfg.attn_softcap or 0.0, mlp_act, _ptr(n["input_layernorm"]),
                _ptr(qn), _ptr(kn), _ptr(n[post_attn] if post_attn else None), _ptr(n[ff]),
                _ptr(n[post_ff] if post_ff else None), qkv, o, *mlp,
                experts.desc if experts is not None else cpu_lib.Experts(), q_gate,
                rotary_dim(cfg), None if gdn is None else ctypes.addressof(gdn[0])))
        embed = w["model.embed_tokens.weight"]
        if not isinstance(embed, BlockTensor) or embed.ggml_type not in cpu_lib.QUANT_KERNEL_TYPES:
            raise UnsupportedFeatureError("the embedding table is not a block type with a kernel")
        self.embed = embed
        self.embed_blocks = np.ascontiguousarray(embed.blocks)
        # The scale is rounded to float32 first, as the torch embedding rounds it.
        self.embed_scale = None if cfg.embed_scale is None else np.float32(cfg.embed_scale)
        self.final_norm = norm("model.norm.weight")
        head = w.get("lm_head.weight", embed) if not cfg.tie_word_embeddings else embed
        self.head = _Bound(E, [head], None, "lm_head")
        # the file's dense weights onto huge pages, in the background (resident.py)
        if self.hybrid:  # the float path (prefill.py) has no linear-attention layers
            self.stack_rows = sys.maxsize
        self.resident = ResidentCopies([b for bound in self.bound for b in bound] + [self.head])
        self.inv_freq = {kind: rope_inv_freq(rotary_dim(cfg), params)
                         for kind, params in cfg.rope.items()}
        self.rope_keys = sorted(self.inv_freq)
        self.view_keys: list = []
        self.stack = (StackLayer * cfg.num_layers)()
        self._caches = None
        self.layer_views: list = []
        self.float_layers = FloatLayers(self)

    def _experts(self, w: dict, prefix: str, linear) -> RoutedExperts:
        """A sparse layer's router and experts (``prefix``: ``model.layers.N.mlp.``), each
        expert's [gate | up] and down bound as a projection's parts are."""
        moe, E = self.cfg.moe, self.cfg.hidden_size
        if w.get(prefix + "gate.bias") is not None:
            raise UnsupportedFeatureError(f"{prefix}gate: a router bias")
        router = w[prefix + "gate.weight"]  # llama.cpp keeps it F32; a block type is decoded
        router = router.read() if isinstance(router, BlockTensor) else router
        names = [prefix + f"experts.{e}." for e in range(moe.num_experts)]
        shared = None
        if getattr(self.cfg, "shared_expert_size", 0):  # Qwen3.5-MoE
            gate = w[prefix + "shared_expert_gate.weight"]
            gate = gate.read() if isinstance(gate, BlockTensor) else gate
            shared = (linear([prefix + "shared_expert.gate_proj", prefix + "shared_expert.up_proj"], E),
                      linear([prefix + "shared_expert.down_proj"], self.cfg.shared_expert_size),
                      np.ascontiguousarray(np.asarray(gate, dtype=np.float32).reshape(E)))
        return RoutedExperts(
            self.lib, np.asarray(router, dtype=np.float32),
            [linear([x + "gate_proj", x + "up_proj"], E) for x in names],
            [linear([x + "down_proj"], moe.intermediate_size) for x in names],
            moe.top_k, moe.norm_topk_prob, cpu_lib.ACT_IDS[ACTIVATION_KINDS[moe.hidden_act]],
            prefix + "experts", shared)

    def _gdn(self, w: dict, prefix: str, linear, hf_config: dict) -> tuple[tuple, tuple]:
        """A linear-attention layer's mixer (``prefix``: ``model.layers.N.linear_attn.``):
        its ``GdnLayer`` with the float arrays it points at, and its bound projections.
        The value heads stay in the file's order (``load_gguf_weights(as_stored=True)``)."""
        g, E = self.cfg.gdn, self.cfg.hidden_size

        def floats(name: str, shape: tuple) -> np.ndarray:
            t = w[prefix + name]  # small: a block type (if any) is decoded
            t = t.read() if isinstance(t, BlockTensor) else t
            return np.ascontiguousarray(np.asarray(t, dtype=np.float32).reshape(shape))

        in_proj = linear([prefix + "in_proj_qkv", prefix + "in_proj_z"], E)
        out = linear([prefix + "out_proj"], g.num_v_heads * g.v_head_dim)
        if g.in_proj_layout == "qkv_z_ba":  # [b | a] of each key head's value heads
            per = g.num_v_heads // g.num_k_heads
            ba = floats("in_proj_ba.weight", (g.num_k_heads, 2, per, E))
            b_a = np.concatenate([ba[:, 0].reshape(-1, E), ba[:, 1].reshape(-1, E)])
        else:
            b_a = np.concatenate([floats("in_proj_b.weight", (g.num_v_heads, E)),
                                  floats("in_proj_a.weight", (g.num_v_heads, E))])
        arrays = (floats("conv1d.weight", (g.conv_channels, g.conv_kernel)).T.copy(),  # [kernel, C]
                  b_a,
                  floats("A_log", (g.num_v_heads,)), floats("dt_bias", (g.num_v_heads,)),
                  floats("norm.weight", (g.v_head_dim,)))
        desc = cpu_lib.GdnLayer(g.num_k_heads, g.num_v_heads, g.k_head_dim, g.v_head_dim,
                                g.conv_kernel, int(value_heads_tiled(hf_config)),
                                self.cfg.rms_norm_eps, *(a.ctypes.data for a in arrays),
                                in_proj.linear, out.linear)
        return (desc, arrays), (in_proj, out)

    def step_read_bytes(self) -> int:
        """The weight bytes one decode step reads: every layer's parts (of an MoE layer,
        its router and k experts') and the LM head (of the embedding, one row: it is the
        head only when tied)."""
        layers = sum(a.nbytes for bound in self.bound for b in bound for a in b.arrays)
        experts = sum(x.read_bytes() for x in self.experts if x is not None)
        return layers + experts + sum(a.nbytes for a in self.head.arrays)

    def state_shapes(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """One slot's conv state (the last kernel - 1 inputs, oldest first, channels
        contiguous) and recurrent state of a linear-attention layer."""
        g = self.cfg.gdn
        return (g.conv_kernel - 1, g.conv_channels), (g.num_v_heads, g.k_head_dim, g.v_head_dim)

    def bind(self, caches: Sequence[tuple[np.ndarray, np.ndarray]],
             layer_views: Sequence) -> None:
        """Each layer's K/V cache (float32 [slots, kv_heads, head_dim], contiguous), or a
        linear-attention layer's states (``state_shapes``), and the key of the step view
        it reads (``forward``'s ``views``: one per cache group and window)."""
        self.view_keys = sorted(set(layer_views), key=repr)
        for i, ((k, v), view) in enumerate(zip(caches, layer_views)):
            shapes = (self.state_shapes() if self.gdn[i] is not None else
                      ((self.cfg.num_kv_heads, self.cfg.head_dim),) * 2)
            for c, shape in zip((k, v), shapes):
                if c.dtype != np.float32 or not c.flags.c_contiguous or c.shape[1:] != shape:
                    raise ValueError(f"layer {i}: a cache must be contiguous float32 "
                                     f"[slots, {', '.join(map(str, shape))}]")
            self.stack[i] = StackLayer(ctypes.addressof(self.descs[i]), k.ctypes.data,
                                       v.ctypes.data, self.view_keys.index(view),
                                       self.rope_keys.index(self.cfg.layer_rope[i]))
        self._caches = list(caches)  # the pointers above stay valid
        self.layer_views = list(layer_views)

    def forward(self, ids: np.ndarray, positions: np.ndarray, views: dict,
                sample_rows: Sequence[int], threads: int = 0) -> np.ndarray:
        """Rows ``ids``/``positions`` (int64 [M]) through every layer, writing their keys;
        float32 logits [len(sample_rows), vocab] of the rows that sample."""
        if self._caches is None:
            raise RuntimeError("bind the KV caches first")
        self.resident.adopt()
        m, E = len(ids), self.cfg.hidden_size
        ids = np.ascontiguousarray(ids, dtype=np.int64)
        x = np.empty((m, E), dtype=np.float32)
        self._rows(self.embed, self.embed_blocks, ids, x, threads)
        if self.embed_scale is not None:
            x *= self.embed_scale
        pos = np.asarray(positions, dtype=np.float32)
        ropes = {}
        for kind in self.rope_keys:
            freqs = np.outer(pos, self.inv_freq[kind])
            ropes[kind] = (np.cos(freqs), np.sin(freqs))
        if m >= self.stack_rows:  # attention by matrix products (prefill.py)
            hidden = self.float_layers.run(x, views, self.layer_views, ropes, threads)
        else:
            hidden = self._stack(x, views, ropes, threads)
        rows = np.ascontiguousarray(hidden[list(sample_rows)])
        normed = np.empty_like(rows)
        rc = self.lib.pq_rms_norm(rows.ctypes.data, len(rows), 1, E, E, 0, None, 0, 0,
                                  self.final_norm.ctypes.data, self.cfg.rms_norm_eps,
                                  normed.ctypes.data, None)
        cpu_lib.raise_for(rc, None, "final norm")
        logits = np.empty((len(rows), self.head.width), dtype=np.float32)
        if len(rows):
            rc = self.lib.pq_linear(ctypes.addressof(self.head.parts), 1, E, normed.ctypes.data,
                                    len(rows), E, logits.ctypes.data, self.head.width, threads)
            cpu_lib.raise_for(rc, None, "LM head")
        if self.head.width < self.cfg.vocab_size:  # the padding rows' logits are zeros
            logits = np.pad(logits, ((0, 0), (0, self.cfg.vocab_size - self.head.width)))
        if self.cfg.final_softcap is not None:
            cap = np.float32(self.cfg.final_softcap)
            logits = np.tanh(logits / cap) * cap
        return logits

    def _stack(self, x: np.ndarray, views: dict, ropes: dict, threads: int) -> np.ndarray:
        """Every layer in one ``pq_decoder_stack`` call: the last layer's output plus its
        residual."""
        step_views = (StepView * len(self.view_keys))()
        for j, key in enumerate(self.view_keys):
            v = views[key]
            step_views[j] = StepView(v.slots.ctypes.data, v.gather.ctypes.data,
                                     v.lengths.ctypes.data, v.gather.shape[1], _ptr(v.snapshots))
        step_ropes = (StepRope * len(self.rope_keys))()
        for j, kind in enumerate(self.rope_keys):
            cos, sin = ropes[kind]
            step_ropes[j] = StepRope(cos.ctypes.data, sin.ctypes.data, cos.shape[1])
        hidden = np.empty_like(x)
        rc = self.lib.pq_decoder_stack(self.stack, self.cfg.num_layers, step_views, step_ropes,
                                       x.ctypes.data, len(x), hidden.ctypes.data, threads)
        cpu_lib.raise_for(rc, None, "pq_decoder_stack")
        return hidden

    def _rows(self, t: BlockTensor, blocks: np.ndarray, ids: np.ndarray, out: np.ndarray,
              threads: int) -> None:
        if len(ids) and (ids.min() < 0 or ids.max() >= blocks.shape[0]):
            raise ValueError(f"token ids must lie in [0, {blocks.shape[0]})")
        rc = self.lib.pq_dequantize_rows(t.ggml_type, blocks.ctypes.data, t.shape[-1],
                                         blocks.shape[1], ids.ctypes.data, len(ids),
                                         out.ctypes.data, out.shape[1], threads)
        cpu_lib.raise_for(rc, t.ggml_type, f"embedding ({type_name(t.ggml_type)})")
