"""A Llama, Qwen3-MoE or Qwen3.5 GGUF of a shipped (or any) config's shape, filled with
random Q4_K_M blocks, so that `bench latency --peer llama.cpp` (or llama.cpp's own
`llama-bench`, on a GPU) can compare the two engines on a model nobody has to download:
the same file, read by both.

    python -m pocketllm.bench.synthetic_gguf llama-3-8b OUT.gguf --tokenizer-from DONOR.gguf
    python -m pocketllm.bench.synthetic_gguf qwen3-30b-a3b OUT.gguf --tokenizer-from DONOR.gguf
    python -m pocketllm.bench.synthetic_gguf qwen3.5-0.8b OUT.gguf --tokenizer-from DONOR.gguf

A Qwen3.5 file (llama.cpp's ``qwen35``) holds what its converter writes: the
linear-attention layers' ``attn_qkv``, ``attn_gate`` and ``ssm_out`` in blocks, their
small tensors (``ssm_alpha``/``ssm_beta``, ``ssm_a`` = -exp(A_log), ``ssm_dt``, the conv
and the norms) in F32; the gated attention's q rows twice as many (each head's gate).

The blocks are ``--load-format dummy --quantization q4_k_m``'s (``loader/dummy_blocks``):
random codes with scales that keep values near the float dummy's spread, so every kernel
does a real file's work and the outputs are noise. The tensor types follow llama.cpp's
Q4_K_M: Q4_K, with Q6_K for v and the (expert) down projections of the layers it gives
more bits and for the output matrix; the router (``ffn_gate_inp``) and the norms in F32.
The tokenizer is borrowed from ``DONOR.gguf`` (a BPE or SentencePiece vocabulary no
larger than the config's), padded with control tokens to the config's vocabulary. The
tensors are written one at a time, so a 17 GB file needs little memory.
"""

from __future__ import annotations

import argparse
import json
import os
from typing import Optional

import numpy as np

from ..model_info import shipped_config_dir


Plan = list[tuple[str, Optional[int], tuple[int, ...]]]


def _plan_gqa(cfg: dict, layers: int, qk_norm: bool, ffn) -> Plan:
    """(GGUF name, GGML type or None for F32, HF-order shape) of every tensor of a model of
    Llama's layout: per layer a grouped-query attention (with per-head q/k norms if
    ``qk_norm``) and the FFN tensors ``ffn(prefix, q4, more)`` names, where ``more`` is
    the type of the tensors llama.cpp's Q4_K_M gives more bits in that layer."""
    from gguf import GGMLQuantizationType as Q

    from ..workers.loader.dummy_blocks import _uses_more_bits

    h, vocab = cfg["hidden_size"], cfg["vocab_size"]
    d = cfg.get("head_dim") or h // cfg["num_attention_heads"]
    q_rows, kv_rows = cfg["num_attention_heads"] * d, cfg["num_key_value_heads"] * d
    q4, q6 = int(Q.Q4_K), int(Q.Q6_K)
    plan = [("token_embd.weight", q4, (vocab, h))]
    for i in range(layers):
        more = q6 if _uses_more_bits(i, layers) else q4
        b = f"blk.{i}."
        plan += [(b + "attn_norm.weight", None, (h,)), (b + "attn_q.weight", q4, (q_rows, h)),
                 (b + "attn_k.weight", q4, (kv_rows, h)), (b + "attn_v.weight", more, (kv_rows, h)),
                 (b + "attn_output.weight", q4, (h, q_rows))]
        if qk_norm:
            plan += [(b + "attn_q_norm.weight", None, (d,)), (b + "attn_k_norm.weight", None, (d,))]
        plan += [(b + "ffn_norm.weight", None, (h,))] + ffn(b, q4, more)
    plan.append(("output_norm.weight", None, (h,)))
    if not cfg.get("tie_word_embeddings", False):
        plan.append(("output.weight", q6, (vocab, h)))
    return plan


