"""Qwen3.5, Qwen3.5-MoE and Qwen3-Next from GGUF files written by llama.cpp's own converter
(``llama_cpp_convert.py``) from the tiny checkpoints: the float32 files compute what
transformers computes on the checkpoints (greedy tokens and log probabilities for 32
steps), which checks every undoing of the converter (A_log from -exp(A_log), the value
heads it tiles for ggml, Qwen3-Next's split projections, the (1 + w) norms but the
linear-attention one); a Q8_0 file holds, block for block, the float file's tensors
(rows moved, blocks kept), and serves at TP=2 over gloo as on one rank; a file missing a
tensor names it."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
if not hasattr(transformers, "Qwen3_5ForCausalLM"):
    pytest.skip("this transformers has no Qwen3.5 (5.2 and later do)", allow_module_level=True)

from pocketllm import EngineArgs  # noqa: E402
from pocketllm.errors import CheckpointError  # noqa: E402
from pocketllm.model_info import load_model_info  # noqa: E402
from pocketllm.workers.loader.block_tensor import BlockTensor  # noqa: E402
from pocketllm.workers.loader.gguf import load_gguf_weights  # noqa: E402
from family_parity import assert_matches, assert_tp2_equals_one_rank, run  # noqa: E402
from llama_cpp_convert import convert  # noqa: E402
from test_worker_parity import NEW_TOKENS, PROMPT, hf_greedy, make_runner  # noqa: E402
from tiny_checkpoints import make_tiny_checkpoint  # noqa: E402

FAMILIES = ("qwen3_5", "qwen3_5_moe", "qwen3_next")


@pytest.fixture(scope="module", params=FAMILIES)
def converted(request, tmp_path_factory):
    hf = make_tiny_checkpoint(request.param)
    out = tmp_path_factory.mktemp(request.param)
    return hf, convert(hf, str(out / "f32.gguf"), "f32", "--no-mtp"), out


def test_llama_cpp_files_compute_what_transformers_does(converted):
    hf, path, _ = converted
    info = load_model_info(EngineArgs(model=path))
    assert info.format == "gguf" and info.hf_config["layer_types"].count("linear_attention") >= 2
    out, driver = run(make_runner(path), {"r": PROMPT})
    assert_matches(out["r"], driver.reqs["r"].logprobs, hf_greedy(hf, PROMPT, NEW_TOKENS))


def test_a_q8_0_file_holds_the_float_files_tensors(converted):
    _, path, out = converted
    q8 = convert(converted[0], str(out / "q8_0.gguf"), "q8_0", "--no-mtp")
    info = load_model_info(EngineArgs(model=path))
    floats = dict(load_gguf_weights(path, info))
    blocks = 0
    for name, w in load_gguf_weights(q8, load_model_info(EngineArgs(model=q8))):
        blocks += isinstance(w, BlockTensor)
        got = w.read() if isinstance(w, BlockTensor) else w
        want = floats[name]
        assert got.shape == want.shape, name
        # Q8_0: each block of 32 in steps of its largest magnitude / 127 (a float16 scale)
        assert abs(got - want).max() <= abs(want).max() / 127 * 0.6 + 1e-6, name
    assert blocks > 0, "the converter left every tensor in float"


def without_tensor(path: str, name: str, out: str) -> str:
    """A copy of the GGUF file at ``path`` without its tensor ``name``."""
    import gguf
    import numpy as np

    reader = gguf.GGUFReader(path)
    writer = gguf.GGUFWriter(out, reader.fields["general.architecture"].contents())
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        writer.add_key_value(key, field.contents(), field.types[0],
                             field.types[-1] if field.types[0] == gguf.GGUFValueType.ARRAY
                             else None)
    for t in reader.tensors:
        if t.name != name:
            writer.add_tensor(t.name, np.asarray(t.data), raw_dtype=t.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


def test_tp2_over_gloo_on_llama_cpp_files_equals_one_rank(converted):
    """Tensor parallelism on llama.cpp's files (the torch worker: blocks dequantized per
    rank, each rank reading its key and value heads' rows). The tiny MoE checkpoints'
    experts are 32 wide, one Q8_0 block: two ranks would cut it, which is refused at load
    naming the tensor; their float32 files are served instead."""
    from pocketllm import LLM
    from pocketllm.errors import UnsupportedFeatureError

    _, f32, out = converted
    q8 = convert(converted[0], str(out / "q8_0_tp.gguf"), "q8_0", "--no-mtp")
    path = q8
    if "moe" in str(out) or "next" in str(out):
        with pytest.raises(UnsupportedFeatureError, match=r"ffn_down_exps.*do not fall on its blocks"):
            LLM(EngineArgs(model=q8, tensor_parallel_size=2, device="cpu", shutdown_timeout=3))
        path = f32
    assert_tp2_equals_one_rank(path, make_runner(path))


def test_a_file_missing_a_tensor_names_it(converted, tmp_path):
    _, path, _ = converted
    cut = without_tensor(path, "blk.0.ssm_a", str(tmp_path / "cut.gguf"))
    with pytest.raises(CheckpointError, match="model.layers.0.linear_attn.A_log"):
        make_runner(cut)


TINY_QWEN35 = dict(model_type="qwen3_5_text", architectures=["Qwen3_5ForCausalLM"],
                   vocab_size=49152, hidden_size=256, intermediate_size=256, num_hidden_layers=4,
                   num_attention_heads=2, num_key_value_heads=1, head_dim=128,
                   linear_num_key_heads=1, linear_num_value_heads=2, linear_key_head_dim=128,
                   linear_value_head_dim=128, linear_conv_kernel_dim=4,
                   max_position_embeddings=1024, rms_norm_eps=1e-6, tie_word_embeddings=True,
                   rope_parameters={"rope_type": "default", "rope_theta": 1e7,
                                    "partial_rotary_factor": 0.25})


def test_a_synthetic_qwen35_file_reads_as_llama_cpp_reads_it(tmp_path, tokenizer_donor):
    """``bench/synthetic_gguf``'s Q4_K_M qwen35 file of a tiny shape (SmolLM2's tokenizer):
    the engine serves it, and where llama-cpp-python is installed, its next-token
    distribution on a prompt is llama.cpp's (the same leading tokens; llama.cpp rounds the
    activations to 8 bits, so the values differ a little)."""
    import numpy as np

    from pocketllm import LLM, SamplingParams
    from pocketllm.bench.synthetic_gguf import write_synthetic_gguf

    path = str(tmp_path / "tiny-qwen35-q4_k_m.gguf")
    write_synthetic_gguf(TINY_QWEN35, path, tokenizer_donor)
    prompt = [504, 2365, 6354, 16438, 27003, 690, 260, 23790, 2767]
    with LLM(EngineArgs(model=path, device="cpu", max_model_len=512, shutdown_timeout=3)) as llm:
        out = llm.generate([prompt], SamplingParams(max_tokens=1, temperature=0, logprobs=10))[0]
    ours = [e.token_id for e in out.logprobs[0].top]
    llama_cpp = pytest.importorskip("llama_cpp")
    model = llama_cpp.Llama(path, n_ctx=128, n_threads=2, verbose=False, logits_all=True)
    model.eval(prompt)
    theirs = np.argsort(-np.asarray(model.scores[len(prompt) - 1]))[:10].tolist()
    assert ours[0] in theirs[:3] and theirs[0] in ours[:3]
    assert len(set(ours) & set(theirs)) >= 7


def test_the_multi_token_prediction_layer_is_skipped_not_a_failure(tmp_path):
    """A checkpoint with an MTP layer, and llama.cpp's file of it (which appends the layer
    as a block of its own, ``nextn_predict_layers``): both load, without the layer, and
    compute what transformers does."""
    from tiny_checkpoints import add_mtp_layer

    hf = add_mtp_layer(make_tiny_checkpoint("qwen3_5"))
    path = convert(hf, str(tmp_path / "mtp.gguf"), "f32")
    info = load_model_info(EngineArgs(model=path))
    assert info.hf_config["num_hidden_layers"] == 4
    reference = hf_greedy(hf, PROMPT, NEW_TOKENS)
    for model in (hf, path):
        out, driver = run(make_runner(model), {"r": PROMPT})
        assert_matches(out["r"], driver.reqs["r"].logprobs, reference)
