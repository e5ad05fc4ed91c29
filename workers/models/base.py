"""Shared pieces of every decoder-only model: attention, gated MLP, the model shell
and weight loading by HF parameter name.

A family module subclasses ``CausalLM`` with its decoder layer and says how
HF names map onto the (fused) parameters here, in ``weight_targets``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterable, Optional

import torch
from torch import nn

from pocketllm.errors import CheckpointError

from ..layers.activation import act_and_mul, get_activation
from ..layers.attention import AttentionBackend, AttentionMetadata
from ..layers.linear import Embedding, Linear, LMHead
from ..layers.norm import RMSNorm
from ..layers.rotary import RotaryTable, apply_rotary
from .config import ArchConfig

RopeCosSin = tuple[torch.Tensor, torch.Tensor]


class Attention(nn.Module):
    def __init__(self, cfg: ArchConfig, layer: int, backend: AttentionBackend,
                 device: torch.device, dtype: torch.dtype):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        q_size, kv_size = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        self.split = [q_size, kv_size, kv_size]
        self.qkv_proj = Linear(cfg.hidden_size, self.split, cfg.qkv_bias, device, dtype)
        self.o_proj = Linear(q_size, cfg.hidden_size, cfg.o_bias, device, dtype)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, device) if cfg.qk_norm else None
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, device) if cfg.qk_norm else None
        self.window, self.scale, self.softcap = cfg.layer_windows[layer], cfg.attn_scale, cfg.attn_softcap
        self.backend = backend

    def forward(self, x: torch.Tensor, rope: RopeCosSin, meta: AttentionMetadata,
                kv_cache: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        tokens = x.shape[0]
        q, k, v = self.qkv_proj(x).split(self.split, dim=-1)
        q = q.view(tokens, self.num_heads, self.head_dim)
        k = k.view(tokens, self.num_kv_heads, self.head_dim)
        v = v.reshape(tokens, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rotary(q, *rope), apply_rotary(k, *rope)
        out = self.backend.forward(q, k, v, kv_cache[0], kv_cache[1], meta,
                                   self.window, self.scale, self.softcap)
        return self.o_proj(out.reshape(tokens, self.num_heads * self.head_dim))


class GatedMLP(nn.Module):
    def __init__(self, cfg: ArchConfig, device: torch.device, dtype: torch.dtype):
        super().__init__()
        inter = cfg.intermediate_size
        self.gate_up_proj = Linear(cfg.hidden_size, [inter, inter], cfg.mlp_bias, device, dtype)
        self.down_proj = Linear(inter, cfg.hidden_size, cfg.mlp_bias, device, dtype)
        self.act = get_activation(cfg.hidden_act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(act_and_mul(self.act, self.gate_up_proj(x)))


@dataclass
class WeightTarget:
    """Where one checkpoint tensor goes: rows ``rows`` of ``param``, after ``transform``."""

    param: torch.Tensor
    rows: Optional[slice] = None
    transform: Optional[Callable[[torch.Tensor], torch.Tensor]] = None

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.param[self.rows].shape if self.rows is not None else self.param.shape)


class CausalLM(nn.Module):
    """Embedding -> decoder layers -> final norm -> LM head, over a flattened token batch."""

    def __init__(self, cfg: ArchConfig, backend: AttentionBackend, device: torch.device,
                 dtype: torch.dtype):
        super().__init__()
        cfg.validate()
        self.cfg, self.device, self.dtype = cfg, device, dtype
        self.embed_tokens = Embedding(cfg.vocab_size, cfg.hidden_size, device, dtype, cfg.embed_scale)
        self.layers = nn.ModuleList(self.make_layer(cfg, i, backend, device, dtype)
                                    for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, device)
        tied = self.embed_tokens if cfg.tie_word_embeddings else None
        self.lm_head = LMHead(cfg.hidden_size, cfg.vocab_size, device, dtype, tied, cfg.final_softcap)
        self.rotary = {kind: RotaryTable(cfg.head_dim, cfg.rope[kind], cfg.max_position_embeddings,
                                         device, dtype) for kind in sorted(set(cfg.layer_rope))}

    def make_layer(self, cfg: ArchConfig, index: int, backend: AttentionBackend,
                   device: torch.device, dtype: torch.dtype) -> nn.Module:
        raise NotImplementedError

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, max_position: int,
                meta: AttentionMetadata, kv_caches: list[tuple[torch.Tensor, torch.Tensor]]
                ) -> torch.Tensor:
        """Hidden states [T, hidden] before the final norm (applied in compute_logits)."""
        rope = {kind: table.lookup(positions, max_position) for kind, table in self.rotary.items()}
        x = self.embed_tokens(input_ids)
        for layer, kind, kv in zip(self.layers, self.cfg.layer_rope, kv_caches):
            x = layer(x, rope[kind], meta, kv)
        return x

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Float32 logits for the rows that sample (the norm is row-wise, so it runs here)."""
        return self.lm_head(self.norm(hidden))

    # ------------------------------------------------------------------ weights

    def weight_targets(self) -> dict[str, WeightTarget]:
        """HF parameter name -> where it is stored here (override to add family params)."""
        t: dict[str, WeightTarget] = {"model.embed_tokens.weight": WeightTarget(self.embed_tokens.weight),
                                      "model.norm.weight": WeightTarget(self.norm.weight)}
        if self.lm_head.weight is not None:
            t["lm_head.weight"] = WeightTarget(self.lm_head.weight)
        for i, layer in enumerate(self.layers):
            p = f"model.layers.{i}."
            attn, mlp = layer.self_attn, layer.mlp
            for j, name in enumerate(("q_proj", "k_proj", "v_proj")):
                t[f"{p}self_attn.{name}.weight"] = WeightTarget(attn.qkv_proj.weight, attn.qkv_proj.shard(j))
                if attn.qkv_proj.bias is not None:
                    t[f"{p}self_attn.{name}.bias"] = WeightTarget(attn.qkv_proj.bias, attn.qkv_proj.shard(j))
            t[f"{p}self_attn.o_proj.weight"] = WeightTarget(attn.o_proj.weight)
            if attn.o_proj.bias is not None:
                t[f"{p}self_attn.o_proj.bias"] = WeightTarget(attn.o_proj.bias)
            if attn.q_norm is not None:
                t[f"{p}self_attn.q_norm.weight"] = WeightTarget(attn.q_norm.weight)
                t[f"{p}self_attn.k_norm.weight"] = WeightTarget(attn.k_norm.weight)
            for j, name in enumerate(("gate_proj", "up_proj")):
                t[f"{p}mlp.{name}.weight"] = WeightTarget(mlp.gate_up_proj.weight, mlp.gate_up_proj.shard(j))
                if mlp.gate_up_proj.bias is not None:
                    t[f"{p}mlp.{name}.bias"] = WeightTarget(mlp.gate_up_proj.bias, mlp.gate_up_proj.shard(j))
            t[f"{p}mlp.down_proj.weight"] = WeightTarget(mlp.down_proj.weight)
            if mlp.down_proj.bias is not None:
                t[f"{p}mlp.down_proj.bias"] = WeightTarget(mlp.down_proj.bias)
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

    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy checkpoint tensors into place; every expected tensor must arrive."""
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
                if tuple(tensor.shape) != target.shape:
                    raise CheckpointError(f"tensor {raw_name!r} has shape {tuple(tensor.shape)}, "
                                          f"expected {target.shape}")
                if target.transform is not None:
                    tensor = target.transform(tensor.float())
                dest = target.param if target.rows is None else target.param[target.rows]
                dest.copy_(tensor)
                loaded.add(name)
        missing = sorted(set(targets) - loaded)
        if missing:
            more = f" (and {len(missing) - 5} more)" if len(missing) > 5 else ""
            raise CheckpointError(f"checkpoint lacks tensor {missing[0]!r}"
                                  + (f"; also missing {missing[1:5]}{more}" if len(missing) > 1 else ""))
