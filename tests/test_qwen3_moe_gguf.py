"""Qwen3-MoE from GGUF files on the CPU: llama.cpp's qwen3moe layout (float and block
experts, split per expert); the torch worker's experts dequantized at load, at one rank and
two; dummy quantization of an MoE shape; ``bench/synthetic_gguf``'s files, their experts
kept in blocks by the torch-free worker against llama.cpp, its decode stack against its
float path. (The torch-free worker against the torch one: test_lite_moe.py.)"""

from __future__ import annotations

import random

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from pocketllm import LLM, EngineArgs, SamplingParams  # noqa: E402
from pocketllm.model_info import load_model_info  # noqa: E402
from pocketllm.workers.kernels import cpu_lib  # noqa: E402
from test_worker_parity import NEW_TOKENS, PROMPT, hf_greedy  # noqa: E402
from tiny_checkpoints import make_tiny_checkpoint  # noqa: E402
from family_parity import assert_matches, run  # noqa: E402

needs_kernels = pytest.mark.skipif(not cpu_lib.available(),
                                   reason=f"CPU kernels: {cpu_lib.unavailable_reason()}")


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
    from pocketllm.workers.loader.gguf import load_gguf_weights

    path = str(tmp_path / "q8.gguf")
    q8 = gguf.GGMLQuantizationType.Q8_0
    write_qwen3moe_gguf(path, hf_moe, q8)
    info = load_model_info(EngineArgs(model=path))
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
                assert isinstance(got, BlockTensor) and got.ggml_type == q8
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


PROMPTS = {"a": PROMPT, "b": [2] + [random.Random(9).randrange(3, 512) for _ in range(30)]}


def test_gguf_block_experts_load_dequantized(hf_moe, blocks_gguf):
    """The torch worker (tensor parallelism, a dtype other than float32: where the
    torch-free worker refuses) expands the experts' blocks into its float stacked tensors
    at load, as gguf-py dequantizes them."""
    import gguf

    runner = _gguf_runner(blocks_gguf)
    q8 = gguf.GGMLQuantizationType.Q8_0
    down = hf_moe.state_dict()["model.layers.2.mlp.experts.down_proj"][5].numpy()
    expected = gguf.quants.dequantize(gguf.quants.quantize(down, q8), q8)
    assert np.array_equal(runner.model.layers[2].mlp.w2[5].numpy(), expected)
    out, _ = run(runner, {"r": PROMPT}, new_tokens=4)
    assert len(out["r"]) == 4


def test_gguf_block_experts_at_tp2_over_gloo_equal_one_rank(blocks_gguf):
    """Each rank keeps its 32 of the 64 expert columns, whole blocks of Q4_0, Q5_1 (gate,
    up: rows) and Q8_0 (down: block columns), dequantized: one rank's tokens, log
    probabilities within the all-reduce's float32 rounding."""
    runner = _gguf_runner(blocks_gguf)
    out, driver = run(runner, PROMPTS, new_tokens=12)
    params = SamplingParams(max_tokens=12, temperature=0, logprobs=0, ignore_eos=True)
    with LLM(EngineArgs(model=blocks_gguf, tensor_parallel_size=2, device="cpu",
                        shutdown_timeout=3)) as llm:
        outs = llm.generate(list(PROMPTS.values()), params)
    for rid, o in zip(PROMPTS, outs):
        assert o.token_ids == out[rid]
        assert max(abs(e.logprob - lp.logprob)
                   for e, lp in zip(o.logprobs, driver.reqs[rid].logprobs)) < 1e-4


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
def test_dummy_quantized_experts_stay_blocks(moe_path):
    """``--quantization q8_0`` on an MoE shape (sparse and dense layers): the torch-free
    worker binds every expert's parts as Q8_0 blocks and generates."""
    from test_lite_model import _lite_greedy

    from pocketllm.workers.lite.model import LiteModel

    info = load_model_info(EngineArgs(model=moe_path, load_format="dummy", quantization="q8_0"))
    model = LiteModel(info, "q8_0")
    sparse = [x for x in model.experts if x is not None]
    assert sparse and len(sparse) < len(model.experts)  # mlp_only_layers stay dense
    assert {p.type for x in sparse for p in (*x.gate_up, *x.down)} == {8}
    tokens, _ = _lite_greedy(model, PROMPT, 4)
    assert len(tokens) == 4


# ---------------------------------------------------------------------- a synthetic file


TINY_MOE = {"model_type": "qwen3_moe", "hidden_size": 256, "intermediate_size": 512,
            "moe_intermediate_size": 256, "num_experts": 8, "num_experts_per_tok": 2,
            "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
            "head_dim": 64, "max_position_embeddings": 4096, "rms_norm_eps": 1e-6,
            "rope_theta": 1e6, "vocab_size": 49152}
SYNTH_PROMPT = [1, 504, 3000, 12000, 77, 9000, 31, 2024, 405, 18000, 600, 44]


