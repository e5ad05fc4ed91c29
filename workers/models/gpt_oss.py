"""gpt-oss (gpt-oss-20b, gpt-oss-120b): attention with sinks, alternating sliding-window and
full layers, q/k/v/o biases, YaRN rope; every layer routes to experts with biases through
gpt-oss's router (top-k of the logits, softmax over those k) and its clamped SwiGLU.

The seams it plugs into: the sinks travel with each attention call (``layers/attention``,
``AttentionBackend.forward(..., sinks=)``); the experts are ``layers/moe.FusedMoE`` with
``MoeSpec.router_bias / expert_bias / swiglu_*``; the layer kinds are per-layer KV cache
groups, as Gemma 3's.

Checkpoint format (as transformers saves it): each layer's experts are three stacked
tensors, ``mlp.experts.gate_up_proj`` [E, H, 2I] whose last dimension interleaves gate and
up columns (gate at even indices), ``gate_up_proj_bias`` [E, 2I] likewise, and
``down_proj`` [E, I, H] with ``down_proj_bias`` [E, H]; the loader de-interleaves and
transposes them into FusedMoE's [gate | up] rows. The released files store the experts
in MXFP4 (``quantization_config.quant_method`` "mxfp4": ``*_blocks`` / ``*_scales``
tensors): they are dequantized at load (``loader/mxfp4.py``) into the model dtype, so
the experts take their float size in memory; any other quantization is refused.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Optional

import torch

from pocketllm.errors import CheckpointError

from ..distributed import TPGroup
from ..layers.attention import AttentionBackend
from ..layers.linear import Shard
from ..layers.moe import FusedMoE, topk_softmax
from ..loader.mxfp4 import SUFFIXES, dequantized
from .base import CausalLM, DecoderLayer, PreNormDecoderLayer
from .weight_targets import WeightTarget
from .config import (FULL, SLIDING, MoeArchConfig, MoeSpec, as_int, get, layer_kinds,
                     rope_params)


# The parameters an MXFP4 checkpoint may quantize (transformers' Mxfp4GptOssExperts).
_MXFP4_PARAMS = ("mlp.experts.gate_up_proj", "mlp.experts.down_proj")


@dataclass
class GptOssArchConfig(MoeArchConfig):
    mxfp4: bool = False  # the experts are stored in MXFP4 (dequantized at load)


def _is_mxfp4(hf: dict) -> bool:
    """Whether the checkpoint stores its experts in MXFP4; any other quantization is refused."""
    quant = hf.get("quantization_config")
    if not quant:
        return False
    method = quant.get("quant_method") if isinstance(quant, dict) else quant
    if method != "mxfp4":
        raise CheckpointError(
            f"gpt-oss checkpoint with quantization_config.quant_method={method!r} is not "
            "supported; MXFP4 (the released files) and unquantized checkpoints are")
    return True


def gpt_oss_arch_config(hf: dict, architecture: str) -> GptOssArchConfig:
    """Defaults are transformers' GptOssConfig's (``num_experts`` is read as
    ``num_local_experts``, as its attribute map does). ``hidden_act`` is not read: the
    experts always apply the clamped SwiGLU, as transformers' do."""
    mxfp4 = _is_mxfp4(hf)
    layers = as_int(hf, "num_hidden_layers", 36)
    heads = as_int(hf, "num_attention_heads", 64)
    hidden = as_int(hf, "hidden_size", 2880)
    # GptOssConfig: 64 when absent, hidden_size // heads only when written as null
    head_dim = hidden // max(heads, 1) if "head_dim" in hf and hf["head_dim"] is None \
        else as_int(hf, "head_dim", 64)
    kinds = layer_kinds(hf, layers, [SLIDING if (i + 1) % 2 else FULL for i in range(layers)])
    window = hf.get("sliding_window", 128)
    if window is None and SLIDING in kinds:
        raise CheckpointError("config: layer_types has sliding_attention layers but "
                              "sliding_window is null")
    rope = rope_params(hf, None, 150000.0)
    if "rope_parameters" not in hf and not hf.get("rope_scaling"):
        # transformers' GptOssConfig default: YaRN x32 over a 4096-token original context
        rope.update(rope_type="yarn", factor=32.0, beta_fast=32.0, beta_slow=1.0,
                    truncate=False, original_max_position_embeddings=4096)
    inter = as_int(hf, "intermediate_size", 2880)
    bias = bool(get(hf, "attention_bias", True))
    return GptOssArchConfig(
        architecture=architecture,
        vocab_size=as_int(hf, "vocab_size", 201088),
        hidden_size=hidden,
        intermediate_size=inter,
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=as_int(hf, "num_key_value_heads", 8),
        head_dim=head_dim,
        rms_norm_eps=float(get(hf, "rms_norm_eps", 1e-5)),
        hidden_act="silu",
        max_position_embeddings=as_int(hf, "max_position_embeddings", 131072),
        tie_word_embeddings=bool(get(hf, "tie_word_embeddings", False)),
        attn_scale=head_dim ** -0.5,
        layer_windows=[int(window) if k == SLIDING else None for k in kinds],
        layer_rope=["default"] * layers,
        rope={"default": rope},
        qkv_bias=bias,
        o_bias=bias,
        attn_sinks=True,
        moe=MoeSpec(num_experts=as_int(hf, "num_local_experts", as_int(hf, "num_experts", 128)),
                    top_k=as_int(hf, "num_experts_per_tok", 4), intermediate_size=inter,
                    router_bias=True, expert_bias=True,
                    swiglu_alpha=float(get(hf, "swiglu_alpha", 1.702)),
                    swiglu_limit=float(get(hf, "swiglu_limit", 7.0))),
        sparse_layers=[True] * layers,
        mxfp4=mxfp4,
    )


