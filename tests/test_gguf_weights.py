"""GGUF weight loading: names, shapes and llama.cpp's transforms undone.

Tiny random HF models are written as GGUF the way llama.cpp's converter does
(its tensor names, q/k row permutation for llama, Gemma norms stored as w + 1,
a mix of F32/F16/BF16/Q8_0/Q4_0/Q4_1/Q5_0/Q5_1 tensors) and read back; the real
embedded Gemma file is checked against transformers' own GGUF loader.
"""

from __future__ import annotations

import os
import time

import gguf
import numpy as np
import pytest
import torch

from pocketllm.config import EngineArgs
from pocketllm.errors import CheckpointError
from pocketllm.model_info import load_model_info
from pocketllm.workers.loader.block_tensor import BlockTensor
from pocketllm.workers.loader.gguf import hf_name, load_gguf_weights, unpermute_rope_rows

Q = gguf.GGMLQuantizationType

# HF parameter suffix (after model.layers.{i}.) -> llama.cpp tensor name.
_TO_GGUF = {
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
}
_GEMMA3_TO_GGUF = {
    **_TO_GGUF, "pre_feedforward_layernorm": "ffn_norm",
    "post_attention_layernorm": "post_attention_norm",
    "post_feedforward_layernorm": "post_ffw_norm",
}
# 2-D tensors cycle through these; atol relative to the tensor's max |w|.
_QTYPES = [(Q.F16, 1e-3), (Q.Q8_0, 0.01), (Q.Q4_0, 0.1), (Q.BF16, 1e-2), (Q.Q5_1, 0.05),
           (Q.F32, 0.0), (Q.Q4_1, 0.1), (Q.Q5_0, 0.05)]


