"""DeepSeek-V2 and DeepSeek-V3 (V2-Lite, V2, V2.5, V3, R1): multi-head latent attention
(``layers/mla.py``) and DeepSeek's MoE (routed experts plus always-on shared experts).

The two differ only in config, so one module serves both:

* attention: identical MLA; V2's rope dims are always interleaved pairs, V3's unless
  ``rope_interleave`` is false (the loader permutes them to rotate-half either way);
* routing: V2 scores by softmax, greedy or ``group_limited_greedy`` (groups ranked by
  their best expert), never renormalised; V3 scores by sigmoid, chooses by score plus
  ``e_score_correction_bias`` among the ``topk_group`` best of ``n_group`` groups
  (ranked by the sum of their two best), renormalises when ``norm_topk_prob``. Both
  multiply by ``routed_scaling_factor`` (``layers/moe.py``).

Layer i routes to experts when ``i >= first_k_dense_replace`` and ``i % moe_layer_freq
== 0`` (DeepSeek's own rule; transformers reads only the first part, and every released
checkpoint has ``moe_layer_freq`` 1); the others keep a dense MLP of
``intermediate_size``. A sparse layer adds ``n_shared_experts`` x
``moe_intermediate_size`` of shared gated MLP to the routed output before the one
tensor-parallel all-reduce.

V3's multi-token-prediction layer (``model.layers.{num_hidden_layers}.*``) drafts with
``speculative_method="mtp"`` (``mtp_layer.py``), else is skipped.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Optional

import torch
from torch import nn

from pocketllm.errors import CheckpointError, UnsupportedFeatureError

from ..distributed import SINGLE, TPGroup
from ..kernel_policy import policy_for
from ..layers.attention import AttentionBackend
from ..layers.mla import MlaBackend, MLAttention, deinterleave_rope
from ..layers.moe import FusedMoE, SigmoidGroupedTopK, SoftmaxGroupLimitedTopK
from ..layers.norm import RMSNorm
from .base import CausalLM, DecoderLayer, GatedMLP, PreNormDecoderLayer
from .mtp_layer import MTPLayer, MTPNames
from .weight_targets import WeightTarget, row_parallel_targets
from .config import MlaSpec, MoeArchConfig, MoeSpec, as_int, get, rope_params

V2, V3 = "DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM"

# transformers' DeepseekV2Config / DeepseekV3Config defaults for keys a config may omit.
_DEFAULTS = {
    V2: dict(vocab_size=102400, hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
             num_attention_heads=32, max_position_embeddings=2048, first_k_dense_replace=0,
             kv_lora_rank=512, q_lora_rank=1536, n_routed_experts=64, n_shared_experts=2,
             qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
             routed_scaling_factor=1.0, topk_method="greedy", norm_topk_prob=False,
             num_experts_per_tok=None, moe_intermediate_size=1407, n_group=None,
             topk_group=None, scoring_func="softmax"),
    V3: dict(vocab_size=129280, hidden_size=7168, intermediate_size=18432, num_hidden_layers=61,
             num_attention_heads=128, max_position_embeddings=4096, first_k_dense_replace=3,
             kv_lora_rank=512, q_lora_rank=1536, n_routed_experts=256, n_shared_experts=1,
             qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
             routed_scaling_factor=2.5, topk_method="noaux_tc", norm_topk_prob=True,
             num_experts_per_tok=8, moe_intermediate_size=2048, n_group=8, topk_group=4,
             scoring_func="sigmoid"),
}


@dataclass(frozen=True)
class DeepseekRouting:
    """Which routing rule (``layers/moe.py``) a sparse layer uses, and its parameters."""

    scoring: str  # "sigmoid" (V3) or "softmax" (V2)
    group_limited: bool  # choose within the topk_group best of n_group groups
    n_group: int
    topk_group: int
    scaling: float  # routed_scaling_factor
    renormalize: bool  # norm_topk_prob (V3 only)


@dataclass
class DeepseekArchConfig(MoeArchConfig):
    mla: Optional[MlaSpec] = None
    routing: Optional[DeepseekRouting] = None
    n_shared_experts: int = 0
    num_mtp_layers: int = 0  # multi-token-prediction layers past the last (mtp_layer.py)

    def validate(self) -> None:
        if any(self.sparse_layers) and self.moe.top_k is None:
            raise CheckpointError("config: num_experts_per_tok is required for MoE layers "
                                  "(DeepSeek-V2's config has no default)")
        super().validate()

    def tp_splits(self) -> dict[str, int]:
        splits = super().tp_splits()
        if any(self.sparse_layers) and self.n_shared_experts:
            splits["n_shared_experts * moe_intermediate_size"] = (
                self.n_shared_experts * self.moe.intermediate_size)
        return splits


def _positive(hf: dict, key: str, default) -> int:
    value = as_int(hf, key, default)
    if value < 1:
        raise CheckpointError(f"config: {key}={value} must be a positive integer")
    return value


def _refuse(condition: bool, message: str) -> None:
    if condition:
        raise UnsupportedFeatureError(message)


def _yarn_softmax_scale(rope: dict) -> float:
    """transformers' ``yarn_apply_mscale``: a scaled rope with ``mscale_all_dim`` multiplies
    the softmax scale by mscale(factor, mscale_all_dim) squared."""
    m_all = rope.get("mscale_all_dim") or 0
    factor = rope.get("factor")
    if rope["rope_type"] == "default" or not m_all or factor is None or float(factor) <= 1:
        return 1.0
    m = 0.1 * float(m_all) * math.log(float(factor)) + 1.0
    return m * m


def _routing(hf: dict, architecture: str, d: dict, num_experts: int) -> DeepseekRouting:
    scoring = str(get(hf, "scoring_func", d["scoring_func"]))
    method = str(get(hf, "topk_method", d["topk_method"]))
    n_group = as_int(hf, "n_group", 1) if hf.get("n_group") is not None else d["n_group"] or 1
    topk_group = (as_int(hf, "topk_group", 1) if hf.get("topk_group") is not None
                  else d["topk_group"] or 1)
    scaling = float(get(hf, "routed_scaling_factor", d["routed_scaling_factor"]))
    norm = bool(get(hf, "norm_topk_prob", d["norm_topk_prob"]))
    if architecture == V3:
        _refuse(scoring != "sigmoid", f"DeepSeek-V3: scoring_func={scoring!r} is not "
                "supported (V3 routes by sigmoid scores)")
        _refuse(method != "noaux_tc", f"DeepSeek-V3: topk_method={method!r} is not supported "
                "(V3 chooses experts by biased sigmoid scores, 'noaux_tc')")
        grouped = True
    else:
        _refuse(scoring != "softmax", f"DeepSeek-V2: scoring_func={scoring!r} is not "
                "supported (V2 routes by softmax)")
        _refuse(method not in ("greedy", "group_limited_greedy"),
                f"DeepSeek-V2: topk_method={method!r} is not supported (greedy, "
                "group_limited_greedy)")
        _refuse(norm, "DeepSeek-V2: norm_topk_prob=true is not supported (transformers "
                "ignores it for V2, DeepSeek's code renormalises: ambiguous)")
        grouped = method == "group_limited_greedy"
    if grouped:
        if n_group < 1 or num_experts % n_group:
            raise CheckpointError(f"config: n_group={n_group} must divide "
                                  f"n_routed_experts={num_experts}")
        if not 1 <= topk_group <= n_group:
            raise CheckpointError(f"config: topk_group={topk_group} must be in [1, "
                                  f"n_group={n_group}]")
        if architecture == V3 and n_group > 1 and num_experts // n_group < 2:
            raise CheckpointError(f"config: n_group={n_group} leaves fewer than 2 experts per "
                                  "group (a group is scored by its two best)")
    return DeepseekRouting(scoring, grouped and n_group > 1, n_group, topk_group, scaling, norm)


def deepseek_arch_config(hf: dict, architecture: str) -> DeepseekArchConfig:
    d = _DEFAULTS[architecture]
    _refuse(bool(get(hf, "attention_bias", False)), "DeepSeek: attention_bias=true is not "
            "supported (no released checkpoint has it)")
    _refuse(bool(get(hf, "mlp_bias", False)), "DeepSeek: mlp_bias=true is not supported")
    hidden = _positive(hf, "hidden_size", d["hidden_size"])
    heads = _positive(hf, "num_attention_heads", d["num_attention_heads"])
    layers = _positive(hf, "num_hidden_layers", d["num_hidden_layers"])
    q_lora = hf.get("q_lora_rank", d["q_lora_rank"])
    mla = MlaSpec(q_lora_rank=None if q_lora is None else _positive(hf, "q_lora_rank", q_lora),
                  kv_lora_rank=_positive(hf, "kv_lora_rank", d["kv_lora_rank"]),
                  qk_nope_head_dim=_positive(hf, "qk_nope_head_dim", d["qk_nope_head_dim"]),
                  qk_rope_head_dim=_positive(hf, "qk_rope_head_dim", d["qk_rope_head_dim"]),
                  v_head_dim=_positive(hf, "v_head_dim", d["v_head_dim"]),
                  rope_interleave=(True if architecture == V2
                                   else bool(get(hf, "rope_interleave", True))))
    if mla.qk_rope_head_dim % 2:
        raise CheckpointError(f"config: qk_rope_head_dim={mla.qk_rope_head_dim} must be even")
    rope = rope_params(hf, None, 10000.0)
    num_experts = as_int(hf, "n_routed_experts", d["n_routed_experts"]) \
        if hf.get("n_routed_experts", d["n_routed_experts"]) is not None else 0
    first_dense = as_int(hf, "first_k_dense_replace", d["first_k_dense_replace"])
    freq = as_int(hf, "moe_layer_freq", 1)
    if freq < 1 or first_dense < 0:
        raise CheckpointError(f"config: moe_layer_freq={freq} must be at least 1 and "
                              f"first_k_dense_replace={first_dense} not negative")
    sparse = [num_experts > 0 and i >= first_dense and i % freq == 0 for i in range(layers)]
    act = str(get(hf, "hidden_act", "silu"))
    moe, routing = None, None
    if any(sparse):
        top_k = hf.get("num_experts_per_tok", d["num_experts_per_tok"])  # V2: no default
        moe = MoeSpec(num_experts=num_experts,
                      top_k=None if top_k is None else as_int(hf, "num_experts_per_tok", top_k),
                      intermediate_size=as_int(hf, "moe_intermediate_size",
                                               d["moe_intermediate_size"]),
                      hidden_act=act)
        routing = _routing(hf, architecture, d, num_experts)
    return DeepseekArchConfig(
        architecture=architecture,
        vocab_size=as_int(hf, "vocab_size", d["vocab_size"]),
        hidden_size=hidden,
        intermediate_size=as_int(hf, "intermediate_size", d["intermediate_size"]),
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=1,  # one latent row per position, shared by every head
        head_dim=mla.qk_rope_head_dim,  # the rotary's width (as transformers sets head_dim)
        rms_norm_eps=float(get(hf, "rms_norm_eps", 1e-6)),
        hidden_act=act,
        max_position_embeddings=as_int(hf, "max_position_embeddings",
                                       d["max_position_embeddings"]),
        tie_word_embeddings=bool(get(hf, "tie_word_embeddings", False)),
        attn_scale=(mla.qk_nope_head_dim + mla.qk_rope_head_dim) ** -0.5
        * _yarn_softmax_scale(rope),
        layer_windows=[None] * layers,
        layer_rope=["default"] * layers,
        rope={"default": rope},
        moe=moe,
        sparse_layers=sparse,
        mla=mla,
        routing=routing,
        n_shared_experts=as_int(hf, "n_shared_experts", d["n_shared_experts"]) or 0,
        num_mtp_layers=as_int(hf, "num_nextn_predict_layers", 0),
    )


class DeepseekMoE(nn.Module):
    """Routed experts (``FusedMoE``, router in float32 as transformers keeps it) plus the
    shared experts, their partial sums added before one all-reduce."""

    def __init__(self, cfg: DeepseekArchConfig, index: int, device: torch.device,
                 dtype: torch.dtype, tp: TPGroup):
        super().__init__()
        r, moe = cfg.routing, cfg.moe
        if r.scoring == "sigmoid":
            routing = SigmoidGroupedTopK(moe.num_experts, r.n_group, r.topk_group,
                                         r.renormalize, r.scaling, device)
        else:
            routing = SoftmaxGroupLimitedTopK(r.group_limited, r.n_group, r.topk_group, r.scaling)
        self.experts = FusedMoE(cfg.hidden_size, moe, routing, device, dtype, tp,
                                router_dtype=torch.float32)
        self.tp = tp
        self.shared_experts: Optional[GatedMLP] = None
        if cfg.n_shared_experts:
            shared = dataclasses.replace(cfg, intermediate_size=cfg.n_shared_experts
                                         * moe.intermediate_size)
            self.shared_experts = GatedMLP(shared, device, dtype, tp)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.experts(x, reduce=False)
        if self.shared_experts is not None:
            out = out + self.shared_experts(x, reduce=False)
        return self.tp.all_reduce(out)

    def normed(self, norm: RMSNorm, x: torch.Tensor, residual: torch.Tensor
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(self(norm(x + residual)), x + residual)``."""
        h, residual = norm.add(x, residual)
        return self(h), residual

    def weight_targets(self, prefix: str) -> dict[str, WeightTarget]:
        t = self.experts.weight_targets(prefix)
        if isinstance(self.experts.routing, SigmoidGroupedTopK):
            t[f"{prefix}gate.e_score_correction_bias"] = WeightTarget(self.experts.routing.bias)
        if self.shared_experts is not None:
            t.update(self.shared_experts.weight_targets(f"{prefix}shared_experts."))
        return t


