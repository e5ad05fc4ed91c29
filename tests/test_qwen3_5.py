"""The hybrid Gated DeltaNet families on the torch path against transformers, on tiny
random checkpoints saved by transformers: Qwen3.5 (full attention every fourth layer),
Qwen3.5-MoE (every second; routed experts plus a gated shared expert) and Qwen3-Next (its
interleaved projections). Greedy tokens and log probabilities for 32 steps; chunked
prefill with boundaries inside the delta rule's 64-token chunks; preemption; batched
requests in separate state slots; through the engine; at TP=2 over gloo; the state
budget; config refusals. The delta rule's own forms: test_gated_delta.py."""

from __future__ import annotations

import random

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
if not hasattr(transformers, "Qwen3_5ForCausalLM"):
    pytest.skip("this transformers has no Qwen3.5 (5.2 and later do)", allow_module_level=True)

from pocketllm import LLM, EngineArgs, SamplingParams  # noqa: E402
from pocketllm.errors import CheckpointError, InvalidRequestError  # noqa: E402
from pocketllm.model_info import load_model_info  # noqa: E402
from pocketllm.workers.runner import ModelRunner  # noqa: E402
from pocketllm.workers.layers.linear_attention import GatedDeltaNet  # noqa: E402
from pocketllm.workers.models.qwen3_5 import GatedAttention, SharedExpertMoE  # noqa: E402
from pocketllm.workers.models.qwen3_5_config import qwen3_5_arch_config  # noqa: E402
from test_worker_parity import PROMPT, NEW_TOKENS, hf_greedy, make_runner  # noqa: E402
from tiny_checkpoints import make_tiny_checkpoint  # noqa: E402
from family_parity import assert_matches, assert_tp2_equals_one_rank, run  # noqa: E402

FAMILIES = ("qwen3_5", "qwen3_5_moe", "qwen3_next")
LONG = [random.Random(5).randrange(3, 512) for _ in range(150)]  # > two 64-token chunks


@pytest.fixture(scope="module", params=FAMILIES)
def family(request):
    path = make_tiny_checkpoint(request.param)
    return request.param, path, make_runner(path), hf_greedy(path, PROMPT, NEW_TOKENS)


def test_layers_follow_the_config(family):
    name, _, runner, _ = family
    mixers = [type(layer.self_attn) for layer in runner.model.layers]
    if name == "qwen3_5_moe":
        assert mixers == [GatedDeltaNet, GatedAttention] * 2
        assert all(isinstance(layer.mlp, SharedExpertMoE) for layer in runner.model.layers)
    else:
        assert mixers == [GatedDeltaNet] * 3 + [GatedAttention]
    groups = runner.capabilities().cache_groups
    assert [(g.spec.kind, g.num_layers) for g in groups] == [
        ("full", mixers.count(GatedAttention)), ("state", mixers.count(GatedDeltaNet))]
    assert groups[1].num_blocks == 8  # a slot per sequence (max_num_seqs), as many snapshots


@pytest.mark.parametrize("chunk, preempt_after", [(None, None), (5, None), (3, None),
                                                  (None, 6), (7, 9)])
def test_greedy_tokens_and_logprobs_match_transformers(family, chunk, preempt_after):
    _, _, runner, reference = family
    out, driver = run(runner, {"r": PROMPT}, chunk=chunk, preempt_after=preempt_after)
    assert len(set(out["r"])) > 3, "a degenerate reference would prove little"
    assert_matches(out["r"], driver.reqs["r"].logprobs, reference)


def test_chunk_boundaries_inside_and_across_delta_rule_chunks(family):
    """A 150-token prompt one-shot (three chunks of the chunked form: 64, 64, 22) and in
    steps of 37 and 50 tokens (boundaries inside those chunks): the same as transformers."""
    _, path, runner, _ = family
    reference = hf_greedy(path, LONG, 8)
    for chunk in (None, 37, 50):
        out, driver = run(runner, {"r": LONG}, new_tokens=8, chunk=chunk)
        assert_matches(out["r"], driver.reqs["r"].logprobs, reference, tol=2e-4)


def test_batched_requests_equal_each_alone(family):
    """Decodes of several slots batched, prefill chunks beside them: no state crosses."""
    _, _, runner, _ = family
    prompts = {f"p{i}": [random.Random(20 + i).randrange(3, 512) for _ in range(n)]
               for i, n in enumerate((1, 11, 26))}
    alone = {rid: run(runner, {rid: p}, new_tokens=10)[0][rid] for rid, p in prompts.items()}
    assert run(runner, prompts, new_tokens=10, chunk=6)[0] == alone


