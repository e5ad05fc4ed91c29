"""ArchConfig: one normalized description of a decoder-only transformer.

Each family module turns a checkpoint's ``hf_config`` into an ``ArchConfig``,
filling missing keys exactly as the matching transformers config class does.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Optional

from pocketllm.errors import CheckpointError, UnsupportedFeatureError
from pocketllm.families import BY_ARCHITECTURE

if TYPE_CHECKING:
    from pocketllm.model_info import ModelInfo

FULL, SLIDING = "full_attention", "sliding_attention"
LINEAR = "linear_attention"  # a Gated DeltaNet layer (qwen3_5_config.py): a recurrent state

# HF ``hidden_act`` name -> the function it names: the one table of activation names (the
# torch, Triton and CPU kernels key their own forms on these kinds).
ACTIVATION_KINDS = {"silu": "silu", "swish": "silu", "gelu_pytorch_tanh": "gelu_tanh",
                    "gelu_new": "gelu_tanh", "gelu_fast": "gelu_tanh", "gelu": "gelu"}


@dataclass
class ArchConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    hidden_act: str
    max_position_embeddings: int
    tie_word_embeddings: bool
    attn_scale: float
    layer_windows: list[Optional[int]]  # per layer: sliding window size, None = full attention
    layer_rope: list[str]  # per layer: key into ``rope``
    rope: dict[str, dict] = field(default_factory=dict)  # HF-style rope parameters per kind
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False
    embed_scale: Optional[float] = None
    attn_softcap: Optional[float] = None
    attn_sinks: bool = False  # a learned logit per head joins each softmax's denominator
    final_softcap: Optional[float] = None
    norm_weight_offset: float = 0.0  # RMSNorm scales by (offset + w): Gemma's 1 + w
    # per layer: it is Gated DeltaNet linear attention (a recurrent state, no KV); empty: none
    linear_layers: list[bool] = field(default_factory=list)

    def tp_splits(self) -> dict[str, int]:
        """Config key -> an MLP width that tensor parallelism splits evenly across ranks."""
        return {"intermediate_size": self.intermediate_size}

    def validate(self) -> None:
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                     "num_kv_heads", "head_dim"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise CheckpointError(f"config: {name}={value!r} must be a positive integer")
        if self.num_heads % self.num_kv_heads:
            raise CheckpointError(f"config: num_attention_heads={self.num_heads} is not a multiple "
                                  f"of num_key_value_heads={self.num_kv_heads}")
        if self.head_dim % 2:
            raise CheckpointError(f"config: head_dim={self.head_dim} must be even for rotary")
        if len(self.layer_windows) != self.num_layers or len(self.layer_rope) != self.num_layers:
            raise CheckpointError(f"config: layer_types has {len(self.layer_windows)} entries, "
                                  f"expected num_hidden_layers={self.num_layers}")


def get(hf: dict, key: str, default: Any) -> Any:
    """hf[key], or ``default`` when the key is missing or null (as HF config defaults do)."""
    value = hf.get(key)
    return default if value is None else value


def as_int(hf: dict, key: str, default: Any) -> int:
    value = get(hf, key, default)
    try:
        return int(value)
    except (TypeError, ValueError):
        raise CheckpointError(f"config: {key}={value!r} is not an integer") from None


def layer_kinds(hf: dict, num_layers: int, default: list[str],
                allowed: tuple[str, ...] = (FULL, SLIDING)) -> list[str]:
    kinds = hf.get("layer_types") or default
    if not isinstance(kinds, list):
        raise CheckpointError(f"config: layer_types={kinds!r} must be a list")
    bad = [k for k in kinds if k not in allowed]
    if bad:
        raise CheckpointError(f"config: unsupported layer_types {sorted(set(map(str, bad)))}")
    if len(kinds) != num_layers:
        raise CheckpointError(f"config: layer_types has {len(kinds)} entries, "
                              f"expected num_hidden_layers={num_layers}")
    return list(kinds)


def rope_params(hf: dict, kind: Optional[str], default_theta: float,
                theta_key: str = "rope_theta", use_scaling: bool = True) -> dict:
    """HF rope parameters for one layer kind, from either config layout.

    transformers 5 writes ``rope_parameters`` (flat, or nested per layer kind);
    older checkpoints write ``rope_theta`` (+ ``rope_local_base_freq``) and ``rope_scaling``.
    """
    new = hf.get("rope_parameters")
    if isinstance(new, dict) and new:
        nested = set(new) <= {FULL, SLIDING}
        params = dict((new.get(kind) if nested else new) or {})
    else:
        params = dict(hf.get("rope_scaling") or {}) if use_scaling else {}
    params.setdefault("rope_theta", get(hf, theta_key, default_theta))
    params["rope_type"] = params.get("rope_type") or params.get("type") or "default"
    return params


@dataclass(frozen=True)
class MoeSpec:
    """The routed experts of an MoE family's sparse layers (``layers/moe.FusedMoE``)."""

    num_experts: int
    top_k: int  # experts per token
    intermediate_size: int  # each expert's, before the tensor-parallel split
    hidden_act: str = "silu"
    norm_topk_prob: bool = False  # renormalise the k chosen weights to sum to 1
    router_bias: bool = False  # the router linear has a bias
    expert_bias: bool = False  # each expert's gate/up and down products have biases
    # gpt-oss's clamped SwiGLU in place of act(gate) * up (``layers/activation.ClampedSwiGLU``)
    swiglu_alpha: Optional[float] = None
    swiglu_limit: Optional[float] = None