class DeepseekForCausalLM(CausalLM):
    """Attends through its own MLA backend (block-table metadata on every device, the
    decode kernel the policy picks), whatever backend the runner offered."""

    def __init__(self, cfg: DeepseekArchConfig, backend: AttentionBackend,
                 device: torch.device, dtype: torch.dtype, tp: TPGroup = SINGLE):
        policy = policy_for(device)
        if policy.batch_invariant:
            raise UnsupportedFeatureError(
                f"batch_invariant is not supported for {cfg.architecture}: multi-head latent "
                "attention computes a decode row in the absorbed form and the same row inside "
                "a prefill chunk in the expanded form, which round differently",
                "batch_invariant")
        decode = policy.mla_decode(cfg.mla.kv_lora_rank, cfg.mla.qk_rope_head_dim)
        super().__init__(cfg, MlaBackend(decode), device, dtype, tp)
        self.latent_cache_width = cfg.mla.latent_width

    def make_layer(self, cfg: DeepseekArchConfig, index: int, backend: MlaBackend,
                   device: torch.device, dtype: torch.dtype, tp: TPGroup) -> DecoderLayer:
        mlp = (DeepseekMoE(cfg, index, device, dtype, tp) if cfg.sparse_layers[index]
               else GatedMLP(cfg, device, dtype, tp))
        attention = MLAttention(cfg.hidden_size, cfg.num_heads, cfg.mla, cfg.attn_scale,
                                backend, device, dtype, tp)
        return PreNormDecoderLayer(cfg, index, backend, device, dtype, tp, mlp, attention)

    def layer_weight_targets(self, p: str, layer: DecoderLayer) -> dict[str, WeightTarget]:
        s, attn = self.cfg.mla, layer.self_attn
        a = f"{p}self_attn."
        q_width, rope = s.qk_nope_head_dim + s.qk_rope_head_dim, s.qk_rope_head_dim

        def permuted(group: int):  # interleaved rope rows -> rotate-half (layers/mla.py)
            return (lambda w: deinterleave_rope(w, group, rope)) if s.rope_interleave else None

        t: dict[str, WeightTarget] = {}
        if s.q_lora_rank is None:
            t[f"{a}q_proj.weight"] = WeightTarget(attn.a_proj.weight, attn.a_proj.out_rows(0),
                                                  permuted(q_width), attn.a_proj.part_shard(0))
        else:
            t[f"{a}q_a_proj.weight"] = WeightTarget(attn.a_proj.weight, attn.a_proj.out_rows(0))
            t[f"{a}q_a_layernorm.weight"] = WeightTarget(attn.q_a_layernorm.weight)
            t[f"{a}q_b_proj.weight"] = WeightTarget(attn.q_b_proj.weight, None, permuted(q_width),
                                                    attn.q_b_proj.part_shard(0))
        t[f"{a}kv_a_proj_with_mqa.weight"] = WeightTarget(
            attn.a_proj.weight, attn.a_proj.out_rows(1), permuted(s.latent_width))
        t[f"{a}kv_a_layernorm.weight"] = WeightTarget(attn.kv_a_layernorm.weight)
        t[f"{a}kv_b_proj.weight"] = WeightTarget(attn.kv_b_proj.weight,
                                                 shard=attn.kv_b_proj.part_shard(0))
        row_parallel_targets(t, f"{a}o_proj.", attn.o_proj)
        t.update(layer.mlp.weight_targets(f"{p}mlp."))
        for norm in layer.norm_names:
            t[f"{p}{norm}.weight"] = WeightTarget(getattr(layer, norm).weight)
        return t

    def build_mtp(self, backend: AttentionBackend) -> MTPLayer:
        """The first of the checkpoint's MTP layers (V3 ships one), attending through this
        model's MLA backend."""
        if self.cfg.num_mtp_layers < 1:
            raise UnsupportedFeatureError(
                f"speculative_method='mtp': this {self.cfg.architecture} checkpoint has no "
                "MTP layer (its config's num_nextn_predict_layers is 0 or absent)",
                "speculative_method")
        cfg = dataclasses.replace(self.cfg, num_layers=1, layer_windows=[None],
                                  layer_rope=["default"],
                                  sparse_layers=[any(self.cfg.sparse_layers)])
        names = MTPNames(f"model.layers.{self.cfg.num_layers}.", "enorm", "hnorm", "eh_proj",
                         "", "shared_head.norm", shared=("embed_tokens.", "shared_head.head."))
        self.mtp = MTPLayer(self, self.attention_backend, cfg, names)
        return self.mtp

    def canonical_name(self, name: str) -> Optional[str]:
        # DeepSeek-V3's multi-token-prediction layers follow the last layer
        # (model.layers.61.* of V3); they predict further tokens for speculation only.
        if name.startswith("model.layers.") and self.cfg.num_mtp_layers:
            index = int(name.split(".")[2])
            if index == self.cfg.num_layers:
                return self.mtp_tensor(name)
            if self.cfg.num_layers < index < self.cfg.num_layers + self.cfg.num_mtp_layers:
                return None  # more than one: only the first drafts
        return super().canonical_name(name)
