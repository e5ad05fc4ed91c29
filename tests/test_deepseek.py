"""DeepSeek-V2/V3 on the torch path against transformers, on tiny random checkpoints saved
by transformers: deepseek_v3 (q LoRA, yarn rope, interleaved rope dims, 8 experts in 4
groups with the sigmoid + correction-bias routing, a shared expert, layer 0 dense) and
deepseek_v2 (no q LoRA, softmax greedy routing, two shared experts). Greedy tokens and log
probabilities, chunked prefill, a prefix-cache hit, preemption, the engine, TP=2 over gloo;
the routing functions against transformers' routers; the latent decode against its
definition; the MLA cache's layout and size; config parsing and refusals; GGUF refused."""

from __future__ import annotations

import math
import random

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from pocketllm import LLM, EngineArgs, SamplingParams  # noqa: E402
from pocketllm.errors import CheckpointError, UnsupportedFeatureError  # noqa: E402
from pocketllm.model_info import load_model_info  # noqa: E402
from pocketllm.proto.messages import CacheSpec, NewRequestData, StepPlan  # noqa: E402
from pocketllm.workers.layers.mla import MlaBackend, mla_decode_attention  # noqa: E402
from pocketllm.workers.layers.moe import (FusedMoE, SigmoidGroupedTopK,  # noqa: E402
                                          SoftmaxGroupLimitedTopK)
from pocketllm.workers.models.base import GatedMLP, check_tensor_parallel  # noqa: E402
from pocketllm.workers.models.deepseek import DeepseekMoE, deepseek_arch_config  # noqa: E402
from test_worker_parity import GREEDY_LP, NEW_TOKENS, PROMPT, hf_greedy, make_runner  # noqa: E402
from tiny_checkpoints import make_tiny_checkpoint, run_step, tables  # noqa: E402
from family_parity import assert_matches, assert_tp2_equals_one_rank, run  # noqa: E402

V2, V3 = "DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM"


@pytest.fixture(scope="module", params=["deepseek_v3", "deepseek_v2"])
def path(request, tmp_path_factory) -> str:
    return make_tiny_checkpoint(request.param, str(tmp_path_factory.mktemp(request.param)))


@pytest.fixture(scope="module")
def reference(path):
    return hf_greedy(path, PROMPT, NEW_TOKENS)


@pytest.fixture(scope="module")
def runner(path):
    return make_runner(path)


# ---------------------------------------------------------------------- the model


def test_layers_and_latent_cache_follow_the_config(runner):
    model = runner.model
    assert [type(layer.mlp) for layer in model.layers] == [GatedMLP, DeepseekMoE, DeepseekMoE]
    assert isinstance(model.layers[1].mlp.experts, FusedMoE)
    assert model.layers[1].mlp.experts.gate.dtype == torch.float32  # as transformers keeps it
    assert isinstance(runner.backend, MlaBackend)
    # one group of kind "mla": a row of kv_lora_rank + qk_rope_head_dim per position
    mla = model.cfg.mla
    width = mla.kv_lora_rank + mla.qk_rope_head_dim
    assert width == (32 if model.cfg.architecture == V2 else 48)
    (group,) = runner.capabilities().cache_groups
    assert group.spec == CacheSpec("mla") and group.num_layers == 3 and group.num_blocks == 64
    (pool,) = runner.kv.pools
    assert pool.shape == (3, 65 * 4, width)
    cache, nothing = runner.kv_caches[2]
    assert nothing is None and cache.data_ptr() == pool[2].data_ptr()


def test_greedy_tokens_and_logprobs_match_transformers(runner, reference):
    out, driver = run(runner, {"r": PROMPT})
    assert len(set(out["r"])) > 3, "a degenerate reference would prove little"
    assert_matches(out["r"], driver.reqs["r"].logprobs, reference)


@pytest.mark.parametrize("chunk, preempt_after", [(5, None), (3, None), (None, 6), (7, 9)])
def test_chunked_prefill_and_preemption_keep_the_tokens(runner, reference, chunk, preempt_after):
    out, driver = run(runner, {"r": PROMPT}, chunk=chunk, preempt_after=preempt_after)
    assert_matches(out["r"], driver.reqs["r"].logprobs, reference)