def _deinterleave(t: torch.Tensor) -> torch.Tensor:
    """[..., 2I] with gate at even and up at odd indices -> [..., 2I] as [gate | up]."""
    return torch.cat((t[..., 0::2], t[..., 1::2]), dim=-1)


def _gate_up_rows(t: torch.Tensor) -> torch.Tensor:
    """gate_up_proj [E, H, 2I] (interleaved) -> w13 [E, 2I, H] ([gate | up] rows)."""
    return _deinterleave(t).transpose(1, 2)


def _down_rows(t: torch.Tensor) -> torch.Tensor:
    """down_proj [E, I, H] -> w2 [E, H, I]."""
    return t.transpose(1, 2)


class GptOssExperts(FusedMoE):
    """FusedMoE reading gpt-oss's stacked, interleaved checkpoint tensors."""

    def weight_targets(self, prefix: str) -> dict:
        inter = self.inter
        # This rank's intermediate columns [start, stop) are, interleaved, the contiguous
        # range [2 start, 2 stop) of the gate_up last dimension.
        pairs = None if inter.whole else Shard(2, 2 * inter.start, 2 * inter.stop, 2 * inter.full)
        bias_pairs = None if inter.whole else Shard(1, 2 * inter.start, 2 * inter.stop,
                                                    2 * inter.full)
        down = None if inter.whole else Shard(1, inter.start, inter.stop, inter.full)
        p = f"{prefix}experts."
        e, hidden = self.w13.shape[0], self.w13.shape[2]
        return {
            f"{prefix}router.weight": WeightTarget(self.gate),
            f"{prefix}router.bias": WeightTarget(self.gate_bias),
            f"{p}gate_up_proj": WeightTarget(self.w13, shard=pairs, transform=_gate_up_rows,
                                             stored_shape=(e, hidden, 2 * inter.full)),
            f"{p}gate_up_proj_bias": WeightTarget(self.b13, shard=bias_pairs,
                                                  transform=_deinterleave),
            f"{p}down_proj": WeightTarget(self.w2, shard=down, transform=_down_rows,
                                          stored_shape=(e, inter.full, hidden)),
            f"{p}down_proj_bias": WeightTarget(self.b2),
        }


class GptOssForCausalLM(CausalLM):
    def make_layer(self, cfg: MoeArchConfig, index: int, backend: AttentionBackend,
                   device: torch.device, dtype: torch.dtype, tp: TPGroup) -> DecoderLayer:
        return PreNormDecoderLayer(
            cfg, index, backend, device, dtype, tp,
            GptOssExperts(cfg.hidden_size, cfg.moe, topk_softmax, device, dtype, tp))

    def load_weights(self, named_tensors: Iterable) -> None:
        if self.cfg.mxfp4:  # each *_blocks/*_scales pair arrives as its float tensor
            named_tensors = dequantized(self._mxfp4_parts_only(named_tensors))
        super().load_weights(named_tensors)

    @staticmethod
    def _mxfp4_parts_only(named_tensors: Iterable) -> Iterable:
        for name, tensor in named_tensors:
            if name.endswith(SUFFIXES) and not name[:-len("_blocks")].endswith(_MXFP4_PARAMS):
                raise CheckpointError(f"MXFP4 tensor {name!r}: only the experts' gate_up_proj "
                                      "and down_proj are read in MXFP4")
            yield name, tensor

    def canonical_name(self, name: str) -> Optional[str]:
        if name.endswith(SUFFIXES):  # MXFP4 parts in a file whose config does not say so
            raise CheckpointError(f"tensor {name!r} is an MXFP4-quantized part, but config.json "
                                  "has no quantization_config with quant_method 'mxfp4'")
        return super().canonical_name(name)
