"""The linear-attention tensors of llama.cpp's qwen35 / qwen35moe / qwen3next files, back
to their HF names, shapes and values (``Family.gguf_tensor_hook`` of those families). No
torch here.

What the converter changed, undone:

* ``ssm_a`` holds -exp(A_log): A_log = log(-ssm_a).
* ``ssm_dt.bias`` is dt_bias; ``ssm_conv1d`` lost its middle axis ([C, K] -> [C, 1, K]).
* qwen3next: in_proj_qkvz became ``attn_qkv`` (q, k, v, each in head order) and
  ``attn_gate`` (z); ``ssm_ba`` is in_proj_ba as HF stores it, interleaved per key head
  (the model reads that layout: ``qwen3_5_config.IN_PROJ_LAYOUTS``).
* qwen35 / qwen35moe: the value heads are tiled (head j of key-head group g moved to
  position j * key_heads + g, for ggml's broadcast) in every tensor that holds them: the
  v rows of ``attn_qkv`` and the conv, ``attn_gate``, ``ssm_alpha`` / ``ssm_beta``,
  ``ssm_a`` / ``ssm_dt``, and the columns of ``ssm_out``. They are put back in groups
  (a block tensor keeps its blocks where rows move; ``ssm_out``'s columns are decoded),
  unless the reader asks for them ``as_stored``: the torch-free worker's kernels map a
  value head to its q/k head either way (cpu_quant.h, ``tiled``), and its ``ssm_out``
  stays in blocks.
* the linear-attention norm (``ssm_norm``) multiplies by w, not 1 + w: no offset to take
  off (the other norms' is the family's ``gguf_norm_offset``).
* the multi-token-prediction layer becomes a block past the model's (``nextn_predict_layers``
  of them): its tensors are skipped, said once (speculative decoding will read them).
"""

from __future__ import annotations

import logging
import re
from typing import Optional

import numpy as np

from .block_tensor import BlockTensor

logger = logging.getLogger("pocketllm.worker")
_BLOCK = re.compile(r"blk\.(\d+)\.")
_NAME = re.compile(r"blk\.(\d+)\.([a-z0-9_]+?)(?:\.(weight|bias))?")

# GGUF part -> HF name under model.layers.{i}. (and whether its rows hold value heads)
_LINEAR = {"attn_qkv": "linear_attn.in_proj_qkv.weight", "attn_gate": "linear_attn.in_proj_z.weight",
           "ssm_alpha": "linear_attn.in_proj_a.weight", "ssm_beta": "linear_attn.in_proj_b.weight",
           "ssm_ba": "linear_attn.in_proj_ba.weight", "ssm_a": "linear_attn.A_log",
           "ssm_dt": "linear_attn.dt_bias", "ssm_conv1d": "linear_attn.conv1d.weight",
           "ssm_norm": "linear_attn.norm.weight", "ssm_out": "linear_attn.out_proj.weight",
           "ffn_gate_inp_shexp": "mlp.shared_expert_gate.weight",
           "ffn_gate_shexp": "mlp.shared_expert.gate_proj.weight",
           "ffn_up_shexp": "mlp.shared_expert.up_proj.weight",
           "ffn_down_shexp": "mlp.shared_expert.down_proj.weight"}


def grouped_order(cfg: dict, head_dim: int) -> np.ndarray:
    """Index into a tiled value-head axis (heads of ``head_dim`` entries) that puts its
    heads back in groups: grouped head h = g * r + j is tiled head j * key_heads + g."""
    k_heads, v_heads = int(cfg["linear_num_key_heads"]), int(cfg["linear_num_value_heads"])
    per = v_heads // k_heads
    h = np.arange(v_heads)
    tiled = (h % per) * k_heads + h // per
    return (tiled[:, None] * head_dim + np.arange(head_dim)[None, :]).reshape(-1)


def value_heads_tiled(cfg: dict) -> bool:
    """Whether the file stores its value heads tiled (qwen35 / qwen35moe, several value
    heads a q/k head)."""
    return cfg.get("model_type") != "qwen3_next" and \
        cfg["linear_num_key_heads"] != cfg["linear_num_value_heads"]


def hybrid_tensor(gguf_name: str, w: "np.ndarray | BlockTensor", cfg: dict,
                  as_stored: bool = False) -> Optional[list[tuple[str, "np.ndarray | BlockTensor"]]]:
    block = _BLOCK.match(gguf_name)
    if block is not None and int(block.group(1)) >= int(cfg["num_hidden_layers"]):
        if int(block.group(1)) == int(cfg["num_hidden_layers"]) and gguf_name.endswith(
                "attn_norm.weight"):  # once per file
            logger.info("the file's multi-token-prediction layer (block %s) is not loaded: "
                        "speculative decoding does not use it yet", block.group(1))
        return []
    m = _NAME.fullmatch(gguf_name)
    if m is None or m.group(2) not in _LINEAR:
        return None
    layer, part = m.group(1), m.group(2)
    name = f"model.layers.{layer}.{_LINEAR[part]}"
    tiled = value_heads_tiled(cfg) and not as_stored
    v_dim = int(cfg["linear_value_head_dim"])
    qk_rows = 2 * int(cfg["linear_num_key_heads"]) * int(cfg["linear_key_head_dim"])
    if part == "ssm_a":
        w = np.log(-_dense(w))
    elif part == "ssm_conv1d":
        w = _dense(w)
    if tiled and part in ("attn_qkv", "ssm_conv1d"):
        order = np.concatenate([np.arange(qk_rows), qk_rows + grouped_order(cfg, v_dim)])
        w = _rows(w, order)
    elif tiled and part in ("attn_gate", "ssm_alpha", "ssm_beta", "ssm_a", "ssm_dt"):
        w = _rows(w, grouped_order(cfg, v_dim if part == "attn_gate" else 1))
    elif tiled and part == "ssm_out":
        w = _dense(w)[:, grouped_order(cfg, v_dim)]
    if part == "ssm_conv1d":
        w = np.ascontiguousarray(w)[:, None, :]
    return [(name, w)]


def _dense(w: "np.ndarray | BlockTensor") -> np.ndarray:
    return w.read() if isinstance(w, BlockTensor) else w


def _rows(w: "np.ndarray | BlockTensor", order: np.ndarray) -> "np.ndarray | BlockTensor":
    return w.with_rows(order) if isinstance(w, BlockTensor) else np.ascontiguousarray(w[order])
