"""gpt-oss on the torch path against transformers, on a tiny random checkpoint saved by
transformers (layers sliding (window 8), full, sliding; 8 biased experts, top-2; sinks drawn
at std 1; swiglu_limit 1 so the clamp cuts; YaRN rope): greedy tokens and log
probabilities, with chunked prefill, a prefix-cache hit and preemption; through the engine;
at TP=2 over gloo; the router, the clamped SwiGLU, the experts and the sinks against
transformers' modules; config refusals; the shipped gpt-oss-20b shape (MXFP4
checkpoints: test_mxfp4.py)."""

from __future__ import annotations

import json
import random
import shutil

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from pocketllm import LLM, EngineArgs, SamplingParams  # noqa: E402
from pocketllm.errors import CheckpointError, UnsupportedFeatureError  # noqa: E402
from pocketllm.model_info import load_model_info  # noqa: E402
from pocketllm.proto.messages import NewRequestData, StepPlan  # noqa: E402
from pocketllm.workers.distributed import TPGroup  # noqa: E402
from pocketllm.workers.layers.activation import ClampedSwiGLU  # noqa: E402
from pocketllm.workers.layers.attention import _explicit_attention  # noqa: E402
from pocketllm.workers.layers.moe import topk_softmax, torch_experts  # noqa: E402
from pocketllm.workers.models.base import check_tensor_parallel  # noqa: E402
from pocketllm.workers.models.gpt_oss import (GptOssExperts, _deinterleave,  # noqa: E402
                                              gpt_oss_arch_config)
from test_worker_parity import GREEDY_LP, NEW_TOKENS, PROMPT, hf_greedy, make_runner  # noqa: E402
from tiny_checkpoints import (gpt_oss_clamp_from_config, make_tiny_checkpoint,  # noqa: E402
                              run_step, tables)
from family_parity import assert_matches, assert_tp2_equals_one_rank, run  # noqa: E402


@pytest.fixture(scope="module")
def hf_gpt_oss():
    """transformers' gpt-oss module, imported only when a test runs: it imports triton,
    which the kernel tests must import first (tests/kernel_modules.py)."""
    from transformers.models.gpt_oss import modeling_gpt_oss

    return modeling_gpt_oss


@pytest.fixture(scope="module")
def oss_path(tmp_path_factory) -> str:
    return make_tiny_checkpoint("gpt_oss", str(tmp_path_factory.mktemp("gpt-oss")))


@pytest.fixture(scope="module")
def hf_model(oss_path):
    return transformers.AutoModelForCausalLM.from_pretrained(oss_path, dtype=torch.float32,
                                                             attn_implementation="eager")


@pytest.fixture(scope="module")
def reference(oss_path):
    return hf_greedy(oss_path, PROMPT, NEW_TOKENS)


@pytest.fixture(scope="module")
def runner(oss_path):
    return make_runner(oss_path)


def test_the_checkpoint_exercises_sinks_biases_windows_and_the_clamp(hf_model, runner):
    state = hf_model.state_dict()
    assert float(state["model.layers.0.self_attn.sinks"].abs().max()) > 0.5
    assert float(state["model.layers.0.mlp.experts.gate_up_proj_bias"].abs().max()) > 0.1
    assert float(state["model.layers.0.mlp.router.bias"].abs().max()) > 0.1
    assert runner.model.cfg.layer_windows == [8, None, 8]
    assert len(runner.kv.num_blocks) == 2  # a sliding pool and a full one
    assert runner.model.cfg.rope["default"]["rope_type"] == "yarn"
    moe = runner.model.layers[0].mlp
    limit = 1.0 if gpt_oss_clamp_from_config() else 7.0  # (tiny_checkpoints says why)
    assert moe.compute is torch_experts and moe.act == ClampedSwiGLU(1.702, limit)
    # the clamp bites on the prompt's hidden states (else the limit would be untested)
    with torch.no_grad():
        h = hf_model.model.layers[0].post_attention_layernorm(
            hf_model.model.embed_tokens(torch.tensor(PROMPT)))
        gate_up = h @ state["model.layers.0.mlp.experts.gate_up_proj"][0]
    assert float(gate_up.abs().max()) > limit or not gpt_oss_clamp_from_config()


