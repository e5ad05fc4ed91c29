"""Qwen3-MoE on the torch path against transformers, on a tiny random checkpoint saved by
transformers (8 experts, top-2 renormalised; layers 0 and 2 route to experts, layer 1 keeps
a dense MLP through mlp_only_layers): greedy tokens and log probabilities, with chunked
prefill, a prefix-cache hit and preemption; through the engine; at TP=2 over gloo; the
MoE layer against a naive per-token loop; config refusals; dummy weights. GGUF files and
experts kept in block types: test_qwen3_moe_gguf.py."""

from __future__ import annotations

import random

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from pocketllm import LLM, EngineArgs, SamplingParams  # noqa: E402
from pocketllm.errors import CheckpointError, UnsupportedFeatureError  # noqa: E402
from pocketllm.model_info import load_model_info  # noqa: E402
from pocketllm.proto.messages import NewRequestData, StepPlan  # noqa: E402
from pocketllm.workers.distributed import TPGroup  # noqa: E402
from pocketllm.workers.layers.activation import get_activation  # noqa: E402
from pocketllm.workers.layers.moe import FusedMoE, softmax_topk, torch_experts  # noqa: E402
from pocketllm.workers.models.base import GatedMLP, check_tensor_parallel  # noqa: E402
from pocketllm.workers.models.config import MoeSpec  # noqa: E402
from pocketllm.workers.models.qwen3_moe_config import qwen3_moe_arch_config  # noqa: E402
from test_worker_parity import GREEDY_LP, NEW_TOKENS, PROMPT, hf_greedy, make_runner  # noqa: E402
from tiny_checkpoints import make_tiny_checkpoint, run_step, tables  # noqa: E402
from family_parity import assert_matches, assert_tp2_equals_one_rank, run  # noqa: E402


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
    assert_tp2_equals_one_rank(moe_path, runner)


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