def test_engine_with_chunked_prefill_preemption_and_shared_prefixes():
    """The scheduler's own paths (a KV cache too small for the batch, fewer state slots
    than requests, shared prefixes served from state snapshots, an 8-token step budget):
    every output equals that request's alone."""
    path = make_tiny_checkpoint("qwen3_5")
    runner = make_runner(path)
    rng = random.Random(4)
    shared = [rng.randrange(3, 512) for _ in range(12)]
    prompts = [shared + [rng.randrange(3, 512) for _ in range(rng.randrange(1, 15))]
               if i % 2 else [rng.randrange(3, 512) for _ in range(rng.randrange(4, 25))]
               for i in range(8)]
    alone = [run(runner, {"x": p}, new_tokens=24)[0]["x"] for p in prompts]
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    from pocketllm.bench.throughput import settled_stats

    with LLM(EngineArgs(model=path, device="cpu", block_size=4, num_kv_blocks=24,
                        max_num_seqs=3, max_num_batched_tokens=8, enable_prefix_caching=True,
                        enable_chunked_prefill=True, shutdown_timeout=3)) as llm:
        outs = llm.generate(prompts, params)
        stats = settled_stats(llm)
    assert [o.token_ids for o in outs] == alone
    assert stats.preemptions > 0 and stats.prefix_cache_hits > 0


def test_tp2_over_gloo_equals_one_rank():
    """Each rank holds half the key and value heads (and their states)."""
    path = make_tiny_checkpoint("qwen3_5_moe")
    runner = make_runner(path)
    assert_tp2_equals_one_rank(path, runner)


# ---------------------------------------------------------------------- the state budget


def test_state_slots_shrink_to_half_the_budget_and_refuse_below_one():
    path = make_tiny_checkpoint("qwen3_5")
    # one slot: 3 layers x (conv 128 x 3 x 4 B + state 4 x 16 x 16 x 4 B) = 16,896 bytes
    slot = 3 * (128 * 3 * 4 + 4 * 16 * 16 * 4)

    def runner_with(budget_bytes):
        args = EngineArgs(model=path, device="cpu", dtype="float32", block_size=4,
                          max_num_seqs=4, kv_cache_memory_gb=budget_bytes / (1 << 30))
        return ModelRunner(load_model_info(args), args)

    runner = runner_with(5 * slot)
    assert runner.kv.num_blocks[1] == 2  # half of 5 slots' bytes, below max_num_seqs=4
    assert runner.kv.state_slot_bytes(1) == slot
    assert runner.capabilities().state_step_bytes == 2 * slot  # read and written a step
    with pytest.raises(InvalidRequestError, match="recurrent state of one sequence needs"):
        runner_with(slot)


# ---------------------------------------------------------------------- config


def test_defaults_match_transformers():
    for hf_cls, arch in ((transformers.Qwen3_5TextConfig, "Qwen3_5ForCausalLM"),
                         (transformers.Qwen3_5MoeTextConfig, "Qwen3_5MoeForCausalLM"),
                         (transformers.Qwen3NextConfig, "Qwen3NextForCausalLM")):
        ref = hf_cls()
        cfg = qwen3_5_arch_config({"architectures": [arch], "model_type": ref.model_type}, arch)
        assert (cfg.vocab_size, cfg.hidden_size, cfg.num_layers, cfg.num_heads,
                cfg.num_kv_heads, cfg.head_dim, cfg.max_position_embeddings) == (
            ref.vocab_size, ref.hidden_size, ref.num_hidden_layers, ref.num_attention_heads,
            ref.num_key_value_heads, ref.head_dim, ref.max_position_embeddings), arch
        kinds = ["linear_attention" if lin else "full_attention" for lin in cfg.linear_layers]
        assert kinds == ref.layer_types, arch
        g = cfg.gdn
        assert (g.num_k_heads, g.num_v_heads, g.k_head_dim, g.v_head_dim, g.conv_kernel) == (
            ref.linear_num_key_heads, ref.linear_num_value_heads, ref.linear_key_head_dim,
            ref.linear_value_head_dim, ref.linear_conv_kernel_dim), arch
        assert cfg.rope["default"]["partial_rotary_factor"] == \
            ref.rope_parameters["partial_rotary_factor"]
        if cfg.moe is not None:
            assert (cfg.moe.num_experts, cfg.moe.top_k, cfg.moe.intermediate_size,
                    cfg.shared_expert_size) == (ref.num_experts, ref.num_experts_per_tok,
                                                ref.moe_intermediate_size,
                                                ref.shared_expert_intermediate_size), arch


