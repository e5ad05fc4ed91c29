"""Random weights in GGUF block types for the torch-free worker (``--load-format dummy
--quantization q4_k_m``), so a shipped shape runs the CPU's real path (the block
products, the decode stack) without its file: the CPU benchmarks of quantized shapes.

The matrices are ``loader/dummy_blocks``'s random blocks in llama.cpp's types for the
quantization; the norms are the identity, the biases zero, an MoE router float noise
(llama.cpp leaves ``ffn_gate_inp`` in float). Each tensor draws from its own generator
(the seed and its name), so a tensor's values do not depend on the others.
"""

from __future__ import annotations

import zlib

import numpy as np

from ..loader.block_tensor import BlockTensor
from ..loader.dummy_blocks import dummy_block_types, random_block_tensor
from .model import MLP_NORMS, _sparse

DUMMY_STD = 0.02  # the router's spread, as the torch worker's float dummy


def checkpoint_shapes(cfg, family: str) -> dict[str, tuple[int, ...]]:
    """HF name -> shape of every tensor a checkpoint of ``cfg`` holds, for the families
    this worker runs (the torch worker builds a meta model for this:
    ``models.registry.checkpoint_shapes``)."""
    E, D, I = cfg.hidden_size, cfg.head_dim, cfg.intermediate_size
    q, kv = cfg.num_heads * D, cfg.num_kv_heads * D
    shapes = {"model.embed_tokens.weight": (cfg.vocab_size, E), "model.norm.weight": (E,)}
    if not cfg.tie_word_embeddings:
        shapes["lm_head.weight"] = (cfg.vocab_size, E)
    sparse = _sparse(cfg)
    norms = ["input_layernorm"] + [n for n in MLP_NORMS[family] if n]
    for i in range(cfg.num_layers):
        p, a = f"model.layers.{i}.", f"model.layers.{i}.self_attn."
        shapes.update({p + n + ".weight": (E,) for n in norms})
        shapes.update({a + "q_proj.weight": (q, E), a + "k_proj.weight": (kv, E),
                       a + "v_proj.weight": (kv, E), a + "o_proj.weight": (E, q)})
        if cfg.qkv_bias:
            shapes.update({a + "q_proj.bias": (q,), a + "k_proj.bias": (kv,),
                           a + "v_proj.bias": (kv,)})
        if cfg.o_bias:
            shapes[a + "o_proj.bias"] = (E,)
        if cfg.qk_norm:
            shapes.update({a + "q_norm.weight": (D,), a + "k_norm.weight": (D,)})
        if sparse and sparse[i]:
            moe = cfg.moe
            shapes[p + "mlp.gate.weight"] = (moe.num_experts, E)
            for e in range(moe.num_experts):
                x = f"{p}mlp.experts.{e}."
                shapes.update({x + "gate_proj.weight": (moe.intermediate_size, E),
                               x + "up_proj.weight": (moe.intermediate_size, E),
                               x + "down_proj.weight": (E, moe.intermediate_size)})
            continue
        shapes.update({p + "mlp.gate_proj.weight": (I, E), p + "mlp.up_proj.weight": (I, E),
                       p + "mlp.down_proj.weight": (E, I)})
        if cfg.mlp_bias:
            shapes.update({p + f"mlp.{n}.bias": (I,) for n in ("gate_proj", "up_proj")})
            shapes[p + "mlp.down_proj.bias"] = (E,)
    return shapes


def dummy_weights(cfg, family: str, quantization: str, seed: int
                  ) -> dict[str, "np.ndarray | BlockTensor"]:
    """HF name -> a random tensor of ``cfg``'s shape, as ``load_gguf_weights`` gives a
    file's: ``BlockTensor``s for the matrices ``quantization`` names a type, float32
    arrays for the rest."""
    shapes = checkpoint_shapes(cfg, family)
    types = dummy_block_types(quantization, shapes, cfg.num_layers)
    identity = np.float32(1.0 - cfg.norm_weight_offset)  # Gemma stores w of 1 + w
    weights = {}
    for name, shape in shapes.items():
        rng = np.random.default_rng([seed, zlib.crc32(name.encode())])
        if name in types:
            weights[name] = random_block_tensor(types[name], shape, rng)
        elif name.endswith("norm.weight"):
            weights[name] = np.full(shape, identity, np.float32)
        elif name.endswith(".bias"):
            weights[name] = np.zeros(shape, np.float32)
        else:  # an MoE router
            weights[name] = rng.standard_normal(shape, np.float32) * np.float32(DUMMY_STD)
    return weights
