"""Shared pieces of every decoder-only model: attention, gated MLP, the model shell
and weight loading by HF parameter name.

A family module subclasses ``CausalLM`` with its decoder layer and says how
HF names map onto the (fused) parameters here, in ``weight_targets`` (the targets
themselves: ``weight_targets.py``).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Iterable, Optional, Protocol, Sequence, Union

import numpy as np
import torch
from torch import nn

from pocketllm.errors import CheckpointError, UnsupportedFeatureError

from ..distributed import SINGLE, TPGroup
from ..kernels import fused_kernel, kernel_activations
from ..layers.activation import act_and_mul, get_activation
from ..layers.attention import AttentionBackend, AttentionMetadata
from ..layers.linear import (ColumnParallelLinear, LMHead, RowParallelLinear, Shard,
                             VocabParallelEmbedding, even_shard)
from ..layers.norm import RMSNorm
from ..layers.rotary import RotaryTable, apply_rotary, rotary_dim
from .config import ArchConfig
from .weight_targets import WeightTarget, row_parallel_targets, stacked_targets, vocab_target

logger = logging.getLogger("pocketllm.worker")

RopeCosSin = tuple[torch.Tensor, torch.Tensor]


class LazyTensor(Protocol):
    """A checkpoint tensor not read yet (see loader/safetensors.py)."""

    shape: tuple[int, ...]

    def read(self, shard: Optional[Shard]) -> torch.Tensor: ...


def check_tensor_parallel(cfg: ArchConfig, world: int) -> None:
    """Refuse, before any weight is read, a model whose heads do not split across ``world``."""
    if world == 1:
        return
    problems = []
    if cfg.num_heads % world:
        problems.append(f"num_attention_heads={cfg.num_heads} is not divisible by "
                        f"tensor_parallel_size={world}")
    if cfg.num_kv_heads % world and world % cfg.num_kv_heads:
        problems.append(f"num_key_value_heads={cfg.num_kv_heads} neither divides nor is "
                        f"divisible by tensor_parallel_size={world}")
    for key, size in cfg.tp_splits().items():  # the MLP widths split across ranks
        if size % world:
            problems.append(f"{key}={size} is not divisible by tensor_parallel_size={world}")
    if problems:
        raise UnsupportedFeatureError(
            f"{cfg.architecture} cannot be split across {world} tensor-parallel ranks: "
            + "; ".join(problems) + ". Choose a tensor_parallel_size that divides the head counts.")


def kv_head_range(cfg: ArchConfig, tp: TPGroup) -> tuple[int, int]:
    """The KV heads this rank holds: its share, or (fewer KV heads than ranks) the one
    KV head its query heads read, replicated on the ranks that share it."""
    count = max(1, cfg.num_kv_heads // tp.world)
    first = tp.rank * cfg.num_kv_heads // tp.world
    return first, count


class Attention(nn.Module):
    """Query heads split evenly across ranks (column-parallel q/k/v, row-parallel o_proj).
    ``q_per_head``: q_proj's rows per query-head dimension (2: a gate beside each query,
    ``models/qwen3_5.GatedAttention``)."""

    q_per_head = 1

    def __init__(self, cfg: ArchConfig, layer: int, backend: AttentionBackend,
                 device: torch.device, dtype: torch.dtype, tp: TPGroup = SINGLE):
        super().__init__()
        d = cfg.head_dim
        kv_first, self.num_kv_heads = kv_head_range(cfg, tp)
        self.num_heads, self.head_dim = cfg.num_heads // tp.world, d
        q_shard = even_shard(cfg.num_heads * d * self.q_per_head, tp)
        kv_shard = Shard(0, kv_first * d, (kv_first + self.num_kv_heads) * d, cfg.num_kv_heads * d)
        self.split = [q_shard.size, kv_shard.size, kv_shard.size]
        self.qkv_proj = ColumnParallelLinear(
            cfg.hidden_size, [q_shard, kv_shard, kv_shard], cfg.qkv_bias, device, dtype)
        self.o_proj = RowParallelLinear(even_shard(cfg.num_heads * d, tp, dim=1), cfg.hidden_size,
                                        cfg.o_bias, device, dtype, tp)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, device) if cfg.qk_norm else None
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, device) if cfg.qk_norm else None
        self.window, self.scale, self.softcap = cfg.layer_windows[layer], cfg.attn_scale, cfg.attn_softcap
        # gpt-oss: one learned logit per query head in each softmax (this rank's heads),
        # float32 whatever the model dtype, as the backends add it to float32 scores
        self.head_shard = even_shard(cfg.num_heads, tp)
        self.sinks = (nn.Parameter(torch.empty(self.num_heads, device=device, dtype=torch.float32),
                                   requires_grad=False) if cfg.attn_sinks else None)
        self.backend = backend
        # in place, q and k (a partial rotary too: part of each head)
        self.rotary_kernel = fused_kernel(device, "rotary", "apply_rotary_qk")
        # One-row steps rotate q/k inside the projection, unless a q/k norm comes between
        # or the rotary is partial.
        partial = rotary_dim(d, cfg.rope[cfg.layer_rope[layer]]) < d
        self.rotary_in_projection = (self.rotary_kernel is not None and self.q_norm is None
                                     and not partial)
        self.rotated_rows = (self.num_heads + self.num_kv_heads) * d
        self.output_shape = (self.num_heads, d)  # of each token's row ``attend`` writes

    @property
    def qk_norms(self) -> Optional[tuple[torch.Tensor, torch.Tensor, float]]:
        """What the rotary kernel needs to norm q and k in its launch (None: no q/k norm)."""
        if self.q_norm is None:
            return None
        return self.q_norm.weight, self.k_norm.weight, self.q_norm.eps

    def project(self, norm: RMSNorm, x: torch.Tensor, residual: Optional[torch.Tensor],
                rope: RopeCosSin
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Rows entering the layer (and the residual, None for the first layer) ->
        q [T, H, D], k and v [T, Hkv, D] of ``norm(x + residual)``, rotary applied;
        and the new residual."""
        if self.rotary_in_projection and self.qkv_proj.rotates(x):  # one launch for all of it
            qkv, residual = self.qkv_proj.normed(norm, x, residual,
                                                 (*rope, self.head_dim, self.rotated_rows))
            return (*self._heads(qkv), residual)
        qkv, residual = self.qkv_proj.normed(norm, x, residual)
        q, k, v = self._heads(qkv)
        if self.rotary_kernel is not None:  # with the q/k norms, if any, in the same launch
            return (*self.rotary_kernel(q, k, *rope, self.qk_norms), v, residual)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        return apply_rotary(q, *rope), apply_rotary(k, *rope), v, residual

    def _heads(self, qkv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        tokens = qkv.shape[0]
        q, k, v = qkv.split(self.split, dim=-1)
        return (q.view(tokens, self.num_heads, self.head_dim),
                k.view(tokens, self.num_kv_heads, self.head_dim),
                v.reshape(tokens, self.num_kv_heads, self.head_dim))

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata,
               kv_cache: tuple[torch.Tensor, torch.Tensor], out: Optional[torch.Tensor] = None
               ) -> torch.Tensor:
        """Write k/v into the cache and attend: [T, H, D] (into ``out`` when given)."""
        if self.sinks is not None:
            return self.backend.forward(q, k, v, kv_cache[0], kv_cache[1], meta, self.window,
                                        self.scale, self.softcap, out, sinks=self.sinks)
        return self.backend.forward(q, k, v, kv_cache[0], kv_cache[1], meta, self.window,
                                    self.scale, self.softcap, out)

    def output(self, attn: torch.Tensor) -> torch.Tensor:
        return self.o_proj(attn.reshape(attn.shape[0], self.num_heads * self.head_dim))


