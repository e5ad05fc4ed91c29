"""The config parser of Llama 2/3, Mistral, Qwen2 and Qwen3 (``llama.py`` builds the model):
no torch, so the torch-free worker (``workers/lite``) reads configs with it too."""

from __future__ import annotations

from .config import FULL, SLIDING, ArchConfig, as_int, get, layer_kinds, rope_params

# transformers' config class defaults for keys a config.json may leave out.
_DEFAULTS = {
    "LlamaForCausalLM": dict(vocab_size=32000, hidden_size=4096, intermediate_size=11008,
                             num_hidden_layers=32, num_attention_heads=32,
                             max_position_embeddings=2048),
    "MistralForCausalLM": dict(vocab_size=32000, hidden_size=4096, intermediate_size=14336,
                               num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                               max_position_embeddings=4096 * 32),
    "Qwen2ForCausalLM": dict(vocab_size=151936, hidden_size=4096, intermediate_size=22016,
                             num_hidden_layers=32, num_attention_heads=32,
                             max_position_embeddings=32768),
    "Qwen3ForCausalLM": dict(vocab_size=151936, hidden_size=4096, intermediate_size=22016,
                             num_hidden_layers=32, num_attention_heads=32, head_dim=128,
                             max_position_embeddings=32768),
}


def llama_arch_config(hf: dict, architecture: str) -> ArchConfig:
    d = _DEFAULTS[architecture]
    hidden = as_int(hf, "hidden_size", d["hidden_size"])
    heads = as_int(hf, "num_attention_heads", d["num_attention_heads"])
    layers = as_int(hf, "num_hidden_layers", d["num_hidden_layers"])
    head_dim = as_int(hf, "head_dim", d.get("head_dim", hidden // max(heads, 1)))
    is_qwen = architecture.startswith("Qwen")
    max_pos = as_int(hf, "max_position_embeddings", d["max_position_embeddings"])
    window = hf.get("sliding_window", 4096 if architecture == "MistralForCausalLM" else None)
    if is_qwen:
        window = window if hf.get("use_sliding_window", False) else None
        first_sliding = as_int(hf, "max_window_layers", 28)
        default_kinds = [SLIDING if window is not None and i >= first_sliding else FULL
                         for i in range(layers)]
    else:  # Mistral: every layer slides when a window is set; Llama: none
        default_kinds = [SLIDING if window is not None else FULL] * layers
    kinds = layer_kinds(hf, layers, default_kinds)
    bias = bool(get(hf, "attention_bias", False)) and architecture != "MistralForCausalLM"
    return ArchConfig(
        architecture=architecture,
        vocab_size=as_int(hf, "vocab_size", d["vocab_size"]),
        hidden_size=hidden,
        intermediate_size=as_int(hf, "intermediate_size", d["intermediate_size"]),
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=as_int(hf, "num_key_value_heads", d.get("num_key_value_heads", heads)),
        head_dim=head_dim,
        rms_norm_eps=float(get(hf, "rms_norm_eps", 1e-6)),
        hidden_act=str(get(hf, "hidden_act", "silu")),
        max_position_embeddings=max_pos,
        tie_word_embeddings=bool(get(hf, "tie_word_embeddings", False)),
        attn_scale=head_dim ** -0.5,
        layer_windows=[int(window) if k == SLIDING and window is not None else None for k in kinds],
        layer_rope=["default"] * layers,
        rope={"default": rope_params(hf, None, 10000.0)},
        qkv_bias=True if architecture == "Qwen2ForCausalLM" else bias,
        o_bias=False if architecture == "Qwen2ForCausalLM" else bias,
        mlp_bias=bool(get(hf, "mlp_bias", False)) if architecture == "LlamaForCausalLM" else False,
        qk_norm=architecture == "Qwen3ForCausalLM",
    )
