"""The config parser of the hybrid Gated DeltaNet families (``qwen3_5.py`` builds the
model): Qwen3.5 (``qwen3_5_text``, and the text tower of ``qwen3_5``), Qwen3.5-MoE
(``qwen3_5_moe_text``) and Qwen3-Next. No torch here.

Layer ``i`` is linear attention (Gated DeltaNet) or gated full attention, as
``layer_types`` says; without it, every ``full_attention_interval``-th layer (default 4)
is full attention, as transformers fills it. Full attention rotates the first
``partial_rotary_factor`` (default 0.25) of each head. The MoE families route every
``decoder_sparse_step``-th layer's MLP to experts and add a shared expert whose output a
sigmoid gate scales; Qwen3.5-MoE routes every layer.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from pocketllm.errors import CheckpointError

from .config import FULL, LINEAR, MoeArchConfig, MoeSpec, as_int, get, layer_kinds, rope_params
from .qwen3_moe_config import _sparse_layers

MOE_MODEL_TYPES = ("qwen3_5_moe_text", "qwen3_5_moe", "qwen3_next")

# How a checkpoint stores a linear-attention layer's input projections: (tensor, the
# parts it stacks) in the layer's order. Qwen3.5: each part its own tensor, heads in
# order. Qwen3-Next: q/k/v/z and b/a interleaved per key head (the value heads that read
# it, in_proj_qkvz / in_proj_ba). llama.cpp's qwen3next files: q/k/v and z split out in
# head order, b/a still interleaved.
IN_PROJ_LAYOUTS = {"qkv_z_b_a": (("in_proj_qkv", "qkv"), ("in_proj_z", "z"),
                                 ("in_proj_b", "b"), ("in_proj_a", "a")),
                   "qkvz_ba": (("in_proj_qkvz", "qkvz"), ("in_proj_ba", "ba")),
                   "qkv_z_ba": (("in_proj_qkv", "qkv"), ("in_proj_z", "z"), ("in_proj_ba", "ba"))}
INTERLEAVED = ("in_proj_qkvz", "in_proj_ba")


@dataclass(frozen=True)
class GdnSpec:
    """A Gated DeltaNet layer's widths (``layers/linear_attention.py``)."""

    num_k_heads: int  # query/key heads
    num_v_heads: int  # value heads; each group of num_v_heads / num_k_heads shares a q/k head
    k_head_dim: int
    v_head_dim: int
    conv_kernel: int  # taps of the causal convolution over q/k/v
    in_proj_layout: str = "qkv_z_b_a"  # a key of IN_PROJ_LAYOUTS

    @property
    def conv_channels(self) -> int:
        return 2 * self.num_k_heads * self.k_head_dim + self.num_v_heads * self.v_head_dim


@dataclass
class HybridArchConfig(MoeArchConfig):
    gdn: Optional[GdnSpec] = None
    shared_expert_size: int = 0  # the MoE layers' shared expert width (0: none)
    mtp_layers: int = 0  # multi-token-prediction layers the checkpoint ships (mtp_layer.py)

    def tp_splits(self) -> dict[str, int]:
        splits = super().tp_splits()
        if any(self.linear_layers):
            splits["linear_num_key_heads"] = self.gdn.num_k_heads
            splits["linear_num_value_heads"] = self.gdn.num_v_heads
        if self.shared_expert_size and any(self.sparse_layers):
            splits["shared_expert_intermediate_size"] = self.shared_expert_size
        return splits

    def validate(self) -> None:
        super().validate()
        if len(self.linear_layers) != self.num_layers:
            raise CheckpointError(f"config: {len(self.linear_layers)} linear-attention flags "
                                  f"for {self.num_layers} layers")
        if all(self.linear_layers):
            raise CheckpointError("config: every layer is linear attention; this engine needs "
                                  "at least one full-attention layer")
        g = self.gdn
        for name in ("num_k_heads", "num_v_heads", "k_head_dim", "v_head_dim", "conv_kernel"):
            if not isinstance(getattr(g, name), int) or getattr(g, name) < 1:
                raise CheckpointError(f"config: linear attention {name}={getattr(g, name)!r} "
                                      "must be a positive integer")
        if g.num_v_heads % g.num_k_heads:
            raise CheckpointError(f"config: linear_num_value_heads={g.num_v_heads} is not a "
                                  f"multiple of linear_num_key_heads={g.num_k_heads}")