@dataclass(frozen=True)
class MlaSpec:
    """Multi-head latent attention's widths (DeepSeek-V2/V3, ``layers/mla.py``)."""

    q_lora_rank: Optional[int]  # None: q_proj straight from the hidden state (V2-Lite)
    kv_lora_rank: int  # the compressed latent each position caches
    qk_nope_head_dim: int
    qk_rope_head_dim: int  # the rotated part of q/k; k's is one head shared by all
    v_head_dim: int
    rope_interleave: bool = True  # the checkpoint's rope dims come in (even, odd) pairs

    @property
    def latent_width(self) -> int:
        """One position's cache row: the latent, then the rotated rope key."""
        return self.kv_lora_rank + self.qk_rope_head_dim


@dataclass
class MoeArchConfig(ArchConfig):
    """An ArchConfig whose layers ``sparse_layers[i]`` route to experts; the others keep
    a dense MLP of ``intermediate_size``."""

    moe: Optional[MoeSpec] = None
    sparse_layers: list[bool] = field(default_factory=list)

    def tp_splits(self) -> dict[str, int]:
        splits = {}
        if not all(self.sparse_layers):
            splits["intermediate_size"] = self.intermediate_size
        if any(self.sparse_layers):
            splits["moe_intermediate_size"] = self.moe.intermediate_size
        return splits

    def validate(self) -> None:
        super().validate()
        if len(self.sparse_layers) != self.num_layers:
            raise CheckpointError(f"config: {len(self.sparse_layers)} MoE layer flags for "
                                  f"{self.num_layers} layers")
        if any(self.sparse_layers):
            m = self.moe
            for name in ("num_experts", "top_k", "intermediate_size"):
                if not isinstance(getattr(m, name), int) or getattr(m, name) < 1:
                    raise CheckpointError(f"config: MoE {name}={getattr(m, name)!r} must be "
                                          "a positive integer")
            if m.top_k > m.num_experts:
                raise CheckpointError(f"config: num_experts_per_tok={m.top_k} exceeds "
                                      f"num_experts={m.num_experts}")


def resolve(info: ModelInfo, part: str) -> Any:
    """The family's ``model`` class or ``config_parser``, imported from its module path."""
    if info.architecture not in BY_ARCHITECTURE:
        raise UnsupportedFeatureError(
            f"architecture {info.architecture!r} has no model here; "
            f"supported: {', '.join(sorted(BY_ARCHITECTURE))}")
    module, _, attribute = getattr(BY_ARCHITECTURE[info.architecture], part).partition(":")
    return getattr(importlib.import_module(module), attribute)


def arch_config(info: ModelInfo) -> ArchConfig:
    cfg = resolve(info, "config_parser")(info.hf_config, info.architecture)
    cfg.validate()
    return cfg