def permute_rope_rows(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """llama.cpp's transform (HF -> GGUF); the inverse of ``unpermute_rope_rows``."""
    half = w.shape[0] // n_heads // 2
    return w.reshape(n_heads, 2, half, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def _tiny_hf_model(family: str, intermediate_size: int = 96):
    import transformers as tf

    common = dict(vocab_size=96, hidden_size=64, intermediate_size=intermediate_size, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                  max_position_embeddings=256, rms_norm_eps=1e-5)
    cfg = {
        "llama": lambda: tf.LlamaConfig(**common, tie_word_embeddings=False),
        "qwen2": lambda: tf.Qwen2Config(**common, tie_word_embeddings=False),
        # transformers reads no head_dim from a qwen3 GGUF (it assumes Qwen3's 128)
        "qwen3": lambda: tf.Qwen3Config(**{**common, "head_dim": 128, "num_attention_heads": 2,
                                           "num_key_value_heads": 1}, tie_word_embeddings=True),
        "gemma3": lambda: tf.Gemma3TextConfig(**common, sliding_window=64),
    }[family]()
    torch.manual_seed(0)
    model = tf.AutoModelForCausalLM.from_config(cfg).float().eval()
    with torch.no_grad():  # norms default to 1 (or 0 for Gemma): make them informative
        for name, p in model.named_parameters():
            if p.ndim == 1:
                p.normal_(0.0, 0.5)
    return model


def _gguf_name(name: str, family: str) -> str:
    if name.startswith("model.layers."):
        _, _, layer, rest = name.split(".", 3)
        part, kind = rest.rsplit(".", 1)
        table = _GEMMA3_TO_GGUF if family == "gemma3" else _TO_GGUF
        return f"blk.{layer}.{table[part]}.{kind}"
    return {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
            "lm_head.weight": "output.weight"}[name]


def write_tiny_gguf(path: str, family: str, model, qtypes=_QTYPES) -> dict[str, float]:
    """Write ``model`` as llama.cpp would, its matrices cycling through ``qtypes``; returns HF
    name -> atol factor of its storage type."""
    cfg = model.config
    w = gguf.GGUFWriter(path, family)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_key_length(cfg.head_dim)
    w.add_value_length(cfg.head_dim)
    w.add_rope_dimension_count(cfg.head_dim)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_rope_freq_base(10000.0)
    if family == "gemma3":
        w.add_sliding_window(cfg.sliding_window)
    w.add_tokenizer_model("llama")
    w.add_token_list([f"<t{i}>" for i in range(cfg.vocab_size)])
    w.add_token_scores([0.0] * cfg.vocab_size)
    w.add_token_types([1] * cfg.vocab_size)
    tolerances = {}
    tied = cfg.tie_word_embeddings
    params = {n: p.detach().numpy().astype(np.float32) for n, p in model.state_dict().items()
              if not (tied and n == "lm_head.weight")}
    for i, (name, value) in enumerate(params.items()):
        if family == "llama" and ".q_proj." in name:
            value = permute_rope_rows(torch.from_numpy(value), cfg.num_attention_heads).numpy()
        elif family == "llama" and ".k_proj." in name:
            value = permute_rope_rows(torch.from_numpy(value), cfg.num_key_value_heads).numpy()
        elif family == "gemma3" and name.endswith("norm.weight"):
            value = value + 1.0
        if value.ndim == 1:
            qtype, tol = Q.F32, 0.0
        else:
            qtype, tol = qtypes[i % len(qtypes)]
        tolerances[name] = tol
        data = gguf.quants.quantize(value, qtype)
        w.add_tensor(_gguf_name(name, family), data, raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return tolerances


@pytest.fixture(scope="module", params=["llama", "qwen2", "qwen3", "gemma3"])
def tiny(request, tmp_path_factory):
    family = request.param
    model = _tiny_hf_model(family)
    path = str(tmp_path_factory.mktemp(family) / f"tiny-{family}.gguf")
    tolerances = write_tiny_gguf(path, family, model)
    info = load_model_info(EngineArgs(model=path))
    ours = dequantized(load_gguf_weights(path, info))
    return family, model, path, tolerances, info, ours


def dequantized(tensors) -> dict:
    """name -> float32 tensor: block tensors (kept as the file's bytes) decoded (the
    loader gives numpy arrays)."""
    return {name: torch.as_tensor(value.read() if isinstance(value, BlockTensor) else value)
            for name, value in tensors}


def test_round_trip_matches_hf_weights(tiny):
    family, model, _, tolerances, info, ours = tiny
    assert info.family == family
    ref = model.state_dict()
    expected = set(tolerances)
    assert set(ours) == expected
    assert ("lm_head.weight" in ours) == (not model.config.tie_word_embeddings)
    for name, value in ours.items():
        want = ref[name]
        assert value.dtype == torch.float32 and value.shape == want.shape, name
        atol = tolerances[name] * float(want.abs().max()) + 1e-6
        torch.testing.assert_close(value, want, atol=atol, rtol=0, msg=name)


def test_round_trip_equals_transformers_gguf_loader(tiny):
    from transformers import AutoModelForCausalLM

    family, _, path, _, _, ours = tiny
    hf = AutoModelForCausalLM.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path),
                                              dtype=torch.float32)
    ref = hf.state_dict()
    for name, value in ours.items():
        assert torch.equal(value, ref[name]), f"{family}: {name} differs from transformers"


def test_rope_permutation_inverse():
    w = torch.arange(4 * 16 * 3, dtype=torch.float32).view(64, 3)
    for heads in (1, 2, 4):
        p = permute_rope_rows(w, heads)
        assert not torch.equal(p, w)
        assert torch.equal(unpermute_rope_rows(p, heads), w)
    # llama.cpp interleaves the two rotary halves of each head: row 2j <- j, 2j+1 <- j + d/2
    head = permute_rope_rows(torch.arange(8.0), 1)
    assert head.tolist() == [0, 4, 1, 5, 2, 6, 3, 7]


def test_names():
    assert hf_name("blk.3.attn_q.bias", "qwen2") == "model.layers.3.self_attn.q_proj.bias"
    assert hf_name("blk.0.ffn_norm.weight", "llama") == "model.layers.0.post_attention_layernorm.weight"
    assert hf_name("blk.0.ffn_norm.weight", "gemma3") == "model.layers.0.pre_feedforward_layernorm.weight"
    assert hf_name("blk.1.post_ffw_norm.weight", "gemma3") == \
        "model.layers.1.post_feedforward_layernorm.weight"
    with pytest.raises(CheckpointError, match="post_ffw_norm"):
        hf_name("blk.1.post_ffw_norm.weight", "llama")
    with pytest.raises(CheckpointError, match="ssm_conv"):
        hf_name("blk.1.ssm_conv1d.weight", "qwen3")


def _rewrite_tensor_type(src: str, dst: str, tensor: str, new_type: int) -> None:
    """Copy a GGUF file, changing one tensor's recorded GGML type in its header."""
    import struct

    from pocketllm.gguf_meta import read_gguf_header

    data = bytearray(open(src, "rb").read())
    name = tensor.encode()
    at = data.index(struct.pack("<Q", len(name)) + name, 24)
    info = read_gguf_header(src).tensors[tensor]
    type_at = at + 8 + len(name) + 4 + 8 * len(info.shape)
    data[type_at:type_at + 4] = struct.pack("<I", new_type)
    open(dst, "wb").write(bytes(data))


@pytest.fixture(scope="module")
def llama_file(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("llama-errors") / "tiny.gguf")
    write_tiny_gguf(path, "llama", _tiny_hf_model("llama"))
    return path, load_model_info(EngineArgs(model=path))


def test_unsupported_type_names_tensor_and_type(llama_file, tmp_path):
    path, info = llama_file
    bad = str(tmp_path / "bad.gguf")
    _rewrite_tensor_type(path, bad, "output_norm.weight", 16)  # IQ2_XXS
    with pytest.raises(CheckpointError, match=r"output_norm\.weight.*IQ2_XXS"):
        list(load_gguf_weights(bad, info))


def test_truncated_file(llama_file, tmp_path):
    path, info = llama_file
    cut = str(tmp_path / "cut.gguf")
    data = open(path, "rb").read()
    open(cut, "wb").write(data[:len(data) - 4096])
    with pytest.raises(CheckpointError, match="truncated"):
        list(load_gguf_weights(cut, info))


# ------------------------------------------------------------------ the embedded model


@pytest.fixture(scope="module")
def embedded(default_model_path):
    info = load_model_info(EngineArgs(model=default_model_path))
    start = time.perf_counter()
    ours = dequantized(load_gguf_weights(info.path, info))
    return info, ours, time.perf_counter() - start


def test_embedded_model_names_and_shapes(embedded):
    info, ours, seconds = embedded
    cfg = info.hf_config
    assert len(ours) == 236 and "lm_head.weight" not in ours  # tied embeddings
    assert ours["model.embed_tokens.weight"].shape == (262144, 640)
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        assert ours[p + "self_attn.q_proj.weight"].shape == (4 * 256, 640)
        assert ours[p + "self_attn.k_proj.weight"].shape == (256, 640)
        assert ours[p + "mlp.down_proj.weight"].shape == (640, 2048)
        for norm in ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
                     "post_feedforward_layernorm", "self_attn.q_norm", "self_attn.k_norm"):
            assert p + norm + ".weight" in ours
    assert all(v.dtype == torch.float32 for v in ours.values())
    assert all(torch.isfinite(v).all() for n, v in ours.items() if n != "model.embed_tokens.weight")
    assert seconds < 10, f"loading the embedded GGUF took {seconds:.1f}s"