def test_prefix_cache_hit_reads_the_cached_latents(runner, path):
    """A second request whose first two blocks the first one wrote computes only the rest:
    its prefill expands keys from latents it did not write."""
    other = [random.Random(11).randrange(3, 512) for _ in range(9)]
    tokens = PROMPT[:8] + other
    ref_tokens, _ = hf_greedy(path, tokens, 1)
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
    """Decodes and prefill chunks share steps (the absorbed decode of some rows beside the
    expanded prefill of others)."""
    prompts = {f"p{i}": [random.Random(20 + i).randrange(3, 512) for _ in range(n)]
               for i, n in enumerate((3, 11, 26))}
    alone = {rid: run(runner, {rid: p}, new_tokens=10)[0][rid] for rid, p in prompts.items()}
    assert run(runner, prompts, new_tokens=10, chunk=6)[0] == alone


def test_engine_with_prefix_caching_chunked_prefill_and_preemption(path, runner):
    """The scheduler manages the mla group like full attention: a KV cache too small for the
    batch, shared prefixes, an 8-token step budget; every output equals that request's alone."""
    rng = random.Random(4)
    shared = [rng.randrange(3, 512) for _ in range(12)]
    prompts = [shared + [rng.randrange(3, 512) for _ in range(rng.randrange(1, 15))]
               if i % 2 else [rng.randrange(3, 512) for _ in range(rng.randrange(4, 25))]
               for i in range(8)]
    alone = [run(runner, {"x": p}, new_tokens=24)[0]["x"] for p in prompts]
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    from pocketllm.bench.throughput import settled_stats

    with LLM(EngineArgs(model=path, device="cpu", block_size=4, num_kv_blocks=24,
                        max_num_batched_tokens=8, enable_prefix_caching=True,
                        enable_chunked_prefill=True, shutdown_timeout=3)) as llm:
        outs = llm.generate(prompts, params)
        stats = settled_stats(llm)
    assert [o.token_ids for o in outs] == alone
    assert stats.preemptions > 0 and stats.prefix_cache_hits > 0  # both were exercised


def test_tp2_over_gloo_equals_one_rank(path, runner):
    """Heads split across the ranks (q and kv_b by head, o_proj by row), the latent
    projection replicated; experts and shared experts split by intermediate column, one
    all-reduce for both."""
    assert_tp2_equals_one_rank(path, runner)


def test_kv_budget_buys_latent_rows(path):
    """The pool is sized at the latent's width: 3 layers x (kv_lora_rank +
    qk_rope_head_dim) values x 4 bytes per position, not 2 x heads x head_dim."""
    budget = 0.0001  # GiB
    from pocketllm.workers.runner import ModelRunner

    args = EngineArgs(model=path, device="cpu", dtype="float32", block_size=4,
                      max_num_seqs=4, kv_cache_memory_gb=budget)
    runner = ModelRunner(load_model_info(args), args)
    width = runner.model.cfg.mla.latent_width
    per_block = 3 * 4 * width * 4  # layers x block_size x latent row x float32
    assert runner.num_kv_blocks == int(budget * (1 << 30)) // per_block
    assert runner.kv.pools[0].shape == (3, (runner.num_kv_blocks + 1) * 4, width)


# ---------------------------------------------------------------------- routing


def _hf_router(cls_name: str, **cfg):
    module = getattr(transformers.models, "deepseek_v3" if "V3" in cls_name else "deepseek_v2")
    config_cls = transformers.DeepseekV3Config if "V3" in cls_name else transformers.DeepseekV2Config
    config = config_cls(hidden_size=16, num_attention_heads=4, n_routed_experts=16, **cfg)
    router = getattr(getattr(module, f"modeling_{module.__name__.rsplit('.', 1)[1]}"),
                     cls_name)(config)
    with torch.no_grad():
        router.weight.copy_(torch.eye(16))  # router logits = the input rows
    return router