def _plan(cfg: dict, layers: int) -> Plan:
    """Every tensor of a Qwen3-MoE model (llama.cpp's ``qwen3moe``)."""
    h, experts, inter = cfg["hidden_size"], cfg["num_experts"], cfg["moe_intermediate_size"]
    return _plan_gqa(cfg, layers, True, lambda b, q4, more: [
        (b + "ffn_gate_inp.weight", None, (experts, h)),
        (b + "ffn_gate_exps.weight", q4, (experts, inter, h)),
        (b + "ffn_up_exps.weight", q4, (experts, inter, h)),
        (b + "ffn_down_exps.weight", more, (experts, h, inter))])


def _plan_llama(cfg: dict, layers: int) -> Plan:
    """Every tensor of a dense Llama (llama.cpp's ``llama``)."""
    h, inter = cfg["hidden_size"], cfg["intermediate_size"]
    return _plan_gqa(cfg, layers, False, lambda b, q4, more: [
        (b + "ffn_gate.weight", q4, (inter, h)), (b + "ffn_up.weight", q4, (inter, h)),
        (b + "ffn_down.weight", more, (h, inter))])


def _plan_qwen35(cfg: dict, layers: int) -> Plan:
    """(GGUF name, GGML type or None for F32, HF-order shape) of every tensor of a dense
    Qwen3.5 text model, as llama.cpp's converter names them."""
    from gguf import GGMLQuantizationType as Q

    from ..workers.loader.dummy_blocks import _uses_more_bits

    h, vocab, inter = cfg["hidden_size"], cfg["vocab_size"], cfg["intermediate_size"]
    d = cfg["head_dim"]
    q_rows, kv_rows = cfg["num_attention_heads"] * d, cfg["num_key_value_heads"] * d
    hk, hv = cfg["linear_num_key_heads"], cfg["linear_num_value_heads"]
    key, value = hk * cfg["linear_key_head_dim"], hv * cfg["linear_value_head_dim"]
    q4, q6 = int(Q.Q4_K), int(Q.Q6_K)
    plan = [("token_embd.weight", q4, (vocab, h))]
    for i, kind in enumerate(_qwen35_layer_types(cfg)[:layers]):
        more = q6 if _uses_more_bits(i, layers) else q4
        b = f"blk.{i}."
        plan += [(b + "attn_norm.weight", None, (h,)), (b + "post_attention_norm.weight", None, (h,)),
                 (b + "ffn_gate.weight", q4, (inter, h)), (b + "ffn_up.weight", q4, (inter, h)),
                 (b + "ffn_down.weight", more, (h, inter))]
        if kind == "linear_attention":
            plan += [(b + "attn_qkv.weight", q4, (2 * key + value, h)),
                     (b + "attn_gate.weight", q4, (value, h)),
                     (b + "ssm_alpha.weight", None, (hv, h)), (b + "ssm_beta.weight", None, (hv, h)),
                     (b + "ssm_a", None, (hv,)), (b + "ssm_dt.bias", None, (hv,)),
                     (b + "ssm_conv1d.weight", None, (2 * key + value, cfg["linear_conv_kernel_dim"])),
                     (b + "ssm_norm.weight", None, (cfg["linear_value_head_dim"],)),
                     (b + "ssm_out.weight", more, (h, value))]
        else:
            plan += [(b + "attn_q.weight", q4, (2 * q_rows, h)), (b + "attn_k.weight", q4, (kv_rows, h)),
                     (b + "attn_v.weight", more, (kv_rows, h)),
                     (b + "attn_output.weight", q4, (h, q_rows)),
                     (b + "attn_q_norm.weight", None, (d,)), (b + "attn_k_norm.weight", None, (d,))]
    plan.append(("output_norm.weight", None, (h,)))
    if not cfg.get("tie_word_embeddings", False):
        plan.append(("output.weight", q6, (vocab, h)))
    return plan


