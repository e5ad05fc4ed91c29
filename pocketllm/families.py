"""The one model registry: each family PocketLLM serves, declared once, readable without torch.

A ``Family`` names its checkpoints (HF and GGUF architectures), how llama.cpp's metadata and
tensor names map back to HF's, its built-in chat template, and its model class and config
parser by module path, which only the worker imports (workers/models/registry.py).
Adding a family: one entry below plus its model module."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Optional

_WORKERS = "pocketllm.workers"
_MODELS = f"{_WORKERS}.models"

# GGUF tensors outside the layers, named alike by every family: GGUF name -> HF name.
GGUF_GLOBAL_TENSORS = {"token_embd.weight": "model.embed_tokens.weight",
                       "output_norm.weight": "model.norm.weight", "output.weight": "lm_head.weight"}

# Tensors llama.cpp derives from the config, not HF parameters: rope_freqs holds Llama 3.1's
# rope scaling factors, which the HF model recomputes from config["rope_scaling"].
GGUF_DERIVED_TENSORS = frozenset({"rope_freqs.weight"})

# blk.{i}.<gguf> -> model.layers.{i}.<hf>, for the pre-norm decoder; .weight / .bias is kept.
_LLAMA_TENSORS = {
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj", "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}


@dataclass(frozen=True)
class Family:
    name: str
    architectures: tuple[str, ...]  # HF config.json "architectures"; the first is the canonical one
    model: str  # the worker's CausalLM subclass, "module:attribute"
    config_parser: str  # (hf_config, architecture) -> ArchConfig, "module:attribute"
    gguf_architecture: Optional[str] = None  # GGUF general.architecture; None: no GGUF files
    gguf_model_type: Optional[str] = None  # HF model_type from GGUF; None: gguf_architecture
    # Adds the family's keys to a config from GGUF; g(key, default) reads "<gguf_arch>.<key>".
    gguf_config: Optional[Callable[[dict, Callable[..., Any]], None]] = None
    gguf_tensors: Mapping[str, str] = field(default_factory=lambda: _LLAMA_TENSORS)
    gguf_permuted_qk: bool = False  # llama.cpp permuted q/k rows per head (loader undoes it)
    gguf_norm_offset: float = 0.0  # llama.cpp stored (1 + w) norms as w + 1 (loader subtracts)
    # MoE: GGUF names of a layer's experts stacked [E, rows, cols] -> the HF projection each
    # expert's slice becomes (model.layers.{i}.mlp.experts.{e}.<proj>.weight)
    gguf_expert_tensors: Mapping[str, str] = field(default_factory=dict)
    # GGUF tensors a family maps itself (renamed, reshaped, reordered): "module:attribute"
    # of (gguf_name, tensor, hf_config) -> [(HF name, tensor)], or None for the default path
    gguf_tensor_hook: Optional[str] = None
    text_tower: tuple[str, ...] = ()  # multimodal architectures: serve config.json's text_config
    template: Optional[str] = None  # built-in chat template (pocketllm/templates/), if none shipped
    template_stop: Optional[str] = None  # the token that ends an assistant turn in it


def _gemma3_gguf(cfg: dict, g: Callable[..., Any]) -> None:
    cfg["sliding_window"] = int(g("attention.sliding_window", 4096))
    cfg["query_pre_attn_scalar"] = cfg["head_dim"]  # llama.cpp scales queries by 1/sqrt(head_dim)


def _qwen3moe_gguf(cfg: dict, g: Callable[..., Any]) -> None:
    """llama.cpp always renormalises the chosen experts' weights for qwen3moe and writes no
    key for it: norm_topk_prob is true unless a file says otherwise."""
    def need(key: str) -> int:
        if g(key) is None:
            from .errors import CheckpointError

            raise CheckpointError(f"GGUF qwen3moe file lacks the metadata key qwen3moe.{key}")
        return int(g(key))

    cfg.update(num_experts=need("expert_count"), num_experts_per_tok=need("expert_used_count"),
               moe_intermediate_size=need("expert_feed_forward_length"),
               norm_topk_prob=bool(g("expert_weights_norm", True)))


def _hybrid_gguf(cfg: dict, g: Callable[..., Any]) -> None:
    """Qwen3.5 / Qwen3-Next: the linear-attention widths (llama.cpp's ssm.* keys), which
    layers are recurrent, the partial rotary, the shared expert; and how the converter laid
    out the linear-attention projections (``qwen3_5_config.IN_PROJ_LAYOUTS``)."""
    from .errors import CheckpointError

    def need(key: str) -> Any:
        if g(key) is None:
            raise CheckpointError(f"this GGUF file lacks the metadata key {key!r}")
        return g(key)

    heads_k, heads_v = int(need("ssm.group_count")), int(need("ssm.time_step_rank"))
    cfg.update(linear_num_key_heads=heads_k, linear_num_value_heads=heads_v,
               linear_key_head_dim=int(need("ssm.state_size")),
               linear_value_head_dim=int(need("ssm.inner_size")) // heads_v,
               linear_conv_kernel_dim=int(need("ssm.conv_kernel")))
    # the converter appends the multi-token-prediction layers as blocks of their own
    mtp = int(g("nextn_predict_layers", 0) or 0)
    if mtp:
        cfg["num_hidden_layers"] -= mtp
        cfg["mtp_num_hidden_layers"] = mtp
    recurrent = g("attention.recurrent_layers")
    if recurrent is not None:
        cfg["layer_types"] = ["linear_attention" if r else "full_attention"
                              for r in list(recurrent)[:cfg["num_hidden_layers"]]]
    else:
        cfg["full_attention_interval"] = int(need("full_attention_interval"))
    cfg["partial_rotary_factor"] = int(need("rope.dimension_count")) / cfg["head_dim"]
    if g("expert_count") is not None:
        cfg.update(num_experts=int(g("expert_count")), num_experts_per_tok=int(need("expert_used_count")),
                   moe_intermediate_size=int(need("expert_feed_forward_length")),
                   shared_expert_intermediate_size=int(g("expert_shared_feed_forward_length", 0)))
    # qwen3next: in_proj_qkvz split into a plain q/k/v and z, b/a still interleaved per key
    # head; qwen35(moe): plain, but the value heads tiled (gguf_hybrid.py undoes that)
    cfg["linear_in_proj_layout"] = "qkv_z_ba" if cfg["model_type"] == "qwen3_next" else "qkv_z_b_a"


def _deepseek2_gguf(cfg: dict, g: Callable[..., Any]) -> None:
    """Refused: llama.cpp's deepseek2 files do not map cleanly onto the HF tensors."""
    from .errors import CheckpointError

    raise CheckpointError(
        "GGUF deepseek2 files are not supported: llama.cpp stores kv_b_proj split per head "
        "into attn_k_b (transposed) and attn_v_b in newer files and whole in older ones, and "
        "its expert gating (expert_gating_func, expert_weights_scale) in keys of its own; "
        "load the safetensors checkpoint instead")


_LLAMA = (f"{_MODELS}.llama:LlamaForCausalLM", f"{_MODELS}.llama_config:llama_arch_config")

FAMILIES = (
    Family("llama", ("LlamaForCausalLM", "MistralForCausalLM"), *_LLAMA,
           gguf_architecture="llama", gguf_permuted_qk=True),
    Family("qwen2", ("Qwen2ForCausalLM",), *_LLAMA, gguf_architecture="qwen2"),
    Family("qwen3", ("Qwen3ForCausalLM",), *_LLAMA, gguf_architecture="qwen3"),
    # Gemma 3 norms four times per layer; llama.cpp's ffn_norm is its pre-MLP norm.
    Family("gemma3", ("Gemma3ForCausalLM", "Gemma3ForConditionalGeneration"),
           f"{_MODELS}.gemma3:Gemma3ForCausalLM", f"{_MODELS}.gemma3_config:gemma3_arch_config",
           gguf_architecture="gemma3", gguf_model_type="gemma3_text", gguf_config=_gemma3_gguf,
           gguf_tensors={**_LLAMA_TENSORS, "ffn_norm": "pre_feedforward_layernorm",
                         "post_attention_norm": "post_attention_layernorm",
                         "post_ffw_norm": "post_feedforward_layernorm"},
           gguf_norm_offset=1.0, text_tower=("Gemma3ForConditionalGeneration",),
           template="gemma.jinja", template_stop="<end_of_turn>"),
    # Qwen3-MoE: routed experts (workers/layers/moe.py); the router is ffn_gate_inp.
    Family("qwen3_moe", ("Qwen3MoeForCausalLM",), f"{_MODELS}.qwen3_moe:Qwen3MoeForCausalLM",
           f"{_MODELS}.qwen3_moe_config:qwen3_moe_arch_config", gguf_architecture="qwen3moe",
           gguf_model_type="qwen3_moe", gguf_config=_qwen3moe_gguf,
           gguf_tensors={**_LLAMA_TENSORS, "ffn_gate_inp": "mlp.gate"},
           gguf_expert_tensors={"ffn_gate_exps": "gate_proj", "ffn_up_exps": "up_proj",
                                "ffn_down_exps": "down_proj"}),
    # gpt-oss: attention sinks, a biased router and clamped-SwiGLU experts with biases
    # (workers/models/gpt_oss.py); safetensors only (no GGUF gpt-oss reader here).
    Family("gpt_oss", ("GptOssForCausalLM",), f"{_MODELS}.gpt_oss:GptOssForCausalLM",
           f"{_MODELS}.gpt_oss:gpt_oss_arch_config"),
    # Qwen3.5 / Qwen3.5-MoE / Qwen3-Next: Gated DeltaNet linear attention in three of every
    # four layers, gated full attention in the rest (workers/models/qwen3_5.py). One model,
    # a family per GGUF architecture; a GGUF file runs on the torch worker, dequantized.
    *(Family(name, archs, f"{_MODELS}.qwen3_5:Qwen3_5ForCausalLM",
             f"{_MODELS}.qwen3_5_config:qwen3_5_arch_config", gguf_architecture=garch,
             gguf_model_type=model_type, gguf_config=_hybrid_gguf,
             gguf_tensors={**_LLAMA_TENSORS, "post_attention_norm": "post_attention_layernorm",
                           "ffn_gate_inp": "mlp.gate"},
             gguf_expert_tensors={"ffn_gate_exps": "gate_proj", "ffn_up_exps": "up_proj",
                                  "ffn_down_exps": "down_proj"},
             gguf_norm_offset=1.0, gguf_tensor_hook=f"{_WORKERS}.loader.gguf_hybrid:hybrid_tensor",
             text_tower=tower)
      for name, archs, garch, model_type, tower in (
          ("qwen3_5", ("Qwen3_5ForCausalLM", "Qwen3_5ForConditionalGeneration"), "qwen35",
           "qwen3_5_text", ("Qwen3_5ForConditionalGeneration",)),
          ("qwen3_5_moe", ("Qwen3_5MoeForCausalLM", "Qwen3_5MoeForConditionalGeneration"),
           "qwen35moe", "qwen3_5_moe_text", ("Qwen3_5MoeForConditionalGeneration",)),
          ("qwen3_next", ("Qwen3NextForCausalLM",), "qwen3next", "qwen3_next", ()))),
    # DeepSeek-V2/V3: multi-head latent attention (workers/layers/mla.py) + DeepSeek MoE.
    Family("deepseek", ("DeepseekV3ForCausalLM", "DeepseekV2ForCausalLM"),
           f"{_MODELS}.deepseek:DeepseekForCausalLM", f"{_MODELS}.deepseek:deepseek_arch_config",
           gguf_architecture="deepseek2", gguf_config=_deepseek2_gguf),
)

BY_NAME = {f.name: f for f in FAMILIES}
BY_ARCHITECTURE = {a: f for f in FAMILIES for a in f.architectures}
BY_GGUF = {f.gguf_architecture: f for f in FAMILIES if f.gguf_architecture}


def hf_config_from_gguf(family: Family, meta: dict) -> dict:
    """An HF-style config.json rebuilt from a GGUF file's metadata."""
    def g(key: str, default: Any = None) -> Any:
        return meta.get(f"{family.gguf_architecture}.{key}", default)

    n_heads = int(g("attention.head_count"))
    hidden = int(g("embedding_length"))
    cfg: dict[str, Any] = {
        "architectures": [family.architectures[0]],
        "model_type": family.gguf_model_type or family.gguf_architecture,
        "hidden_size": hidden, "num_hidden_layers": int(g("block_count")),
        # an all-MoE file may carry no dense width
        "intermediate_size": int(g("feed_forward_length", g("expert_feed_forward_length", 0))),
        "num_attention_heads": n_heads,
        "num_key_value_heads": int(g("attention.head_count_kv", n_heads)),
        "head_dim": int(g("attention.key_length", hidden // n_heads)),
        "rms_norm_eps": float(g("attention.layer_norm_rms_epsilon", 1e-6)),
        "rope_theta": float(g("rope.freq_base", 10000.0)),
        "max_position_embeddings": int(g("context_length", 4096)),
        "vocab_size": int(meta.get("tokenizer.ggml.vocab_size")
                          or len(meta.get("tokenizer.ggml.tokens", [])) or g("vocab_size")),
        "bos_token_id": meta.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": meta.get("tokenizer.ggml.eos_token_id"),
        "tie_word_embeddings": not meta.get("__has_output_weight", False),
    }
    if family.gguf_config is not None:
        family.gguf_config(cfg, g)
    scaling_type = g("rope.scaling.type")
    if scaling_type in ("linear", "yarn"):
        cfg["rope_scaling"] = {"rope_type": scaling_type, "factor": float(g("rope.scaling.factor"))}
    return cfg