def _same_choice(mine, theirs):
    """Equal expert sets per row, each with the same weight (order may differ)."""
    (w, ids), (w_ref, ids_ref) = mine, theirs
    order, order_ref = ids.argsort(-1), ids_ref.argsort(-1)
    assert torch.equal(ids.gather(1, order), ids_ref.gather(1, order_ref))
    torch.testing.assert_close(w.gather(1, order), w_ref.gather(1, order_ref).float(),
                               atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("n_group, topk_group", [(4, 2), (8, 3), (1, 1)])
@pytest.mark.parametrize("norm", [True, False])
def test_sigmoid_grouped_topk_equals_transformers(n_group, topk_group, norm):
    router = _hf_router("DeepseekV3TopkRouter", num_experts_per_tok=4, n_group=n_group,
                        topk_group=topk_group, norm_topk_prob=norm, routed_scaling_factor=2.5)
    gen = torch.Generator().manual_seed(n_group * 10 + topk_group)
    bias = torch.randn(16, generator=gen) * 0.5
    router.e_score_correction_bias.copy_(bias)
    mine = SigmoidGroupedTopK(16, n_group, topk_group, norm, 2.5, torch.device("cpu"))
    with torch.no_grad():
        mine.bias.copy_(bias)
    logits = torch.randn(64, 16, generator=gen) * 2
    _, w_ref, ids_ref = router(logits)
    _same_choice(mine(logits, 4), (w_ref, ids_ref))
    # the bias chooses but does not weigh: the weights are the unbiased sigmoid scores
    w, ids = mine(logits, 4)
    raw = logits.sigmoid().gather(1, ids)
    expected = (raw / raw.sum(-1, keepdim=True) if norm else raw) * 2.5
    torch.testing.assert_close(w, expected)


@pytest.mark.parametrize("method", ["greedy", "group_limited_greedy"])
def test_softmax_group_limited_topk_equals_transformers(method):
    router = _hf_router("DeepseekV2TopkRouter", num_experts_per_tok=3, topk_method=method,
                        n_group=4, topk_group=2, routed_scaling_factor=1.5)
    mine = SoftmaxGroupLimitedTopK(method == "group_limited_greedy", 4, 2, 1.5)
    logits = torch.randn(64, 16, generator=torch.Generator().manual_seed(5)) * 2
    _, w_ref, ids_ref = router(logits)
    _same_choice(mine(logits, 3), (w_ref, ids_ref))
    if method == "group_limited_greedy":  # every choice lies in one of the 2 best groups
        groups = torch.softmax(logits, -1).view(64, 4, 4).max(-1).values.topk(2).indices
        _w, ids = mine(logits, 3)
        assert all(set((ids[t] // 4).tolist()) <= set(groups[t].tolist()) for t in range(64))


# ---------------------------------------------------------------------- latent decode


def test_latent_decode_equals_its_definition():
    """Each sequence's query over its paged latent rows, against a plain softmax over the
    positions; unused blocks hold NaN (the table's padding names block 0) and must not leak;
    rows of q not in q_rows are left alone."""
    gen = torch.Generator().manual_seed(0)
    heads, rank, rope, bs = 3, 12, 4, 4
    cache = torch.randn(20 * bs, rank + rope, generator=gen)
    cache[0:bs] = float("nan")  # block 0: never any sequence's
    lens = [1, 7, 13]
    perm = torch.randperm(19, generator=gen)[:10] + 1
    blocks = [perm[:1].tolist(), perm[1:3].tolist(), perm[3:7].tolist()]
    width = max(len(b) for b in blocks)
    table = torch.tensor([b + [0] * (width - len(b)) for b in blocks], dtype=torch.int32)
    q_lat = torch.randn(5, heads, rank, generator=gen)
    q_rope = torch.randn(5, heads, rope, generator=gen)
    rows = torch.tensor([4, 0, 2])
    out = torch.full((5, heads, rank), 7.0)
    got = mla_decode_attention(q_lat, q_rope, cache, table, torch.tensor(lens, dtype=torch.int32),
                               rows, max(lens), bs, 0.3, out)
    assert got is out and torch.equal(out[1], torch.full((heads, rank), 7.0))
    for b, length in enumerate(lens):
        slots = [blocks[b][p // bs] * bs + p % bs for p in range(length)]
        keys = cache[slots]  # [L, R+P]
        q = torch.cat((q_lat[rows[b]], q_rope[rows[b]]), -1)  # [H, R+P]
        probs = torch.softmax(q @ keys.T * 0.3, -1)
        torch.testing.assert_close(out[rows[b]], probs @ keys[:, :rank])


# ---------------------------------------------------------------------- config

V3_TINY = dict(architectures=[V3], hidden_size=64, intermediate_size=128, num_hidden_layers=4,
               num_attention_heads=4, vocab_size=512, q_lora_rank=48, kv_lora_rank=32,
               qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=20, n_routed_experts=8,
               num_experts_per_tok=2, n_group=4, topk_group=2, moe_intermediate_size=32,
               n_shared_experts=1, first_k_dense_replace=1)
V2_TINY = {**V3_TINY, "architectures": [V2], "q_lora_rank": None, "n_group": None,
           "topk_group": None, "topk_method": "greedy"}


@pytest.mark.parametrize("arch", [V2, V3])
def test_defaults_match_transformers(arch):
    ref = (transformers.DeepseekV3Config() if arch == V3
           else transformers.DeepseekV2Config(num_experts_per_tok=6))
    cfg = deepseek_arch_config({"architectures": [arch]} | (
        {} if arch == V3 else {"num_experts_per_tok": 6}), arch)
    assert (cfg.vocab_size, cfg.hidden_size, cfg.intermediate_size, cfg.num_layers,
            cfg.num_heads, cfg.max_position_embeddings, cfg.tie_word_embeddings) == (
        ref.vocab_size, ref.hidden_size, ref.intermediate_size, ref.num_hidden_layers,
        ref.num_attention_heads, ref.max_position_embeddings, ref.tie_word_embeddings)
    m = cfg.mla
    assert (m.q_lora_rank, m.kv_lora_rank, m.qk_nope_head_dim, m.qk_rope_head_dim,
            m.v_head_dim) == (ref.q_lora_rank, ref.kv_lora_rank, ref.qk_nope_head_dim,
                              ref.qk_rope_head_dim, ref.v_head_dim)
    assert (cfg.moe.num_experts, cfg.moe.top_k, cfg.moe.intermediate_size,
            cfg.n_shared_experts) == (ref.n_routed_experts, ref.num_experts_per_tok,
                                      ref.moe_intermediate_size, ref.n_shared_experts)
    assert cfg.sparse_layers == [i >= ref.first_k_dense_replace
                                 for i in range(ref.num_hidden_layers)]
    assert cfg.routing.scaling == ref.routed_scaling_factor
    assert cfg.head_dim == ref.qk_rope_head_dim
    if arch == V3:
        assert cfg.routing.scoring == "sigmoid" and cfg.routing.renormalize
        assert (cfg.routing.n_group, cfg.routing.topk_group) == (ref.n_group, ref.topk_group)
        assert m.rope_interleave == ref.rope_interleave
    else:
        assert cfg.routing.scoring == "softmax" and not cfg.routing.group_limited


def test_yarn_scales_the_softmax_by_mscale_squared():
    """As transformers' yarn_apply_mscale (V2-Lite's rope_scaling)."""
    rope = {"type": "yarn", "factor": 40, "original_max_position_embeddings": 4096,
            "mscale": 0.707, "mscale_all_dim": 0.707, "beta_fast": 32, "beta_slow": 1}
    cfg = deepseek_arch_config({**V2_TINY, "rope_scaling": rope}, V2)
    m = 0.1 * 0.707 * math.log(40) + 1
    assert cfg.attn_scale == pytest.approx((16 + 8) ** -0.5 * m * m)
    assert cfg.rope["default"]["rope_type"] == "yarn"
    assert deepseek_arch_config(V2_TINY, V2).attn_scale == pytest.approx(24 ** -0.5)


def test_sparse_layers_follow_first_k_dense_replace_and_moe_layer_freq():
    cfg = deepseek_arch_config({**V3_TINY, "num_hidden_layers": 6, "moe_layer_freq": 2}, V3)
    assert cfg.sparse_layers == [False, False, True, False, True, False]
    cfg = deepseek_arch_config({**V2_TINY, "n_routed_experts": None}, V2)
    assert not any(cfg.sparse_layers) and cfg.moe is None


@pytest.mark.parametrize("arch, overrides, error, match", [
    (V3, {"scoring_func": "softmax"}, UnsupportedFeatureError, "scoring_func='softmax'"),
    (V3, {"topk_method": "greedy"}, UnsupportedFeatureError, "topk_method='greedy'"),
    (V2, {"topk_method": "noaux_tc"}, UnsupportedFeatureError, "topk_method='noaux_tc'"),
    (V2, {"norm_topk_prob": True}, UnsupportedFeatureError, "norm_topk_prob"),
    (V3, {"attention_bias": True}, UnsupportedFeatureError, "attention_bias"),
    (V2, {"mlp_bias": True}, UnsupportedFeatureError, "mlp_bias"),
    (V3, {"n_group": 3}, CheckpointError, "n_group=3 must divide"),
    (V3, {"topk_group": 5}, CheckpointError, "topk_group=5"),
    (V3, {"n_group": 8, "topk_group": 2}, CheckpointError, "fewer than 2 experts"),
    (V3, {"qk_rope_head_dim": 7}, CheckpointError, "qk_rope_head_dim=7"),
    (V3, {"kv_lora_rank": 0}, CheckpointError, "kv_lora_rank=0"),
    (V3, {"moe_layer_freq": 0}, CheckpointError, "moe_layer_freq=0"),
    (V2, {"num_experts_per_tok": 9}, CheckpointError, "num_experts_per_tok=9 exceeds"),
    (V2, {"num_experts_per_tok": None}, CheckpointError, "num_experts_per_tok is required"),
])
def test_unsupported_and_malformed_configs_are_refused(arch, overrides, error, match):
    base = V3_TINY if arch == V3 else V2_TINY
    with pytest.raises(error, match=match):
        deepseek_arch_config({**base, **overrides}, arch).validate()


def test_shared_experts_that_do_not_split_are_refused():
    cfg = deepseek_arch_config({**V3_TINY, "n_shared_experts": 3, "moe_intermediate_size": 18},
                               V3)
    with pytest.raises(UnsupportedFeatureError, match="n_shared_experts \\* "
                                                      "moe_intermediate_size=54"):
        check_tensor_parallel(cfg, 4)


def test_batch_invariant_mode_is_refused(path):
    from pocketllm.workers import kernel_policy
    from pocketllm.workers.layers.attention import TorchAttention
    from pocketllm.workers.models.registry import build_model

    info = load_model_info(EngineArgs(model=path))
    with kernel_policy.building(True), pytest.raises(UnsupportedFeatureError,
                                                     match="batch_invariant is not supported"):
        build_model(info, TorchAttention(), torch.device("meta"), torch.float32)


def test_multi_token_prediction_layers_are_skipped(path):
    from pocketllm.workers.layers.attention import TorchAttention
    from pocketllm.workers.models.registry import build_model

    info = load_model_info(EngineArgs(model=path))
    model = build_model(info, TorchAttention(), torch.device("meta"), torch.float32)
    name = "model.layers.3.self_attn.kv_b_proj.weight"  # past the 3 layers
    if info.architecture == V3:  # num_nextn_predict_layers=1: layer 3 is the MTP layer
        assert model.canonical_name(name) is None
        assert model.canonical_name("model.layers.4.mlp.gate.weight") is not None
    else:
        assert model.canonical_name(name) == name


# ---------------------------------------------------------------------- dummy, GGUF


def test_shipped_deepseek_v2_lite_shape():
    from pocketllm.workers.models.registry import arch_config, checkpoint_shapes

    info = load_model_info(EngineArgs(model="deepseek-v2-lite", load_format="dummy"))
    shapes = checkpoint_shapes(info)  # built on the meta device: no memory
    p = "model.layers.26."
    assert shapes[f"{p}self_attn.q_proj.weight"] == (16 * 192, 2048)
    assert shapes[f"{p}self_attn.kv_a_proj_with_mqa.weight"] == (576, 2048)
    assert shapes[f"{p}self_attn.kv_b_proj.weight"] == (16 * 256, 512)
    assert shapes[f"{p}self_attn.o_proj.weight"] == (2048, 16 * 128)
    assert shapes[f"{p}mlp.experts.63.gate_proj.weight"] == (1408, 2048)
    assert shapes[f"{p}mlp.shared_experts.up_proj.weight"] == (2 * 1408, 2048)
    assert shapes["model.layers.0.mlp.gate_proj.weight"] == (10944, 2048)
    assert not any("q_a_proj" in n or "e_score_correction_bias" in n for n in shapes)
    cfg = arch_config(info)
    assert cfg.mla.latent_width == 576  # the cache row: 27 x 576 values per token


def test_dummy_weights_run(path):
    runner = make_runner(path, load_format="dummy")
    out, _ = run(runner, {"r": PROMPT}, new_tokens=4)
    assert len(out["r"]) == 4


def test_gguf_deepseek2_is_refused(tmp_path):
    import gguf

    file = str(tmp_path / "deepseek2.gguf")
    w = gguf.GGUFWriter(file, "deepseek2")
    w.add_context_length(512)
    w.add_embedding_length(64)
    w.add_block_count(1)
    w.add_feed_forward_length(128)
    w.add_head_count(4)
    w.add_head_count_kv(4)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_tokenizer_model("llama")
    w.add_token_list([f"<t{i}>" for i in range(8)])
    w.add_token_scores([0.0] * 8)
    w.add_token_types([1] * 8)
    w.add_tensor("token_embd.weight", torch.zeros(8, 64).numpy())
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(CheckpointError, match="GGUF deepseek2 files are not supported"):
        load_model_info(EngineArgs(model=file))
