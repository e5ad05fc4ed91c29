"""The config parser of Qwen3-MoE (``qwen3_moe.py`` builds the model): no torch, so the
torch-free worker (``workers/lite``) reads configs with it too.

Which layers are sparse follows transformers: layer i routes to experts unless it is in
``mlp_only_layers`` or ``(i + 1) % decoder_sparse_step != 0`` (or ``num_experts`` is 0);
the others keep a dense gated MLP of ``intermediate_size``. ``use_sliding_window`` slides
every layer's window, as transformers does.
"""

from __future__ import annotations

from pocketllm.errors import CheckpointError

from .config import FULL, SLIDING, MoeArchConfig, MoeSpec, as_int, get, layer_kinds, rope_params


def _sparse_layers(hf: dict, layers: int, num_experts: int) -> list[bool]:
    step = as_int(hf, "decoder_sparse_step", 1)
    if step < 1:
        raise CheckpointError(f"config: decoder_sparse_step={step} must be at least 1")
    dense = hf.get("mlp_only_layers") or []
    if not isinstance(dense, list) or not all(isinstance(i, int) for i in dense):
        raise CheckpointError(f"config: mlp_only_layers={dense!r} must be a list of layer indices")
    return [i not in dense and num_experts > 0 and (i + 1) % step == 0 for i in range(layers)]


def qwen3_moe_arch_config(hf: dict, architecture: str) -> MoeArchConfig:
    """Defaults are transformers' Qwen3MoeConfig's (which also reads ``num_local_experts``
    for ``num_experts``)."""
    hidden = as_int(hf, "hidden_size", 2048)
    heads = as_int(hf, "num_attention_heads", 32)
    layers = as_int(hf, "num_hidden_layers", 24)
    head_dim = as_int(hf, "head_dim", hidden // max(heads, 1))
    num_experts = as_int(hf, "num_experts", as_int(hf, "num_local_experts", 128))
    act = str(get(hf, "hidden_act", "silu"))
    window = hf.get("sliding_window", 4096) if hf.get("use_sliding_window", False) else None
    kinds = layer_kinds(hf, layers, [SLIDING if window is not None else FULL] * layers)
    bias = bool(get(hf, "attention_bias", False))
    return MoeArchConfig(
        architecture=architecture,
        vocab_size=as_int(hf, "vocab_size", 151936),
        hidden_size=hidden,
        intermediate_size=as_int(hf, "intermediate_size", 6144),
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=as_int(hf, "num_key_value_heads", 4),
        head_dim=head_dim,
        rms_norm_eps=float(get(hf, "rms_norm_eps", 1e-6)),
        hidden_act=act,
        max_position_embeddings=as_int(hf, "max_position_embeddings", 32768),
        tie_word_embeddings=bool(get(hf, "tie_word_embeddings", False)),
        attn_scale=head_dim ** -0.5,
        layer_windows=[int(window) if k == SLIDING and window is not None else None for k in kinds],
        layer_rope=["default"] * layers,
        rope={"default": rope_params(hf, None, 10000.0)},
        qkv_bias=bias,
        o_bias=bias,
        qk_norm=True,
        moe=MoeSpec(num_experts=num_experts, top_k=as_int(hf, "num_experts_per_tok", 8),
                    intermediate_size=as_int(hf, "moe_intermediate_size", 768), hidden_act=act,
                    norm_topk_prob=bool(get(hf, "norm_topk_prob", False))),
        sparse_layers=_sparse_layers(hf, layers, num_experts),
    )