@pytest.fixture(scope="module")
def synthetic_gguf(tmp_path_factory, tokenizer_donor) -> str:
    """``bench/synthetic_gguf``'s Q4_K_M qwen3moe file of a tiny shape whose rows split into
    256-element blocks, with SmolLM2's tokenizer (49,152 tokens)."""
    from pocketllm.bench.synthetic_gguf import write_synthetic_gguf

    path = str(tmp_path_factory.mktemp("synthetic") / "tiny-q4_k_m.gguf")
    write_synthetic_gguf(TINY_MOE, path, tokenizer_donor)
    return path


def _lite_model(path: str):
    from pocketllm.workers.lite.model import LiteModel

    return LiteModel(load_model_info(EngineArgs(model=path, device="cpu")))


def _prefill_logits(model, ids: list[int], stack_rows: int) -> np.ndarray:
    """Every prompt row's logits through the torch-free forward, in one step through its
    decode stack (``stack_rows`` 0: the model's) or its float path (1)."""
    from pocketllm.workers.lite.model import step_view
    from pocketllm.workers.step_rows import ScheduledSeq

    model.stack_rows = stack_rows or model.stack_rows
    cfg, bs, n = model.cfg, 16, len(ids)
    table = list(range(-(-n // bs)))
    pad = len(table) * bs
    model.bind([tuple(np.zeros((pad + bs, cfg.num_kv_heads, cfg.head_dim), np.float32)
                      for _ in range(2)) for _ in range(cfg.num_layers)],
               [(0, w) for w in cfg.layer_windows])
    views = {(0, w): step_view([ScheduledSeq(table, 0, n, 0)], w, bs, pad, n)
             for w in set(cfg.layer_windows)}
    return model.forward(np.array(ids), np.arange(n), views, list(range(n)))


@needs_kernels
def test_synthetic_q4_k_m_file_keeps_llama_cpp_types_and_serves(synthetic_gguf):
    from test_lite_model import _lite_greedy

    from pocketllm.gguf_meta import read_gguf_header

    tensors = read_gguf_header(synthetic_gguf).tensors
    q4_k, q6_k, f32 = 12, 14, 0
    assert tensors["blk.0.ffn_gate_exps.weight"].ggml_type == q4_k
    assert tensors["blk.0.ffn_down_exps.weight"].ggml_type == q4_k
    assert tensors["blk.1.ffn_down_exps.weight"].ggml_type == q6_k  # the last eighth: more bits
    assert tensors["blk.0.ffn_gate_inp.weight"].ggml_type == f32
    assert tensors["output.weight"].ggml_type == q6_k
    model = _lite_model(synthetic_gguf)  # the experts bound as the file's blocks
    assert [model.experts[i].down[3].type for i in (0, 1)] == [q4_k, q6_k]
    assert model.experts[0].gate_up[1].type == q4_k and model.head.parts[0].type == q6_k
    tokens, _ = _lite_greedy(model, SYNTH_PROMPT, 6)
    assert len(tokens) == 6


@needs_kernels
@pytest.mark.parametrize("stack_rows", [0, 1])
def test_lite_experts_match_llama_cpp_on_a_q4_k_m_file(synthetic_gguf, stack_rows):
    """The whole forward of a Q4_K/Q6_K qwen3moe file on the torch-free worker against
    llama.cpp's, position by position: the same top token and logits pointing the same way
    (cosine > 0.999; the two engines round activations differently: 16-bit per block of 32
    here, 8-bit there). The 12 prompt rows through the decode stack (each (token, expert)
    pair a run of its own, in C) or the float path (the pairs sorted into a run per
    expert)."""
    llama_cpp = pytest.importorskip("llama_cpp")

    ours = _prefill_logits(_lite_model(synthetic_gguf), SYNTH_PROMPT, stack_rows)
    llm = llama_cpp.Llama(model_path=synthetic_gguf, n_ctx=64, logits_all=True, verbose=False,
                          n_threads=2)
    llm.eval(SYNTH_PROMPT)
    theirs = np.array(llm.scores[:len(SYNTH_PROMPT)])
    cosine = (ours * theirs).sum(1) / np.linalg.norm(ours, axis=1) / np.linalg.norm(theirs, axis=1)
    assert cosine.min() > 0.999, cosine
    assert (ours.argmax(1) == theirs.argmax(1)).all()
    assert theirs.std() > 0.1  # logits that vary: a degenerate file would prove little


@needs_kernels
def test_decode_stack_equals_the_float_path(synthetic_gguf):
    """Every step of an MoE file in one ``pq_decode_stack`` call (attention, the router,
    its softmax top-k and the experts' pairs in C) against every step through the float
    path (``lite/prefill.py``: attention by matrix products, the experts by runs): the
    same tokens, log probabilities within 1e-4."""
    from test_lite_model import _lite_greedy

    stack = _lite_greedy(_lite_model(synthetic_gguf), SYNTH_PROMPT, 12)
    floats = _lite_greedy(_lite_model(synthetic_gguf), SYNTH_PROMPT, 12, stack_rows=1)
    assert stack[0] == floats[0]
    np.testing.assert_allclose(stack[1], floats[1], atol=1e-4)
    assert len(set(stack[0])) > 2, "a degenerate model would prove little"