BASE = dict(architectures=["Qwen3_5ForCausalLM"], model_type="qwen3_5_text", hidden_size=64,
            num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
            vocab_size=512, linear_num_key_heads=2, linear_num_value_heads=4)


@pytest.mark.parametrize("overrides, match", [
    ({"layer_types": ["linear_attention"] * 4}, "every layer is linear attention"),
    ({"layer_types": ["mamba"] * 4}, "unsupported layer_types"),
    ({"linear_num_value_heads": 3}, "not a multiple of linear_num_key_heads"),
    ({"linear_conv_kernel_dim": 0}, "conv_kernel=0"),
    ({"full_attention_interval": 0}, "full_attention_interval=0"),
])
def test_bad_configs_are_refused(overrides, match):
    with pytest.raises(CheckpointError, match=match):
        qwen3_5_arch_config({**BASE, **overrides}, "Qwen3_5ForCausalLM").validate()


def test_multimodal_checkpoint_serves_its_text_tower(tmp_path):
    """Qwen3_5ForConditionalGeneration: the language model's tensors under
    ``model.language_model.``, a vision tower skipped; text generation equals transformers'
    multimodal model given text alone."""
    import shutil

    text = make_tiny_checkpoint("qwen3_5")
    config = transformers.AutoConfig.from_pretrained(text)
    vision = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64,
                  num_position_embeddings=64)
    torch.manual_seed(3)
    model = transformers.Qwen3_5ForConditionalGeneration(transformers.Qwen3_5Config(
        text_config=config.to_dict(), vision_config=vision, tie_word_embeddings=False))
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.normal_(1.0 if "norm" in name else 0.0, 0.1 if "norm" in name else 0.15)
    model.save_pretrained(tmp_path)
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        shutil.copy(f"{text}/{name}", tmp_path / name)
    with torch.inference_mode():
        out = model.generate(torch.tensor([PROMPT]), max_new_tokens=12, do_sample=False,
                             pad_token_id=0, eos_token_id=None)
    runner = make_runner(str(tmp_path))
    assert run(runner, {"r": PROMPT}, new_tokens=12)[0]["r"] == out[0, len(PROMPT):].tolist()


GPU = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")


@pytest.mark.parametrize("device,graphs", [("cpu", None), pytest.param("cuda", True, marks=GPU),
                                           pytest.param("cuda", False, marks=GPU)])
def test_prefix_cache_serves_a_shared_prefix_and_a_later_turn_from_state_snapshots(device,
                                                                                     graphs):
    """Through the engine, blocks of 16: prompt a (1,050 tokens) leaves state snapshots at
    1,024 (every STATE_SNAPSHOT_TOKENS) and at its last boundary, 1,040. Prompt b shares its
    first 1,030 tokens and resumes at 1,024; c, a's next turn (a, its answer and more),
    resumes at 1,040. Each answer equals the one computed from scratch (on a GPU, by the
    same engine without the cache, CUDA graphs on and off); the hits are the prefix-cache
    tokens the engine counts (its /metrics' prefix_cache_hits_tokens)."""
    from pocketllm.bench.throughput import settled_stats

    path = make_tiny_checkpoint("qwen3_5", overrides={"max_position_embeddings": 2048})
    rng = random.Random(8)
    a = [rng.randrange(3, 512) for _ in range(1050)]
    b = a[:1030] + [rng.randrange(3, 512) for _ in range(9)]
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    extra = {} if graphs is None else dict(dtype="float32", cuda_graphs=graphs)

    def engine(caching: bool) -> LLM:
        return LLM(EngineArgs(model=path, device=device, enable_prefix_caching=caching,
                              shutdown_timeout=3, **extra))
    with engine(True) as llm:
        out_a = llm.generate([a], params)[0].token_ids
        c = a + out_a + [rng.randrange(3, 512) for _ in range(12)]
        outs = [llm.generate([p], params)[0].token_ids for p in (b, c)]
        stats = settled_stats(llm)
    if device == "cpu":
        args = EngineArgs(model=path, device="cpu", dtype="float32", block_size=4,
                          max_num_seqs=4, num_kv_blocks=600)
        runner = ModelRunner(load_model_info(args), args)
        want = [run(runner, {"x": p}, new_tokens=6)[0]["x"] for p in (a, b, c)]
    else:
        with engine(False) as llm:
            want = [llm.generate([p], params)[0].token_ids for p in (a, b, c)]
    assert [out_a] + outs == want
    assert stats.prefix_cache_hits == 1024 + 1040