def _qwen35_layer_types(cfg: dict) -> list[str]:
    n = cfg["num_hidden_layers"]
    return cfg.get("layer_types") or ["full_attention" if (i + 1) % 4 == 0 else "linear_attention"
                                      for i in range(n)]


def _qwen35_keys(w, cfg: dict, layers: int) -> None:
    """The qwen35.* metadata llama.cpp's converter writes (mrope sections as it defaults)."""
    arch = "qwen35"
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_uint32(f"{arch}.ssm.conv_kernel", cfg["linear_conv_kernel_dim"])
    w.add_uint32(f"{arch}.ssm.state_size", cfg["linear_key_head_dim"])
    w.add_uint32(f"{arch}.ssm.group_count", cfg["linear_num_key_heads"])
    w.add_uint32(f"{arch}.ssm.time_step_rank", cfg["linear_num_value_heads"])
    w.add_uint32(f"{arch}.ssm.inner_size",
                 cfg["linear_value_head_dim"] * cfg["linear_num_value_heads"])
    w.add_array(f"{arch}.attention.recurrent_layers",
                [t == "linear_attention" for t in _qwen35_layer_types(cfg)[:layers]])
    w.add_uint32(f"{arch}.full_attention_interval", 4)
    rope = cfg.get("rope_parameters") or {}
    w.add_uint32(f"{arch}.rope.dimension_count",
                 int(cfg["head_dim"] * rope.get("partial_rotary_factor", 0.25)))
    w.add_array(f"{arch}.rope.dimension_sections", [11, 11, 10, 0])


def _tokenizer(writer, donor: str, vocab: int) -> None:
    from ..gguf_meta import read_gguf_header

    meta = read_gguf_header(donor).metadata
    tokens = list(meta["tokenizer.ggml.tokens"])
    if len(tokens) > vocab:
        raise SystemExit(f"{donor!r} has {len(tokens)} tokens, more than the config's {vocab}")
    types = list(meta.get("tokenizer.ggml.token_type", [1] * len(tokens)))
    pad = vocab - len(tokens)
    writer.add_tokenizer_model(meta["tokenizer.ggml.model"])
    if "tokenizer.ggml.pre" in meta:
        writer.add_tokenizer_pre(meta["tokenizer.ggml.pre"])
    writer.add_token_list(tokens + [f"<|pad_{i}|>" for i in range(pad)])
    writer.add_token_types(types + [3] * pad)  # 3: control, never produced by text
    if "tokenizer.ggml.scores" in meta:
        writer.add_token_scores(list(meta["tokenizer.ggml.scores"]) + [0.0] * pad)
    if "tokenizer.ggml.merges" in meta:
        writer.add_token_merges(list(meta["tokenizer.ggml.merges"]))
    for key in ("bos_token_id", "eos_token_id"):
        if f"tokenizer.ggml.{key}" in meta:
            getattr(writer, f"add_{key}")(int(meta[f"tokenizer.ggml.{key}"]))


# the configs' model_type -> llama.cpp's architecture name
ARCHS = {"llama": "llama", "qwen3_moe": "qwen3moe", "qwen3_5_text": "qwen35"}


