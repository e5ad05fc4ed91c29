"""GGUF weights kept in their block types (the CPU block kernels' path) against the same
weights expanded to float32: quality on the real embedded file, dummy block weights,
and the engine arguments that choose between them."""

from __future__ import annotations

import os

import pytest

torch = pytest.importorskip("torch")

from pocketllm import LLM, EngineArgs, SamplingParams  # noqa: E402
from pocketllm.errors import UnsupportedFeatureError  # noqa: E402
from pocketllm.model_info import load_model_info  # noqa: E402
from pocketllm.workers.kernels import cpu_quant  # noqa: E402
from pocketllm.workers.layers.attention import ScheduledSeq, build_metadata  # noqa: E402
from pocketllm.workers.layers.block_weight import BlockWeight  # noqa: E402
from pocketllm.workers.runner import ModelRunner  # noqa: E402

needs_kernels = pytest.mark.skipif(not cpu_quant.available(),
                                   reason=f"CPU kernels: {cpu_quant.unavailable_reason()}")
TEXT_TOKENS = 1100
README = os.path.join(os.path.dirname(__file__), os.pardir, "README.md")


def test_quantization_needs_dummy_weights():
    with pytest.raises(UnsupportedFeatureError) as e:
        EngineArgs(quantization="q4_k_m")
    assert e.value.param == "quantization"
    with pytest.raises(UnsupportedFeatureError):
        EngineArgs(load_format="dummy", quantization="q8_0", dequantize_weights=True)


def _runner(**kw) -> ModelRunner:
    args = EngineArgs(device="cpu", block_size=16, num_kv_blocks=TEXT_TOKENS // 16 + 2,
                      max_num_seqs=1, **kw)
    return ModelRunner(load_model_info(args), args)


def _block_layers(runner: ModelRunner) -> int:
    return sum(isinstance(m, BlockWeight) for m in runner.model.modules())


def _teacher_forced(runner: ModelRunner, ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """(argmax, log-probability of the next text token) at each position of one prefill."""
    seq = ScheduledSeq(block_ids=list(range(len(ids) // 16 + 1)), start=0, num_tokens=len(ids), row=0)
    meta = build_metadata([seq], runner.block_size, runner.windows, runner.device, runner.pad_slot)
    with torch.inference_mode():
        hidden = runner.model(torch.tensor(ids), torch.arange(len(ids)), len(ids) - 1, meta,
                              runner.kv_caches)[:-1]
        top, logprob = [], []
        for at in range(0, hidden.shape[0], 128):  # the 262k-entry logits, a slice at a time
            logits = runner.model.compute_logits(hidden[at:at + 128]).float()
            top.append(logits.argmax(-1))
            nxt = torch.tensor(ids[at + 1:at + 1 + logits.shape[0]])
            logprob.append(logits.log_softmax(-1).gather(1, nxt[:, None])[:, 0])
    return torch.cat(top), torch.cat(logprob)


@pytest.mark.slow
@needs_kernels
def test_embedded_blocks_agree_with_float32_over_a_long_text(default_model_path):
    """Teacher-forced over 1,100 tokens of prose: the integer kernels' top-1 token agrees
    with the float32 reference at >= 99% of positions, and their perplexity is within 1%."""
    from pocketllm.tokenizer.tokenizer import load_tokenizer

    tok = load_tokenizer(load_model_info(EngineArgs())).tokenizer
    with open(README, encoding="utf-8") as f:
        ids = tok.encode(f.read()).ids
    while len(ids) < TEXT_TOKENS:
        ids += ids[1:]
    ids = ids[:TEXT_TOKENS]
    blocks = _runner()
    assert _block_layers(blocks) > 0
    for m in blocks.model.modules():  # the integer kernels at every row count, not only decode's
        if isinstance(m, BlockWeight):
            m.float_rows = len(ids) + 1
    top_b, lp_b = _teacher_forced(blocks, ids)
    del blocks
    dense = _runner(dequantize_weights=True)
    assert _block_layers(dense) == 0
    top_f, lp_f = _teacher_forced(dense, ids)
    agree = (top_b == top_f).float().mean().item()
    ppl_b, ppl_f = torch.exp(-lp_b.mean()).item(), torch.exp(-lp_f.mean()).item()
    print(f"top-1 agreement {agree:.4f}, perplexity blocks {ppl_b:.4f} float32 {ppl_f:.4f}")
    assert agree >= 0.99
    assert abs(ppl_b / ppl_f - 1) <= 0.01


@needs_kernels
def test_dummy_block_weights_serve(tiny_llama):
    """Random q8_0 blocks on a tiny checkpoint's shapes: every matrix is a BlockWeight and
    the engine generates with them."""
    runner = _runner(model=tiny_llama, load_format="dummy", quantization="q8_0")
    assert _block_layers(runner) >= 4  # qkv, o, gate_up, down of each layer (and the head)
    weights = [m for m in runner.model.modules() if isinstance(m, BlockWeight)]
    assert all(t == 8 for w in weights for t in w.part_types if t is not None)
    with LLM(EngineArgs(model=tiny_llama, load_format="dummy", quantization="q8_0")) as llm:
        out = llm.generate([[5, 6, 7, 8]], SamplingParams(max_tokens=6, temperature=0.0,
                                                          ignore_eos=True))[0]
    assert len(out.token_ids) == 6


@needs_kernels
def test_block_weight_products_of_few_and_many_rows():
    """Mixed part types (one float): a product below ``float_rows`` rows runs the integer
    kernels, at or above it the dequantize-then-sgemm path; both match the float product
    (the integer one within the 16-bit activation rounding)."""
    from test_cpu_quant_kernels import random_blocks

    from pocketllm.workers.loader.gguf_quants import dequantize

    k, rows = 512, [48, 32, 24]
    blocks = {0: random_blocks(6, rows[0], k, seed=1), 1: random_blocks(12, rows[1], k, seed=2)}
    w = BlockWeight(k, rows, [6, 12, None], float_rows=5)
    dense = []
    for j, t in blocks.items():
        setattr(w, f"part{j}", t)
        dense.append(torch.from_numpy(dequantize(t.numpy().reshape(-1), w.part_types[j]).reshape(-1, k)))
    w.part2 = torch.randn(rows[2], k)
    dense.append(w.part2)
    ref_w = torch.cat(dense).double()
    for m in (1, 4, 5, 9):
        x = torch.randn(m, k)
        ref = x.double() @ ref_w.T
        got = w(x).double()
        tol = 1e-4 if m >= 5 else 2e-3
        assert torch.allclose(got, ref, rtol=0, atol=tol * ref.abs().max().item()), m
