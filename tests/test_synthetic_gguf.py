"""``bench/synthetic_gguf``'s dense Llama file: llama.cpp's Q4_K_M types, served by the
engine, and read by llama.cpp as the engine reads it (the file a GPU peer benchmark of
llama.cpp's CUDA build and this engine share; the Qwen3-MoE and Qwen3.5 files are tested
beside their families)."""

from __future__ import annotations

import os

import numpy as np
import pytest

from pocketllm import LLM, EngineArgs, SamplingParams
from pocketllm.bench.synthetic_gguf import write_synthetic_gguf
from pocketllm.gguf_meta import read_gguf_header

TINY_LLAMA = dict(model_type="llama", architectures=["LlamaForCausalLM"], vocab_size=49152,
                  hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                  max_position_embeddings=1024, rms_norm_eps=1e-5, rope_theta=5e5,
                  tie_word_embeddings=False)
PROMPT = [504, 2365, 6354, 16438, 27003, 690, 260, 23790, 2767]


@pytest.fixture(scope="module")
def llama_file(tmp_path_factory, tokenizer_donor) -> str:
    path = str(tmp_path_factory.mktemp("synthetic") / "tiny-llama-q4_k_m.gguf")
    write_synthetic_gguf(TINY_LLAMA, path, tokenizer_donor)
    return path


def test_a_synthetic_llama_file_reads_as_llama_cpp_reads_it(llama_file):
    """Q4_K with Q6_K where llama.cpp's Q4_K_M gives more bits (v and down of the last
    layer here, the output matrix); the engine serves it, and where llama-cpp-python is
    installed, its next-token distribution is llama.cpp's (the same leading tokens:
    llama.cpp rounds activations to 8 bits, so values differ a little)."""
    tensors = read_gguf_header(llama_file).tensors
    q4_k, q6_k, f32 = 12, 14, 0
    assert [tensors[f"blk.{i}.attn_v.weight"].ggml_type for i in (0, 1)] == [q4_k, q6_k]
    assert [tensors[f"blk.{i}.ffn_down.weight"].ggml_type for i in (0, 1)] == [q4_k, q6_k]
    assert tensors["blk.0.ffn_gate.weight"].ggml_type == q4_k
    assert tensors["output.weight"].ggml_type == q6_k
    assert tensors["blk.0.attn_norm.weight"].ggml_type == f32
    with LLM(EngineArgs(model=llama_file, device="cpu", max_model_len=512,
                        shutdown_timeout=3)) as llm:
        out = llm.generate([PROMPT], SamplingParams(max_tokens=1, temperature=0, logprobs=10))[0]
    ours = [e.token_id for e in out.logprobs[0].top]
    llama_cpp = pytest.importorskip("llama_cpp")
    model = llama_cpp.Llama(llama_file, n_ctx=128, n_threads=2, verbose=False, logits_all=True)
    model.eval(PROMPT)
    scores = np.asarray(model.scores[len(PROMPT) - 1])
    theirs = np.argsort(-scores)[:10].tolist()
    assert scores.std() > 0.1  # logits that vary: a degenerate file would prove little
    assert ours[0] == theirs[0]
    assert len(set(ours) & set(theirs)) >= 8


def test_configs_the_writer_cannot_express_are_refused(tmp_path):
    with pytest.raises(SystemExit, match="only llama"):
        write_synthetic_gguf(dict(TINY_LLAMA, model_type="gemma3_text"), str(tmp_path / "x.gguf"),
                             "unused.gguf")
    with pytest.raises(SystemExit, match="rope scaling"):
        write_synthetic_gguf(dict(TINY_LLAMA, rope_scaling={"rope_type": "llama3"}),
                             str(tmp_path / "x.gguf"), "unused.gguf")
    for layers in (0, -1, 3):
        with pytest.raises(SystemExit, match="--layers takes 1 to 2"):
            write_synthetic_gguf(TINY_LLAMA, str(tmp_path / "x.gguf"), "unused.gguf", layers)
    assert not os.path.exists(tmp_path / "x.gguf")  # refused before a byte is written
