"""The config parser of Gemma 3 (text; ``gemma3.py`` builds the model): no torch, so the
torch-free worker (``workers/lite``) reads configs with it too."""

from __future__ import annotations

from pocketllm.errors import UnsupportedFeatureError

from .config import FULL, SLIDING, ArchConfig, as_int, get, layer_kinds, rope_params


def gemma3_arch_config(hf: dict, architecture: str) -> ArchConfig:
    """Defaults are transformers' Gemma3TextConfig's."""
    if hf.get("use_bidirectional_attention"):
        raise UnsupportedFeatureError("Gemma 3 with use_bidirectional_attention (an embedding "
                                      "model) cannot generate text")
    layers = as_int(hf, "num_hidden_layers", 26)
    pattern = as_int(hf, "sliding_window_pattern", 6)
    kinds = layer_kinds(hf, layers, [SLIDING if (i + 1) % pattern else FULL for i in range(layers)])
    window = hf.get("sliding_window", 4096)
    hidden = as_int(hf, "hidden_size", 2304)
    bias = bool(get(hf, "attention_bias", False))
    attn_cap, final_cap = hf.get("attn_logit_softcapping"), hf.get("final_logit_softcapping")
    return ArchConfig(
        architecture=architecture,
        vocab_size=as_int(hf, "vocab_size", 262_208),
        hidden_size=hidden,
        intermediate_size=as_int(hf, "intermediate_size", 9216),
        num_layers=layers,
        num_heads=as_int(hf, "num_attention_heads", 8),
        num_kv_heads=as_int(hf, "num_key_value_heads", 4),
        head_dim=as_int(hf, "head_dim", 256),
        rms_norm_eps=float(get(hf, "rms_norm_eps", 1e-6)),
        hidden_act=str(get(hf, "hidden_activation", "gelu_pytorch_tanh")),
        max_position_embeddings=as_int(hf, "max_position_embeddings", 131_072),
        tie_word_embeddings=bool(get(hf, "tie_word_embeddings", True)),
        attn_scale=float(get(hf, "query_pre_attn_scalar", 256)) ** -0.5,
        layer_windows=[int(window) if k == SLIDING and window is not None else None for k in kinds],
        layer_rope=kinds,
        # Global layers: rope_theta (+ rope_scaling); local layers: rope_local_base_freq.
        rope={FULL: rope_params(hf, FULL, 1_000_000.0),
              SLIDING: rope_params(hf, SLIDING, 10_000.0, "rope_local_base_freq", use_scaling=False)},
        qkv_bias=bias,
        o_bias=bias,
        qk_norm=True,
        embed_scale=hidden ** 0.5,
        attn_softcap=None if attn_cap is None else float(attn_cap),
        final_softcap=None if final_cap is None else float(final_cap),
        norm_weight_offset=1.0,  # checkpoints store w of (1 + w)
    )