def test_greedy_tokens_and_logprobs_match_transformers(runner, reference):
    out, driver = run(runner, {"r": PROMPT})
    assert len(set(out["r"])) > 3, "a degenerate reference would prove little"
    assert_matches(out["r"], driver.reqs["r"].logprobs, reference)


@pytest.mark.parametrize("chunk, preempt_after", [(5, None), (3, None), (None, 6), (7, 9)])
def test_chunked_prefill_and_preemption_keep_the_tokens(runner, reference, chunk, preempt_after):
    out, driver = run(runner, {"r": PROMPT}, chunk=chunk, preempt_after=preempt_after)
    assert_matches(out["r"], driver.reqs["r"].logprobs, reference)


def test_prefix_cache_hit_computes_only_the_rest(runner, oss_path):
    """A second request whose first two blocks the first one wrote computes only the rest."""
    other = [random.Random(11).randrange(3, 512) for _ in range(9)]
    tokens = PROMPT[:8] + other
    ref_tokens, _ = hf_greedy(oss_path, tokens, 1)
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


def test_engine_with_prefix_caching_chunked_prefill_and_preemption(oss_path, runner):
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

    with LLM(EngineArgs(model=oss_path, device="cpu", block_size=4, num_kv_blocks=24,
                        max_num_batched_tokens=8, enable_prefix_caching=True,
                        enable_chunked_prefill=True, shutdown_timeout=3)) as llm:
        outs = llm.generate(prompts, params)
        stats = settled_stats(llm)
    assert [o.token_ids for o in outs] == alone
    assert stats.preemptions > 0 and stats.prefix_cache_hits > 0  # both were exercised


def test_tp2_over_gloo_equals_one_rank(oss_path, runner):
    assert_tp2_equals_one_rank(oss_path, runner)


def test_tensor_parallel_ranks_hold_their_heads_sinks(oss_path, hf_model):
    """Each rank's sinks are those of its query heads (heads split evenly)."""
    from pocketllm.workers.layers.attention import TorchAttention
    from pocketllm.workers.models.registry import build_model

    info = load_model_info(EngineArgs(model=oss_path))
    sinks = hf_model.state_dict()["model.layers.1.self_attn.sinks"]
    for rank in range(2):
        model = build_model(info, TorchAttention(), torch.device("cpu"), torch.float32,
                            TPGroup(rank, 2))
        target = model.weight_targets()["model.layers.1.self_attn.sinks"]
        assert target.checkpoint_shape == (4,) and target.shape == (2,)
        assert torch.equal(target.shard.take(sinks), sinks[2 * rank:2 * rank + 2])


# ---------------------------------------------------------------------- the pieces


def hf_config(**kw):
    base = dict(hidden_size=24, intermediate_size=20, num_local_experts=6,
                num_experts_per_tok=3, swiglu_limit=1.5, num_attention_heads=4,
                num_key_value_heads=2, head_dim=8, num_hidden_layers=1, vocab_size=32)
    if not gpt_oss_clamp_from_config():
        del base["swiglu_limit"]  # an older transformers clamps at 7.0 whatever this says
    return transformers.GptOssConfig(**{**base, **kw})


def test_router_equals_transformers(hf_gpt_oss):
    torch.manual_seed(0)
    router = hf_gpt_oss.GptOssTopKRouter(hf_config())
    with torch.no_grad():
        router.weight.normal_(0, 1)
        router.bias.normal_(0, 1)
        x = torch.randn(9, 24)
        _, scores, ids = router(x)
        weights, ours = topk_softmax(torch.nn.functional.linear(x, router.weight, router.bias), 3)
    assert torch.equal(ours, ids) and weights.dtype == torch.float32
    torch.testing.assert_close(weights, scores)
    torch.testing.assert_close(weights.sum(-1), torch.ones(9))  # softmax over the k chosen