def _in_proj_layout(hf: dict, next_: bool) -> str:
    layout = hf.get("linear_in_proj_layout") or ("qkvz_ba" if next_ else "qkv_z_b_a")
    if layout not in IN_PROJ_LAYOUTS:
        raise CheckpointError(f"config: linear_in_proj_layout={layout!r}; known: "
                              f"{', '.join(IN_PROJ_LAYOUTS)}")
    return layout


def qwen3_5_arch_config(hf: dict, architecture: str) -> HybridArchConfig:
    """Defaults are transformers' Qwen3_5TextConfig's, Qwen3_5MoeTextConfig's and
    Qwen3NextConfig's (which share most of theirs)."""
    model_type = str(hf.get("model_type", ""))
    next_ = model_type == "qwen3_next" or architecture.startswith("Qwen3Next")
    moe = model_type in MOE_MODEL_TYPES or "Moe" in architecture or next_
    hidden = as_int(hf, "hidden_size", 2048 if next_ or moe else 4096)
    layers = as_int(hf, "num_hidden_layers", 48 if next_ else 40 if moe else 32)
    interval = as_int(hf, "full_attention_interval", 4)
    if interval < 1:
        raise CheckpointError(f"config: full_attention_interval={interval} must be at least 1")
    kinds = layer_kinds(hf, layers, [LINEAR if (i + 1) % interval else FULL for i in range(layers)],
                        allowed=(FULL, LINEAR))
    head_dim = as_int(hf, "head_dim", 256)
    act = str(get(hf, "hidden_act", "silu"))
    bias = bool(get(hf, "attention_bias", False))
    rope = rope_params(hf, None, 10_000.0)
    # transformers defaults the partial rotary to 0.25 for these families
    rope.setdefault("partial_rotary_factor", float(get(hf, "partial_rotary_factor", 0.25)))
    rope.pop("mrope_section", None)  # text positions: the three mrope sections coincide
    rope.pop("mrope_interleaved", None)
    num_experts = as_int(hf, "num_experts", 512 if next_ else 256) if moe else 0
    return HybridArchConfig(
        architecture=architecture,
        vocab_size=as_int(hf, "vocab_size", 151_936 if next_ else 248_320),
        hidden_size=hidden,
        intermediate_size=as_int(hf, "intermediate_size", 5632 if next_ else 12288),
        num_layers=layers,
        num_heads=as_int(hf, "num_attention_heads", 16),
        num_kv_heads=as_int(hf, "num_key_value_heads", 2 if moe else 4),
        head_dim=head_dim,
        rms_norm_eps=float(get(hf, "rms_norm_eps", 1e-6)),
        hidden_act=act,
        max_position_embeddings=as_int(hf, "max_position_embeddings", 32_768),
        tie_word_embeddings=bool(get(hf, "tie_word_embeddings", False)),
        attn_scale=head_dim ** -0.5,
        layer_windows=[None] * layers,
        layer_rope=["default"] * layers,
        rope={"default": rope},
        qkv_bias=bias,
        o_bias=bias,
        qk_norm=True,
        norm_weight_offset=1.0,  # (1 + w) norms, as Gemma's
        linear_layers=[k == LINEAR for k in kinds],
        moe=MoeSpec(num_experts=num_experts, top_k=as_int(hf, "num_experts_per_tok", 10 if next_ else 8),
                    intermediate_size=as_int(hf, "moe_intermediate_size", 512), hidden_act=act,
                    # Qwen3.5-MoE always renormalises the chosen experts' weights
                    norm_topk_prob=bool(get(hf, "norm_topk_prob", True)) or not next_)
        if moe else None,
        # Qwen3.5-MoE routes every layer; Qwen3-Next as Qwen3-MoE does
        sparse_layers=(_sparse_layers(hf, layers, num_experts) if next_ else [num_experts > 0] * layers)
        if moe else [False] * layers,
        gdn=GdnSpec(num_k_heads=as_int(hf, "linear_num_key_heads", 16),
                    num_v_heads=as_int(hf, "linear_num_value_heads", 32),
                    k_head_dim=as_int(hf, "linear_key_head_dim", 128),
                    v_head_dim=as_int(hf, "linear_value_head_dim", 128),
                    conv_kernel=as_int(hf, "linear_conv_kernel_dim", 4),
                    in_proj_layout=_in_proj_layout(hf, next_)),
        shared_expert_size=as_int(hf, "shared_expert_intermediate_size", 512) if moe else 0,
        mtp_layers=as_int(hf, "mtp_num_hidden_layers", 0),
    )
