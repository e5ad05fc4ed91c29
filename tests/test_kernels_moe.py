"""The Triton MoE grouped GEMM (``kernels/fused_moe.py``) and the few-token gemvs
(``kernels/moe_gemv.py``) against the torch reference (``layers.moe.torch_experts``): the
grouped GEMM's block-aligned layout, the products on random weights, and whole tiny MoE
models on the GPU path (interpreted on CPU, compiled on CUDA)."""

from __future__ import annotations

import pytest

from kernel_modules import load_kernels

K, DEVICE = load_kernels()
import torch  # noqa: E402

from pocketllm.workers.layers.activation import ClampedSwiGLU  # noqa: E402
from pocketllm.workers.layers.moe import softmax_topk, topk_softmax, torch_experts  # noqa: E402

CUDA = DEVICE.type == "cuda"
# both GPU computations of the experts (the kernel policy picks by token count)
EXPERTS = {"grouped": K.fused_moe.fused_experts, "gemv": K.moe_gemv.gemv_experts}


def moe_case(tokens, experts=8, top_k=2, hidden=64, inter=32, dtype=torch.float32, seed=0,
             skew=False):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=gen)
    w13 = torch.randn(experts, 2 * inter, hidden, generator=gen) * hidden ** -0.5
    w2 = torch.randn(experts, hidden, inter, generator=gen) * inter ** -0.5
    logits = torch.randn(tokens, experts, generator=gen)
    if skew:  # most tokens pick experts 0 and 1; the others get few or none
        logits[:, :2] += 4.0
    weights, ids = softmax_topk(True)(logits, top_k)
    return [t.to(DEVICE) for t in (x.to(dtype), w13.to(dtype), w2.to(dtype), weights, ids)]