class GatedMLP(nn.Module):
    """Intermediate columns split across ranks (column-parallel gate/up, row-parallel down)."""

    def __init__(self, cfg: ArchConfig, device: torch.device, dtype: torch.dtype,
                 tp: TPGroup = SINGLE):
        super().__init__()
        inter = even_shard(cfg.intermediate_size, tp)
        self.gate_up_proj = ColumnParallelLinear(cfg.hidden_size, [inter, inter], cfg.mlp_bias,
                                                 device, dtype)
        self.down_proj = RowParallelLinear(even_shard(cfg.intermediate_size, tp, dim=1),
                                           cfg.hidden_size, cfg.mlp_bias, device, dtype, tp)
        self.act = get_activation(cfg.hidden_act)
        self.hidden_act = cfg.hidden_act
        kernel = fused_kernel(device, "gated_act", "act_and_mul")
        if kernel is not None and cfg.hidden_act not in kernel_activations():
            kernel = None
        self.act_kernel = kernel

    def forward(self, x: torch.Tensor, reduce: bool = True) -> torch.Tensor:
        """``reduce=False``: this rank's partial sum (``RowParallelLinear``'s)."""
        return self._down(self.gate_up_proj(x), reduce)

    def weight_targets(self, prefix: str) -> dict[str, "WeightTarget"]:
        """HF name (under ``prefix``, e.g. ``model.layers.3.mlp.``) -> its place here."""
        t: dict[str, WeightTarget] = {}
        stacked_targets(t, prefix, ("gate_proj", "up_proj"), self.gate_up_proj)
        row_parallel_targets(t, f"{prefix}down_proj.", self.down_proj)
        return t

    def normed(self, norm: RMSNorm, x: torch.Tensor, residual: torch.Tensor
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(self(norm(x + residual)), x + residual)``."""
        gate_up, residual = self.gate_up_proj.normed(norm, x, residual)
        return self._down(gate_up), residual

    def _down(self, gate_up: torch.Tensor, reduce: bool = True) -> torch.Tensor:
        if self.act_kernel is not None:
            if self.down_proj.fuses(gate_up):
                # the activation inside the product's launches (its method's prologue)
                return self.down_proj(gate_up, hidden_act=self.hidden_act, reduce=reduce)
            return self.down_proj(self.act_kernel(gate_up, self.hidden_act), reduce=reduce)
        return self.down_proj(act_and_mul(self.act, gate_up), reduce=reduce)


class DecoderLayer(nn.Module):
    """A pre-norm decoder layer cut at its attention call, so that the model can run
    everything between two attention calls as one piece (``CausalLM.segment``).

    The residual stream travels as ``(x, residual)`` with the sum not yet taken: each
    layer adds it inside the RMSNorm it opens with (``RMSNorm.add``: one launch on the
    GPU path) and hands back its last sublayer's output with the new residual."""

    self_attn: Attention
    input_layernorm: RMSNorm

    def pre_attention(self, x: torch.Tensor, residual: Optional[torch.Tensor], rope: RopeCosSin
                      ) -> tuple[torch.Tensor, ...]:
        """-> the inputs of the attention call (q, k, v for ``Attention``), then the
        residual."""
        return self.self_attn.project(self.input_layernorm, x, residual, rope)

    def post_attention(self, attn: torch.Tensor, residual: torch.Tensor
                       ) -> tuple[torch.Tensor, torch.Tensor]:
        """Attention rows [T, H, D] -> the layer's output x and the residual."""
        raise NotImplementedError


class PreNormDecoderLayer(DecoderLayer):
    """Attention, then an MLP (dense, or experts: anything with ``normed``), each opened by
    an RMSNorm: Llama's layout, which Qwen3-MoE, gpt-oss and DeepSeek share."""

    norm_names = ("input_layernorm", "post_attention_layernorm")

    def __init__(self, cfg: ArchConfig, index: int, backend: AttentionBackend,
                 device: torch.device, dtype: torch.dtype, tp: TPGroup, mlp: nn.Module,
                 attention: Optional[nn.Module] = None):
        """``attention``: one with ``Attention``'s ``project`` and ``output`` (DeepSeek's
        latent attention); None: ``Attention``."""
        super().__init__()
        self.self_attn = attention or Attention(cfg, index, backend, device, dtype, tp)
        self.mlp = mlp
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, device)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, device)

    def post_attention(self, attn: torch.Tensor, residual: torch.Tensor
                       ) -> tuple[torch.Tensor, torch.Tensor]:
        return self.mlp.normed(self.post_attention_layernorm, self.self_attn.output(attn),
                               residual)