def write_synthetic_gguf(cfg: dict, out: str, donor: str, layers: Optional[int] = None,
                         seed: int = 0) -> int:
    """Write the file; returns its tensor bytes."""
    import gguf

    from ..workers.loader.dummy_blocks import random_block_tensor
    from ..workers.loader.gguf_quants import GGML_TYPES

    model_type = cfg.get("model_type")
    arch = ARCHS.get(model_type)
    if arch is None:
        raise SystemExit(f"only {', '.join(ARCHS)} configs are written, got {model_type!r}")
    if cfg.get("rope_scaling"):  # llama.cpp would want its rope_freqs tensor
        raise SystemExit("configs with rope scaling are not written")
    if layers is not None and not 1 <= layers <= cfg["num_hidden_layers"]:
        raise SystemExit(f"--layers takes 1 to {cfg['num_hidden_layers']}, got {layers}")
    layers = layers or cfg["num_hidden_layers"]
    w = gguf.GGUFWriter(out, arch)
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_block_count(layers)
    w.add_head_count(cfg["num_attention_heads"])
    w.add_head_count_kv(cfg["num_key_value_heads"])
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    if model_type == "llama":
        w.add_rope_freq_base(cfg.get("rope_theta", 1e4))
        w.add_rope_dimension_count(head_dim)
        w.add_feed_forward_length(cfg["intermediate_size"])
        plan = _plan_llama(cfg, layers)
    elif model_type == "qwen3_moe":
        w.add_rope_freq_base(cfg.get("rope_theta", 1e6))
        w.add_feed_forward_length(cfg["intermediate_size"])
        w.add_expert_count(cfg["num_experts"])
        w.add_expert_used_count(cfg["num_experts_per_tok"])
        w.add_expert_feed_forward_length(cfg["moe_intermediate_size"])
        plan = _plan(cfg, layers)
    else:
        w.add_rope_freq_base((cfg.get("rope_parameters") or {}).get("rope_theta", 1e7))
        _qwen35_keys(w, cfg, layers)
        plan = _plan_qwen35(cfg, layers)
    _tokenizer(w, donor, cfg["vocab_size"])
    for name, kind, shape in plan:  # the header first; the data streams after it
        if kind is None:
            w.add_tensor_info(name, shape, np.dtype(np.float32), int(np.prod(shape)) * 4,
                              raw_dtype=gguf.GGMLQuantizationType.F32)
        else:
            _, elems, nbytes = GGML_TYPES[kind]
            row_bytes = shape[-1] // elems * nbytes
            w.add_tensor_info(name, (*shape[:-1], row_bytes), np.dtype(np.uint8),
                              int(np.prod(shape[:-1])) * row_bytes,
                              raw_dtype=gguf.GGMLQuantizationType(kind))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    rng = np.random.default_rng(seed)
    total = 0
    for name, kind, shape in plan:
        if kind is None:  # norms of one (the (1 + w) norms stored as llama.cpp does); the
            # router's and the small projections' values spread as the float dummy's
            data = (np.ones(shape, np.float32) if len(shape) == 1
                    else rng.standard_normal(shape, np.float32) * np.float32(0.02))
            if name.endswith("ssm_a"):  # -exp(A_log) for A_log ~ 0: decays that keep a state
                data = -data
        else:
            rows = int(np.prod(shape[:-1]))
            data = random_block_tensor(kind, (rows, shape[-1]), rng).blocks
            data = data.reshape(*shape[:-1], -1)
        w.write_tensor_data(data)
        total += data.nbytes
    w.close()
    return total


def main(argv: Optional[list[str]] = None) -> None:
    p = argparse.ArgumentParser(prog="python -m pocketllm.bench.synthetic_gguf",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("config", help="a shipped config's name (llama-3-8b, llama-3-70b, "
                                  "qwen3-30b-a3b, qwen3.5-0.8b, qwen3.5-9b) or a config.json")
    p.add_argument("out", help="the GGUF file to write")
    p.add_argument("--tokenizer-from", required=True, metavar="GGUF",
                   help="a GGUF file whose tokenizer the new file borrows")
    p.add_argument("--layers", type=int, help="fewer layers than the config's")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    path = args.config
    if not os.path.exists(path):
        shipped = shipped_config_dir(args.config)
        if shipped is None:
            raise SystemExit(f"{args.config!r} is neither a file nor a shipped config")
        path = os.path.join(shipped, "config.json")
    with open(path, encoding="utf-8") as f:
        cfg = json.load(f)
    total = write_synthetic_gguf(cfg, args.out, args.tokenizer_from, args.layers, args.seed)
    print(f"{args.out}: {total / 1e9:.2f} GB of tensors")


if __name__ == "__main__":
    main()