@pytest.mark.parametrize("tokens, block_m", [(1, 16), (7, 16), (40, 32), (300, 64), (600, 16)])
@pytest.mark.parametrize("experts", [8, 6])
def test_align_groups_every_pair_once_in_expert_tiles(tokens, block_m, experts):
    top_k = 2
    *_, ids = moe_case(tokens, experts, top_k, skew=True)
    sorted_pairs, tile_expert, num_rows = K.fused_moe.align(ids, experts, block_m)
    # the one-launch kernel (up to ONE_PROGRAM_PAIRS) and the torch ops agree exactly
    for got, want in zip((sorted_pairs, tile_expert, num_rows),
                         K.fused_moe.align_torch(ids, experts, block_m)):
        assert torch.equal(got, want)
    pairs = tokens * top_k
    assert sorted_pairs.numel() == K.fused_moe.capacity(pairs, experts, block_m)
    assert tile_expert.numel() * block_m == sorted_pairs.numel()
    used = int(num_rows.item())
    assert used % block_m == 0 and used <= sorted_pairs.numel()
    real = sorted_pairs[sorted_pairs < pairs].tolist()
    assert sorted(real) == list(range(pairs))  # each pair exactly once
    assert (sorted_pairs[used:] == pairs).all()  # spare rows hold the sentinel only
    flat = ids.reshape(-1)
    for tile in range(used // block_m):
        rows = sorted_pairs[tile * block_m:(tile + 1) * block_m]
        rows = rows[rows < pairs].long()
        assert (flat[rows] == tile_expert[tile]).all()  # one expert per tile


@pytest.mark.parametrize("kind", EXPERTS)
@pytest.mark.parametrize("tokens", [1, 3, 17, 70])
@pytest.mark.parametrize("skew", [False, True])
def test_fused_experts_match_torch_reference_float32(kind, tokens, skew):
    x, w13, w2, weights, ids = moe_case(tokens, skew=skew, seed=tokens)
    want = torch_experts(x, w13, w2, weights, ids, "silu")
    got = EXPERTS[kind](x, w13, w2, weights, ids, "silu")
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_expert_gemvs_at_ragged_widths():
    # widths that are not multiples of the tiles (masks), top-4 of 6 experts, gelu
    x, w13, w2, weights, ids = moe_case(3, experts=6, top_k=4, hidden=72, inter=40, seed=5)
    want = torch_experts(x, w13, w2, weights, ids, "gelu_pytorch_tanh")
    got = K.moe_gemv.gemv_experts(x, w13, w2, weights, ids, "gelu_pytorch_tanh")
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("block", [(16, 16, 16), (32, 32, 32), (64, 64, 64)])
def test_fused_experts_any_tile_and_ragged_widths(block):
    # widths that are not multiples of the tiles (masks), top-4 of 6 experts, gelu
    x, w13, w2, weights, ids = moe_case(21, experts=6, top_k=4, hidden=72, inter=40, seed=5)
    want = torch_experts(x, w13, w2, weights, ids, "gelu_pytorch_tanh")
    got = K.fused_moe.fused_experts(x, w13, w2, weights, ids, "gelu_pytorch_tanh", block=block)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("experts, top_k", [(8, 2), (6, 4), (128, 8), (60, 1)])
@pytest.mark.parametrize("renormalize", [True, False])
def test_softmax_topk_kernel_matches_torch_routing(experts, top_k, renormalize):
    gen = torch.Generator().manual_seed(experts + top_k)
    logits = (torch.randn(13, experts, generator=gen) * 3).to(DEVICE)
    want_w, want_ids = softmax_topk(renormalize)(logits, top_k)
    got_w, got_ids = K.fused_moe.softmax_topk(logits, top_k, renormalize)
    assert torch.equal(got_ids.long(), want_ids)
    torch.testing.assert_close(got_w, want_w, atol=1e-6, rtol=1e-5)
    empty = K.fused_moe.softmax_topk(logits[:0], top_k, renormalize)
    assert empty[0].shape == empty[1].shape == (0, top_k)


@pytest.mark.parametrize("kind", EXPERTS)
@pytest.mark.parametrize("tokens", [1, 17])
@pytest.mark.parametrize("down_bias", [True, False])  # False: a tensor-parallel rank past 0
def test_fused_experts_with_biases_and_clamped_swiglu_match_torch(kind, tokens, down_bias):
    """gpt-oss's experts: biases on both products and the clamped SwiGLU (a limit low
    enough that both clamps cut), in the kernel's epilogues."""
    x, w13, w2, _, _ = moe_case(tokens, experts=6, hidden=40, inter=24, seed=tokens)
    gen = torch.Generator().manual_seed(tokens)
    b13 = (torch.randn(6, 48, generator=gen) * 0.5).to(DEVICE)
    b2 = (torch.randn(6, 40, generator=gen) * 0.5).to(DEVICE) if down_bias else None
    weights, ids = topk_softmax(torch.randn(tokens, 6, generator=gen).to(DEVICE), 3)
    act = ClampedSwiGLU(1.702, 0.5)
    want = torch_experts(x, w13, w2, weights, ids, act, b13, b2)
    got = EXPERTS[kind](x, w13, w2, weights, ids, act, b13, b2)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    plain = torch_experts(x, w13, w2, weights, ids, "silu")
    assert (got - plain).abs().max() > 0.1  # the biases and the clamp changed something


@pytest.mark.parametrize("experts, top_k", [(8, 2), (32, 4)])
def test_renormalised_softmax_topk_kernel_is_gpt_oss_routing(experts, top_k):
    """gpt-oss's softmax over the k largest logits equals the softmax over all of them, the
    k largest, renormalised: the one-launch kernel serves both families."""
    gen = torch.Generator().manual_seed(experts)
    logits = (torch.randn(11, experts, generator=gen) * 3).to(DEVICE)
    want_w, want_ids = topk_softmax(logits, top_k)
    got_w, got_ids = K.fused_moe.softmax_topk(logits, top_k, True)
    assert torch.equal(got_ids.long(), want_ids)
    torch.testing.assert_close(got_w, want_w, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("kind", EXPERTS)
def test_fused_experts_no_tokens(kind):
    x, w13, w2, weights, ids = moe_case(0)
    assert EXPERTS[kind](x, w13, w2, weights, ids, "silu").shape == (0, 64)


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="Triton's interpreter gets tl.dot on bfloat16 wrong "
                    "(numpy has no bfloat16); checked compiled on CUDA")
@pytest.mark.parametrize("kind, tokens", [("grouped", 1), ("grouped", 8), ("grouped", 64),
                                          ("grouped", 512), ("gemv", 1), ("gemv", 4)])
def test_fused_experts_match_torch_reference_bfloat16(kind, tokens):
    # Qwen3-30B-A3B's expert shapes (128 experts, top-8, 2048 -> 768), fewer rows
    x, w13, w2, weights, ids = moe_case(tokens, experts=128, top_k=8, hidden=2048, inter=768,
                                        dtype=torch.bfloat16, seed=tokens)
    want = torch_experts(x.float(), w13.float(), w2.float(), weights, ids, "silu")
    got = EXPERTS[kind](x, w13, w2, weights, ids, "silu")
    torch.testing.assert_close(got.float(), want, atol=3e-2, rtol=3e-2)


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="Triton's interpreter gets tl.dot on bfloat16 wrong "
                    "(numpy has no bfloat16); checked compiled on CUDA")