def test_clamped_swiglu_equals_transformers_on_deinterleaved_rows(hf_gpt_oss):
    experts = hf_gpt_oss.GptOssExperts(hf_config())
    gate_up = torch.randn(7, 40) * 4  # wide enough that both clamps cut
    assert (gate_up[:, 0::2] > 1.5).any() and (gate_up[:, 1::2] < -1.5).any()
    ours = ClampedSwiGLU(experts.alpha, experts.limit)(_deinterleave(gate_up))
    torch.testing.assert_close(ours, experts._apply_gate(gate_up))


def _load(layer, state):
    with torch.no_grad():
        for name, target in layer.weight_targets("mlp.").items():
            value = state[name] if target.shard is None else target.shard.take(state[name])
            if target.transform is not None:
                value = target.transform(value)
            target.dest.copy_(value)
    return layer


@pytest.mark.parametrize("tokens", [1, 5, 33])
def test_experts_equal_transformers_whole_and_split_across_ranks(tokens, hf_gpt_oss):
    """FusedMoE loaded from transformers' stacked interleaved tensors computes what
    GptOssMLP does; two ranks' partial sums (down bias on rank 0 only) add to it."""
    cfg = hf_config()
    torch.manual_seed(tokens)
    mlp = hf_gpt_oss.GptOssMLP(cfg)
    with torch.no_grad():
        for p in mlp.parameters():
            p.normal_(0, 0.5)
    state = {f"mlp.{k}": v for k, v in mlp.state_dict().items()}
    spec = gpt_oss_arch_config({**cfg.to_dict(), "architectures": ["GptOssForCausalLM"]},
                               "GptOssForCausalLM").moe
    x = torch.randn(tokens, 24)

    def ours(rank, world):
        return _load(GptOssExperts(24, spec, topk_softmax, torch.device("cpu"), torch.float32,
                                   TPGroup(rank, world)), state)

    with torch.no_grad():
        want, _ = mlp(x.unsqueeze(0))
        whole = ours(0, 1)(x)
        parts = sum(ours(r, 2)(x, reduce=False) for r in range(2))
    torch.testing.assert_close(whole, want[0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(parts, whole, atol=1e-5, rtol=1e-5)


def test_sinks_scale_each_row_by_the_mass_the_sink_takes(hf_gpt_oss):
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 4, 5, 8, generator=gen) for _ in range(3))
    sinks = torch.tensor([0.0, 2.0, -1.0, 3.0])
    plain = _explicit_attention(q, k[:, :2], v[:, :2], None, True, 0.3, None, None)
    with_sinks = _explicit_attention(q, k[:, :2], v[:, :2], None, True, 0.3, None, sinks)
    kk, vv = k[:, :2].repeat_interleave(2, 1), v[:, :2].repeat_interleave(2, 1)
    scores = (q @ kk.transpose(-1, -2) * 0.3).masked_fill(
        ~torch.ones(5, 5, dtype=torch.bool).tril(), float("-inf"))
    mass = scores.exp().sum(-1, keepdim=True)
    kept = mass / (mass + sinks.exp().view(1, 4, 1, 1))
    torch.testing.assert_close(with_sinks, plain * kept)
    torch.testing.assert_close(plain, torch.nn.functional.scaled_dot_product_attention(
        q, kk, vv, is_causal=True, scale=0.3))
    # and transformers' eager attention agrees (its mask is additive)
    module = torch.nn.Module()
    module.num_key_value_groups, module.sinks, module.training = 2, sinks, False
    ref, _ = hf_gpt_oss.eager_attention_forward(
        module, q, k[:, :2], v[:, :2], torch.zeros(5, 5).masked_fill(
            ~torch.ones(5, 5, dtype=torch.bool).tril(), float("-inf")), 0.3)
    torch.testing.assert_close(with_sinks.transpose(1, 2), ref)


# ---------------------------------------------------------------------- config


BASE = dict(architectures=["GptOssForCausalLM"], hidden_size=64, intermediate_size=48,
            num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
            vocab_size=512, num_local_experts=8, num_experts_per_tok=2)