def test_embedded_model_dequantizes_like_gguf_reference(embedded):
    """One tensor of each quantization type in the real file, bit-exact with gguf-py's dequantize."""
    from pocketllm.gguf_meta import read_gguf_header

    info, ours, _ = embedded
    data = np.memmap(info.path, dtype=np.uint8, mode="r")
    seen = set()
    for t in read_gguf_header(info.path).tensors.values():
        if t.ggml_type in seen or t.name == "token_embd.weight":
            continue
        seen.add(t.ggml_type)
        qtype = Q(t.ggml_type)
        block, size = gguf.GGML_QUANT_SIZES[qtype]
        n_bytes = int(np.prod(t.shape)) // block * size
        raw = np.array(data[t.offset:t.offset + n_bytes]).reshape(-1, t.shape[0] // block * size)
        ref = torch.from_numpy(gguf.quants.dequantize(raw, qtype).copy())
        name = hf_name(t.name, "gemma3")
        ref = ref - 1.0 if name.endswith("norm.weight") else ref
        assert torch.equal(ours[name], ref.view(ours[name].shape)), t.name
    assert {Q(x).name for x in seen} == {"F32", "Q5_0", "Q8_0", "Q4_K", "Q6_K"}


@pytest.mark.slow
def test_embedded_model_equals_transformers(embedded):
    from transformers import AutoModelForCausalLM

    info, ours, _ = embedded
    hf = AutoModelForCausalLM.from_pretrained(os.path.dirname(info.path),
                                              gguf_file=os.path.basename(info.path), dtype=torch.float32)
    ref = hf.state_dict()
    assert set(ref) - set(ours) == {"lm_head.weight"}  # tied to embed_tokens in the HF model
    for name, value in ours.items():
        assert torch.equal(value, ref[name]), name
