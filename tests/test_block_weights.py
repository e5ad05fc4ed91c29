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
    """Teacher-forced over 1,100 tokens of prose: the block path's top-1 token agrees with
    the float32 reference at >= 99% of positions, and its perplexity is within 1%."""
    from pocketllm.tokenizer.tokenizer import load_tokenizer

    tok = load_tokenizer(load_model_info(EngineArgs())).tokenizer
    with open(README, encoding="utf-8") as f:
        ids = tok.encode(f.read()).ids
    while len(ids) < TEXT_TOKENS:
        ids += ids[1:]
    ids = ids[:TEXT_TOKENS]
    blocks = _runner()
    assert _block_layers(blocks) > 0
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