def test_defaults_match_transformers():
    ref = transformers.GptOssConfig()
    cfg = gpt_oss_arch_config({"architectures": ["GptOssForCausalLM"]}, "GptOssForCausalLM")
    assert (cfg.vocab_size, cfg.hidden_size, cfg.num_layers, cfg.num_heads, cfg.num_kv_heads,
            cfg.head_dim, cfg.max_position_embeddings, cfg.tie_word_embeddings,
            cfg.rms_norm_eps) == (
        ref.vocab_size, ref.hidden_size, ref.num_hidden_layers, ref.num_attention_heads,
        ref.num_key_value_heads, ref.head_dim, ref.max_position_embeddings,
        ref.tie_word_embeddings, ref.rms_norm_eps)
    m = cfg.moe
    assert (m.num_experts, m.top_k, m.intermediate_size, m.swiglu_alpha, m.swiglu_limit) == (
        ref.num_local_experts, ref.num_experts_per_tok, ref.intermediate_size,
        getattr(ref, "swiglu_alpha", 1.702), getattr(ref, "swiglu_limit", 7.0))  # 5.17: fixed
    assert cfg.layer_windows == [ref.sliding_window if t == "sliding_attention" else None
                                 for t in ref.layer_types]
    rope = cfg.rope["default"]
    assert {k: rope[k] for k in ref.rope_parameters} == ref.rope_parameters
    assert cfg.attn_sinks and cfg.qkv_bias and cfg.o_bias and all(cfg.sparse_layers)


def test_yarn_tables_equal_transformers(hf_gpt_oss):
    from pocketllm.workers.layers.rotary import rope_inv_freq

    ref = transformers.GptOssConfig()
    hf_rope = hf_gpt_oss.GptOssRotaryEmbedding(ref)
    cfg = gpt_oss_arch_config({"architectures": ["GptOssForCausalLM"]}, "GptOssForCausalLM")
    inv_freq, scale = rope_inv_freq(cfg.head_dim, cfg.rope["default"],
                                    cfg.max_position_embeddings)
    torch.testing.assert_close(inv_freq, hf_rope.inv_freq)
    assert scale == pytest.approx(hf_rope.attention_scaling)


@pytest.mark.parametrize("method", ["bitsandbytes", "fp8"])
def test_other_quantizations_are_refused_by_name(method):
    with pytest.raises(CheckpointError, match=f"quant_method='{method}' is not supported"):
        gpt_oss_arch_config({**BASE, "quantization_config": {"quant_method": method}},
                            "GptOssForCausalLM")
    assert gpt_oss_arch_config({**BASE, "quantization_config": {"quant_method": "mxfp4"}},
                               "GptOssForCausalLM").mxfp4


def test_mxfp4_tensors_without_the_config_are_refused(oss_path, tmp_path):
    """A file holding MXFP4 expert parts whose config does not say MXFP4 is refused by the
    tensor's name at load."""
    from safetensors.torch import load_file, save_file

    path = shutil.copytree(oss_path, tmp_path / "mxfp4")
    state = load_file(path / "model.safetensors")
    state["model.layers.0.mlp.experts.gate_up_proj_blocks"] = torch.zeros(8, 96, 2, 16,
                                                                          dtype=torch.uint8)
    save_file(state, path / "model.safetensors")
    with pytest.raises(CheckpointError, match="gate_up_proj_blocks.*MXFP4-quantized part"):
        make_runner(str(path))


def test_bad_configs_are_refused(tmp_path):
    with pytest.raises(CheckpointError, match="sliding_window is null"):
        gpt_oss_arch_config({**BASE, "sliding_window": None}, "GptOssForCausalLM")
    with pytest.raises(CheckpointError, match="unsupported layer_types"):
        gpt_oss_arch_config({**BASE, "layer_types": ["chunked_attention"] * 4},
                            "GptOssForCausalLM")
    with pytest.raises(CheckpointError, match="num_experts_per_tok=9 exceeds"):
        gpt_oss_arch_config({**BASE, "num_experts_per_tok": 9}, "GptOssForCausalLM").validate()
    cfg = gpt_oss_arch_config({**BASE, "intermediate_size": 50}, "GptOssForCausalLM")
    with pytest.raises(UnsupportedFeatureError, match="moe_intermediate_size=50 is not "
                                                      "divisible by tensor_parallel_size=4"):
        check_tensor_parallel(cfg, 4)


# ---------------------------------------------------------------------- dummy weights