@pytest.mark.parametrize("kind, tokens", [("grouped", 1), ("grouped", 64), ("gemv", 2)])
def test_gpt_oss_experts_bfloat16_at_20b_shapes(kind, tokens):
    # gpt-oss-20b's experts (32, top-4, 2880 -> 2880) with biases and the clamp at 7
    x, w13, w2, _, _ = moe_case(tokens, experts=32, hidden=2880, inter=2880,
                                dtype=torch.bfloat16, seed=tokens)
    gen = torch.Generator().manual_seed(tokens)
    b13 = torch.randn(32, 5760, generator=gen).to(DEVICE, torch.bfloat16)
    b2 = torch.randn(32, 2880, generator=gen).to(DEVICE, torch.bfloat16)
    weights, ids = topk_softmax(torch.randn(tokens, 32, generator=gen).to(DEVICE), 4)
    act = ClampedSwiGLU(1.702, 7.0)
    want = torch_experts(x.float(), w13.float(), w2.float(), weights, ids, act, b13.float(),
                         b2.float())
    got = EXPERTS[kind](x, w13, w2, weights, ids, act, b13, b2)
    torch.testing.assert_close(got.float(), want, atol=5e-2, rtol=3e-2)


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="CUDA graphs need a GPU")
@pytest.mark.parametrize("kind, tokens", [("grouped", 24), ("gemv", 3)])
def test_fused_experts_replay_under_a_cuda_graph(kind, tokens):
    """No host read-back: captured once, replayed on new routing, equal to eager."""
    x, w13, w2, weights, ids = moe_case(tokens, seed=1)
    static = [t.clone() for t in (x, weights, ids)]
    experts = EXPERTS[kind]
    experts(*static[:1], w13, w2, *static[1:], "silu")  # compile first
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = experts(static[0], w13, w2, static[1], static[2], "silu")
    x2, _, _, weights2, ids2 = moe_case(tokens, seed=2)
    for buf, new in zip(static, (x2, weights2, ids2)):
        buf.copy_(new)
    graph.replay()
    torch.testing.assert_close(out, torch_experts(x2, w13, w2, weights2, ids2, "silu"),
                               atol=1e-5, rtol=1e-5)


def test_gpu_path_of_a_whole_moe_model_matches_torch():
    """The tiny Qwen3-MoE (experts in layers 0 and 2, a dense MLP in layer 1) through every
    Triton kernel of the GPU path, MoE included: the torch path's tokens and logprobs."""
    from unittest import mock

    import pocketllm.workers.kernels as kernels
    from test_worker_parity import GREEDY_LP, PROMPT, make_runner
    from tiny_checkpoints import PlanDriver, make_tiny_checkpoint

    def greedy(runner):
        driver = PlanDriver(runner)
        driver.add("r", PROMPT, GREEDY_LP, 8)
        tokens = driver.run()["r"]
        return tokens, [lp.logprob for lp in driver.reqs["r"].logprobs]

    path = make_tiny_checkpoint("qwen3_moe")
    with mock.patch.object(kernels, "kernels_usable", lambda device: False):
        torch_tokens, torch_logprobs = greedy(make_runner(path, DEVICE.type))
    with mock.patch.object(kernels, "kernels_usable", lambda device: True):
        runner = make_runner(path, DEVICE.type)
    moe = runner.model.layers[0].mlp
    assert moe.compute.grouped is K.fused_moe.fused_experts
    assert moe.compute.gemv is K.moe_gemv.gemv_experts
    assert moe.routing.args[0] is K.fused_moe.softmax_topk  # routing in one launch too
    tokens, logprobs = greedy(runner)
    assert tokens == torch_tokens
    assert logprobs == pytest.approx(torch_logprobs, abs=1e-5 if DEVICE.type == "cpu" else 1e-4)