@dataclass
class Segment:
    """What one piece between two attention calls hands on: the next layer's attention
    inputs (q/k/v; whatever its token mixer's ``attend`` takes) and the residual, or (after
    the last layer) the hidden states; plus the rotary rows."""

    rope: dict[str, RopeCosSin]
    residual: Optional[torch.Tensor] = None
    qkv: Optional[tuple[torch.Tensor, ...]] = None
    hidden: Optional[torch.Tensor] = None


def as_group_metas(metas: Union[AttentionMetadata, Sequence[AttentionMetadata]]
                   ) -> Sequence[AttentionMetadata]:
    """A step's metadata per KV cache group; a lone metadata serves a single group."""
    return (metas,) if isinstance(metas, AttentionMetadata) else metas


class CausalLM(nn.Module):
    """Embedding -> decoder layers -> final norm -> LM head, over a flattened token batch."""

    def __init__(self, cfg: ArchConfig, backend: AttentionBackend, device: torch.device,
                 dtype: torch.dtype, tp: TPGroup = SINGLE):
        super().__init__()
        cfg.validate()
        check_tensor_parallel(cfg, tp.world)
        self.cfg, self.device, self.dtype, self.tp = cfg, device, dtype, tp
        self.attention_backend = backend  # what the runner builds each step's metadata for
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, device, dtype,
                                                   cfg.embed_scale, tp)
        self.layers = nn.ModuleList(self.make_layer(cfg, i, backend, device, dtype, tp)
                                    for i in range(cfg.num_layers))
        # Indexed twice per layer and step: a tuple skips ModuleList's slow __getitem__.
        self._layer_at = tuple(self.layers)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, device)
        tied = self.embed_tokens if cfg.tie_word_embeddings else None
        self.lm_head = LMHead(cfg.hidden_size, cfg.vocab_size, device, dtype, tied,
                              cfg.final_softcap, tp)
        self.num_local_kv_heads = kv_head_range(cfg, tp)[1]  # what this rank's KV cache holds
        self.rotary = {kind: RotaryTable(cfg.head_dim, cfg.rope[kind], cfg.max_position_embeddings,
                                         device, dtype) for kind in sorted(set(cfg.layer_rope))}
        # Per layer: its KV cache group, whose metadata (block tables) its attention reads.
        # One group until the runner sets its layout (workers/kv_cache.py).
        self.layer_group: tuple[int, ...] = (0,) * cfg.num_layers
        self.mtp: Optional[nn.Module] = None  # ``build_mtp``'s

    # The width of one position's cache row per layer when the family caches a latent
    # (MLA) instead of K and V heads; None: K/V heads (kv_cache.py).
    latent_cache_width: Optional[int] = None

    def step_read_bytes(self) -> int:
        """Bytes of weights a one-token decode step reads on this rank (``bench latency``'s
        roofline): every parameter, less what a module declares it leaves unread
        (``unread_bytes``: the experts a token is not routed to, an input embedding's rows
        but one). A table the LM head shares is read whole. A layer that keeps a GGUF
        file's blocks reads their bytes."""
        total = sum(t.numel() * t.element_size()
                    for t in [*self.parameters(), *block_buffers(self)])
        return total - sum(m.unread_bytes() for m in self.modules()
                           if hasattr(m, "unread_bytes") and m is not self.lm_head.tied_to)

    def make_layer(self, cfg: ArchConfig, index: int, backend: AttentionBackend,
                   device: torch.device, dtype: torch.dtype, tp: TPGroup) -> DecoderLayer:
        raise NotImplementedError

    def build_mtp(self, backend: AttentionBackend) -> nn.Module:
        """The checkpoint's multi-token-prediction layer as a module of this model (its
        weights load with the model's), for ``speculative_method="mtp"``."""
        raise UnsupportedFeatureError(
            f"speculative_method='mtp': no MTP layer of {self.cfg.architecture} is built (those "
            "of Qwen3.5, Qwen3.5-MoE, Qwen3-Next and DeepSeek-V3 are)", "speculative_method")

    def mtp_tensor(self, name: str) -> Optional[str]:
        """A tensor of the checkpoint's MTP layer (``name``: as ``mtp_layer.MTPNames``
        spells it): its name where the layer was built and loads it, else None (skipped,
        with one log line)."""
        if self.mtp is not None:
            return None if self.mtp.names.is_shared(name) else name
        if not getattr(self, "_mtp_logged", False):
            logger.info("the checkpoint's multi-token-prediction (MTP) layer is not loaded "
                        "(it drafts with speculative_method='mtp')")
            self._mtp_logged = True
        return None

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, max_position: int,
                metas: Union[AttentionMetadata, Sequence[AttentionMetadata]],
                kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        """Hidden states [T, hidden] before the final norm (applied in compute_logits):
        the segments, with each layer's attention between them. ``metas``: one metadata per
        KV cache group (a lone one: every layer's)."""
        metas = as_group_metas(metas)
        seg = self.embed(input_ids, positions, max_position)
        for i, layer in enumerate(self._layer_at):
            seg = self.segment(i + 1, layer.self_attn.attend(
                *seg.qkv, metas[self.layer_group[i]], kv_caches[i]), seg)
        return seg.hidden

    def embed(self, input_ids: torch.Tensor, positions: torch.Tensor, max_position: int
              ) -> Segment:
        """Segment 0: the embedding and the first layer up to its attention."""
        rope = {kind: table.lookup(positions, max_position) for kind, table in self.rotary.items()}
        return self._enter(0, self.embed_tokens(input_ids), None, rope)

    def segment(self, index: int, attn: torch.Tensor, prev: Segment) -> Segment:
        """Segment ``index`` (1 .. num_layers): layer index-1 after its attention, then
        layer ``index`` up to its own (or, after the last layer, the hidden states)."""
        x, residual = self._layer_at[index - 1].post_attention(attn, prev.residual)
        if index == len(self._layer_at):
            return Segment(prev.rope, hidden=x + residual)
        return self._enter(index, x, residual, prev.rope)

    def _enter(self, index: int, x: torch.Tensor, residual: Optional[torch.Tensor],
               rope: dict[str, RopeCosSin]) -> Segment:
        *inputs, residual = self._layer_at[index].pre_attention(
            x, residual, rope[self.cfg.layer_rope[index]])
        return Segment(rope, residual, tuple(inputs))

    def compute_logits(self, hidden: torch.Tensor) -> Optional[torch.Tensor]:
        """Float32 logits for the rows that sample (the norm is row-wise, so it runs here);
        None on every rank but 0 when tensor-parallel."""
        return self.lm_head(self.norm(hidden))

    # ------------------------------------------------------------------ weights

    def weight_targets(self) -> dict[str, WeightTarget]:
        """HF parameter name -> where it is stored here (override to add family params)."""
        t: dict[str, WeightTarget] = {
            "model.embed_tokens.weight": vocab_target(self.embed_tokens.weight,
                                                       self.embed_tokens.shard),
            "model.norm.weight": WeightTarget(self.norm.weight)}
        if self.lm_head.tied_to is None:
            t["lm_head.weight"] = self.lm_head.part_target()
        for i, layer in enumerate(self.layers):
            t.update(self.layer_weight_targets(f"model.layers.{i}.", layer))
        if self.mtp is not None:
            t.update(self.mtp.weight_targets())
        return t

    def layer_weight_targets(self, p: str, layer: DecoderLayer) -> dict[str, WeightTarget]:
        """One decoder layer's HF names (under ``p``) -> their places (a family with
        another attention overrides this)."""
        t: dict[str, WeightTarget] = {}
        attn, mlp = layer.self_attn, layer.mlp
        stacked_targets(t, f"{p}self_attn.", ("q_proj", "k_proj", "v_proj"), attn.qkv_proj)
        row_parallel_targets(t, f"{p}self_attn.o_proj.", attn.o_proj)
        if attn.q_norm is not None:
            t[f"{p}self_attn.q_norm.weight"] = WeightTarget(attn.q_norm.weight)
            t[f"{p}self_attn.k_norm.weight"] = WeightTarget(attn.k_norm.weight)
        if attn.sinks is not None:
            t[f"{p}self_attn.sinks"] = WeightTarget(
                attn.sinks, shard=None if attn.head_shard.whole else attn.head_shard)
        t.update(mlp.weight_targets(f"{p}mlp."))
        for norm in layer.norm_names:
            t[f"{p}{norm}.weight"] = WeightTarget(getattr(layer, norm).weight)
        return t

    def canonical_name(self, name: str) -> Optional[str]:
        """Map a checkpoint name onto the ``model.``/``lm_head.`` scheme; None = skip it."""
        if "rotary_emb.inv_freq" in name:
            return None  # a cached buffer some old checkpoints carry
        if name == "lm_head.weight" and self.cfg.tie_word_embeddings:
            return None  # tied: the embedding is the head
        return name

    def load_weights(self, named_tensors: Iterable[tuple[str, "torch.Tensor | LazyTensor"]]
                     ) -> None:
        """Copy checkpoint tensors into place; every expected tensor must arrive.

        A tensor may be lazy (``shape`` + ``read(shard)``): then only this rank's part
        of it is ever read. A full tensor is sliced here and dropped by the caller.
        """
        targets = self.weight_targets()
        loaded: set[str] = set()
        with torch.no_grad():
            for raw_name, tensor in named_tensors:
                name = self.canonical_name(raw_name)
                if name is None:
                    continue
                target = targets.get(name)
                if target is None:
                    raise CheckpointError(f"unexpected tensor {raw_name!r} in checkpoint "
                                          f"for {self.cfg.architecture}")
                if tuple(tensor.shape) != target.checkpoint_shape:
                    raise CheckpointError(f"tensor {raw_name!r} has shape {tuple(tensor.shape)}, "
                                          f"expected {target.checkpoint_shape}")
                if target.ggml_type is not None:  # blocks kept as the file stores them
                    target.write(torch.from_numpy(_stored_blocks(raw_name, tensor, target)))
                    loaded.add(name)
                    continue
                if isinstance(tensor, np.ndarray):  # a GGUF file's float tensor
                    tensor = torch.from_numpy(tensor)
                if isinstance(tensor, torch.Tensor):
                    part = tensor if target.shard is None else target.shard.take(tensor)
                else:  # lazy: torch (safetensors) or numpy (a GGUF block tensor, decoded)
                    part = torch.as_tensor(tensor.read(target.shard))
                if target.transform is not None:
                    part = target.transform(part.float())
                target.write(part)
                loaded.add(name)
        missing = sorted(set(targets) - loaded)
        if missing:
            more = f" (and {len(missing) - 5} more)" if len(missing) > 5 else ""
            raise CheckpointError(f"checkpoint lacks tensor {missing[0]!r}"
                                  + (f"; also missing {missing[1:5]}{more}" if len(missing) > 1 else ""))


def block_buffers(model: nn.Module) -> list[torch.Tensor]:
    """Every linear layer's GGUF blocks (``layers/linear_method.GGUF_BLOCKS``)."""
    return [b for m in model.modules() for b in getattr(m, "blocks", ())]


def _stored_blocks(name: str, tensor, target: WeightTarget) -> np.ndarray:
    """This rank's bytes of a block tensor, of the type its target was built for."""
    from ..loader.block_tensor import BlockTensor
    from ..loader.gguf_quants import type_name

    if not isinstance(tensor, BlockTensor) or tensor.ggml_type != target.ggml_type:
        got = type_name(tensor.ggml_type) if isinstance(tensor, BlockTensor) else "float values"
        raise CheckpointError(f"tensor {name!r}: {got} where the model was built for "
                              f"{type_name(target.ggml_type)} blocks")
    return np.ascontiguousarray(tensor.part(target.shard))