def test_shipped_gpt_oss_20b_shape():
    from pocketllm.workers.models.registry import checkpoint_shapes

    info = load_model_info(EngineArgs(model="gpt-oss-20b", load_format="dummy"))
    assert info.architecture == "GptOssForCausalLM"
    shapes = checkpoint_shapes(info)  # built on the meta device: no memory
    assert shapes["model.layers.23.mlp.experts.gate_up_proj"] == (32, 2880, 5760)
    assert shapes["model.layers.23.mlp.experts.gate_up_proj_bias"] == (32, 5760)
    assert shapes["model.layers.0.mlp.experts.down_proj"] == (32, 2880, 2880)
    assert shapes["model.layers.0.mlp.router.weight"] == (32, 2880)
    assert shapes["model.layers.0.self_attn.sinks"] == (64,)
    assert shapes["model.layers.0.self_attn.q_proj.weight"] == (4096, 2880)
    assert shapes["model.layers.0.self_attn.k_proj.bias"] == (512,)
    assert shapes["lm_head.weight"] == (201088, 2880)
    cfg = gpt_oss_arch_config(info.hf_config, info.architecture)
    assert cfg.layer_windows[:4] == [128, None, 128, None]


def test_dummy_weights_run(oss_path, tmp_path):
    bare = tmp_path / "bare"
    bare.mkdir()
    shutil.copy(f"{oss_path}/config.json", bare / "config.json")
    assert json.loads((bare / "config.json").read_text())["architectures"] == [
        "GptOssForCausalLM"]
    runner = make_runner(str(bare), load_format="dummy")
    moe = runner.model.layers[2].mlp
    assert 0.015 < float(moe.w13.std()) < 0.025 and not torch.equal(moe.w13[0], moe.w13[1])
    assert float(runner.model.layers[0].self_attn.sinks.abs().max()) > 0
    out, _ = run(runner, {"r": PROMPT}, new_tokens=4)
    assert len(out["r"]) == 4


def test_per_expert_checkpoints_with_biases_load_into_the_same_layer():
    """FusedMoE's own (Qwen-style, one tensor per expert) names carry the biases too, so a
    family storing biased experts per expert loads into the same stacked parameters."""
    from pocketllm.workers.layers.moe import FusedMoE

    spec = gpt_oss_arch_config({**BASE, "intermediate_size": 20, "hidden_size": 24,
                                "num_local_experts": 3}, "GptOssForCausalLM").moe
    gen = torch.Generator().manual_seed(5)
    stacked = {"mlp.router.weight": torch.randn(3, 24, generator=gen),
               "mlp.router.bias": torch.randn(3, generator=gen),
               "mlp.experts.gate_up_proj": torch.randn(3, 24, 40, generator=gen),
               "mlp.experts.gate_up_proj_bias": torch.randn(3, 40, generator=gen),
               "mlp.experts.down_proj": torch.randn(3, 20, 24, generator=gen),
               "mlp.experts.down_proj_bias": torch.randn(3, 24, generator=gen)}
    per_expert = {"mlp.gate.weight": stacked["mlp.router.weight"],
                  "mlp.gate.bias": stacked["mlp.router.bias"]}
    for e in range(3):
        gu = stacked["mlp.experts.gate_up_proj"][e]
        gub = stacked["mlp.experts.gate_up_proj_bias"][e]
        p = f"mlp.experts.{e}."
        per_expert |= {p + "gate_proj.weight": gu[:, 0::2].T, p + "up_proj.weight": gu[:, 1::2].T,
                       p + "down_proj.weight": stacked["mlp.experts.down_proj"][e].T,
                       p + "gate_proj.bias": gub[0::2], p + "up_proj.bias": gub[1::2],
                       p + "down_proj.bias": stacked["mlp.experts.down_proj_bias"][e]}
    cpu = torch.device("cpu")
    a = _load(GptOssExperts(24, spec, topk_softmax, cpu, torch.float32), stacked)
    b = _load(FusedMoE(24, spec, topk_softmax, cpu, torch.float32), per_expert)
    assert set(b.weight_targets("mlp.")) == set(per_expert)
    x = torch.randn(6, 24, generator=gen)
    with torch.no_grad():
        torch.testing.assert_close(a(x), b(x))