def test_gpu_path_of_a_whole_gpt_oss_model_matches_torch():
    """The tiny gpt-oss (sinks on sliding and full layers, biased clamped experts) through
    the GPU path's Triton kernels, attention sinks and MoE epilogues included."""
    from unittest import mock

    import pocketllm.workers.kernels as kernels
    from test_worker_parity import GREEDY_LP, PROMPT, make_runner
    from tiny_checkpoints import PlanDriver, make_tiny_checkpoint

    def greedy(runner):
        driver = PlanDriver(runner, chunk=7)  # chunks over a cached prefix, then decodes
        driver.add("r", PROMPT, GREEDY_LP, 8)
        tokens = driver.run()["r"]
        return tokens, [lp.logprob for lp in driver.reqs["r"].logprobs]

    path = make_tiny_checkpoint("gpt_oss")
    with mock.patch.object(kernels, "kernels_usable", lambda device: False):
        torch_tokens, torch_logprobs = greedy(make_runner(path, DEVICE.type))
    with mock.patch.object(kernels, "kernels_usable", lambda device: True):
        runner = make_runner(path, DEVICE.type)
    moe = runner.model.layers[0].mlp
    assert moe.compute.grouped is K.fused_moe.fused_experts
    assert moe.compute.gemv is K.moe_gemv.gemv_experts
    assert moe.routing.args == (K.fused_moe.softmax_topk, True)
    assert type(runner.backend).__name__ == "TritonAttention"
    tokens, logprobs = greedy(runner)
    assert tokens == torch_tokens
    assert logprobs == pytest.approx(torch_logprobs, abs=1e-5 if DEVICE.type == "cpu" else 1e-4)


@pytest.mark.parametrize("family", ["deepseek_v3", "deepseek_v2"])
def test_gpu_path_of_a_deepseek_model_matches_torch(family):
    """DeepSeek (MLA + grouped routing + shared experts) on the GPU path: the Triton
    projections, norms and grouped GEMM around the MLA layer, whose decode is the Triton
    kernel where the widths fit its tiles, else the torch reference (``KernelPolicy.mla_decode``); the torch path's tokens and logprobs."""
    import importlib
    from unittest import mock

    import pocketllm.workers.kernels as kernels
    from pocketllm.workers.layers.mla import mla_decode_attention
    from test_worker_parity import GREEDY_LP, PROMPT, make_runner
    from tiny_checkpoints import PlanDriver, make_tiny_checkpoint

    def greedy(runner):
        driver = PlanDriver(runner, chunk=7)  # prefill chunks beside decodes
        driver.add("r", PROMPT, GREEDY_LP, 6)
        driver.add("s", PROMPT[:9], GREEDY_LP, 6)
        out = driver.run()
        return out, [lp.logprob for r in ("r", "s") for lp in driver.reqs[r].logprobs]

    path = make_tiny_checkpoint(family)
    with mock.patch.object(kernels, "kernels_usable", lambda device: False):
        torch_tokens, torch_logprobs = greedy(make_runner(path, DEVICE.type))
    with mock.patch.object(kernels, "kernels_usable", lambda device: True):
        runner = make_runner(path, DEVICE.type)
    experts = runner.model.layers[1].mlp.experts
    assert experts.compute.grouped is K.fused_moe.fused_experts
    if family == "deepseek_v2":  # greedy softmax routing in one launch, then its scaling
        assert experts.routing.args == (K.fused_moe.softmax_topk, False)
        assert experts.routing.keywords == {"scaling": 1.5}
    # V3's latent widths (32 + 16) fit the Triton kernel's tiles, V2's (24 + 8) do not
    if family == "deepseek_v3":
        assert runner.backend.decode.args[1] is importlib.import_module(
            "pocketllm.workers.kernels.mla_decode")
    else:
        assert runner.backend.decode is mla_decode_attention
    tokens, logprobs = greedy(runner)
    assert tokens == torch_tokens
    assert logprobs == pytest.approx(torch_logprobs, abs=1e-5 if DEVICE.type == "cpu" else 1e-4)
