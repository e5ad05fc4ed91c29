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
from pocketllm.workers.layers.attention import ScheduledSeq  # noqa: E402
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
    meta = runner.metadata([[seq] for _ in runner.kv.num_blocks])  # the same ids in each pool
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
    """Teacher-forced over 1,100 tokens of prose, the prompt through the many-row product
    and through the row dots at every row count: each path's top-1 token agrees with the
    float32 reference at >= 99% of positions, and its perplexity is within 1%."""
    from pocketllm.tokenizer.tokenizer import load_tokenizer

    tok = load_tokenizer(load_model_info(EngineArgs())).tokenizer
    with open(README, encoding="utf-8") as f:
        ids = tok.encode(f.read()).ids
    while len(ids) < TEXT_TOKENS:
        ids += ids[1:]
    ids = ids[:TEXT_TOKENS]
    dense = _runner(dequantize_weights=True)
    assert _block_layers(dense) == 0
    top_f, lp_f = _teacher_forced(dense, ids)
    del dense
    blocks = _runner()
    assert _block_layers(blocks) > 0 and cpu_quant.gemm_rows() < len(ids)
    paths = {"many-row product": _teacher_forced(blocks, ids)}
    with cpu_quant.forcing_gemm_rows(len(ids) + 1):  # the row dots at every row count
        paths["row dots"] = _teacher_forced(blocks, ids)
    for name, (top_b, lp_b) in paths.items():
        agree = (top_b == top_f).float().mean().item()
        ppl_b, ppl_f = torch.exp(-lp_b.mean()).item(), torch.exp(-lp_f.mean()).item()
        print(f"{name}: top-1 agreement {agree:.4f}, perplexity {ppl_b:.4f} float32 {ppl_f:.4f}")
        assert agree >= 0.99, name
        assert abs(ppl_b / ppl_f - 1) <= 0.01, name


@needs_kernels
def test_dummy_block_weights_serve(tiny_llama):
    """Random q8_0 blocks on a tiny checkpoint's shapes: every matrix is a BlockWeight and
    the engine generates with them."""
    runner = _runner(model=tiny_llama, load_format="dummy", quantization="q8_0")
    assert _block_layers(runner) >= 4  # qkv, o, gate_up, down of each layer (and the head)
    weights = [m for m in runner.model.modules() if isinstance(m, BlockWeight)]
    assert all(t == 8 for w in weights for t in w.part_types if t is not None)
    with LLM(EngineArgs(model=tiny_llama, device="cpu", load_format="dummy", quantization="q8_0")) as llm:
        out = llm.generate([[5, 6, 7, 8]], SamplingParams(max_tokens=6, temperature=0.0,
                                                          ignore_eos=True))[0]
    assert len(out.token_ids) == 6


@needs_kernels
def test_block_weight_products_of_few_and_many_rows():
    """Mixed part types (one float): the block parts in one library call (the row dots
    below ``gemm_rows()`` rows, the many-row product from there), the float part in
    torch; each matches the float product within 16-bit activations' rounding."""
    from test_cpu_quant_kernels import random_blocks

    from pocketllm.workers.loader.gguf_quants import dequantize

    k, rows = 512, [48, 32, 24]
    blocks = {0: random_blocks(6, rows[0], k, seed=1), 1: random_blocks(12, rows[1], k, seed=2)}
    w = BlockWeight(k, rows, [6, 12, None])
    dense = []
    for j, t in blocks.items():
        setattr(w, f"part{j}", t)
        dense.append(torch.from_numpy(dequantize(t.numpy().reshape(-1), w.part_types[j]).reshape(-1, k)))
    w.part2 = torch.randn(rows[2], k)
    dense.append(w.part2)
    ref_w = torch.cat(dense).double()
    for m in (1, 4, cpu_quant.gemm_rows(), 40):
        x = torch.randn(m, k)
        ref = x.double() @ ref_w.T
        got = w(x).double()
        assert torch.allclose(got, ref, rtol=0, atol=2e-3 * ref.abs().max().item()), m


@pytest.fixture(scope="module")
def tiny_block_gguf(tmp_path_factory):
    """A tiny llama GGUF whose matrices cycle through block and float types (Q8_0, Q4_0,
    Q5_1, Q4_1, Q5_0, F16, BF16, F32), with the given MLP width."""
    from test_gguf_weights import _tiny_hf_model, write_tiny_gguf

    def make(intermediate_size: int) -> str:
        path = str(tmp_path_factory.mktemp("blocks") / f"tiny-{intermediate_size}.gguf")
        write_tiny_gguf(path, "llama", _tiny_hf_model("llama", intermediate_size))
        return path

    return make


@pytest.mark.slow
@needs_kernels
def test_tensor_parallel_block_weights_equal_one_rank(tiny_block_gguf):
    """Two CPU ranks slice every block weight at block boundaries (the down projection's 128
    columns into 64 + 64) and generate what one rank does."""
    path = tiny_block_gguf(128)
    assert _block_layers(_runner(model=path)) >= 4
    sp = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    prompts = [[5, 6, 7, 8, 9], [40, 41, 3]]
    outs = {}
    for tp in (1, 2):
        with LLM(EngineArgs(model=path, device="cpu", tensor_parallel_size=tp)) as llm:
            outs[tp] = [o.token_ids for o in llm.generate(prompts, sp)]
    assert outs[1] == outs[2]
    assert len(set(outs[1][0] + outs[1][1])) > 2, "a degenerate model would prove little"


@pytest.mark.slow
@needs_kernels
def test_tensor_parallel_split_inside_a_block_is_refused(tiny_block_gguf):
    """96 columns over two ranks is 48 each: not a whole number of 32-element blocks. The
    engine refuses to start, naming the tensor, rather than dequantize silently."""
    path = tiny_block_gguf(96)
    with pytest.raises(UnsupportedFeatureError) as e:
        LLM(EngineArgs(model=path, device="cpu", tensor_parallel_size=2, startup_timeout=120))
    assert "blk.0.ffn_down.weight" in str(e.value) and "blocks of 32" in str(e.value)


@pytest.mark.slow
def test_engine_without_the_kernel_library_runs_dequantized(tiny_block_gguf, monkeypatch, capfd):
    """A build whose kernels cannot run here (an ISA forced that the CPU lacks stands in for
    a failed compile) still starts: one warning, the weights dequantized, the same tokens
    as --dequantize-weights."""
    path = tiny_block_gguf(128)
    sp = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    with LLM(EngineArgs(model=path, device="cpu", dequantize_weights=True)) as llm:
        ref = llm.generate([[5, 6, 7, 8, 9]], sp)[0].token_ids
    monkeypatch.setenv("POCKETLLM_CPU_ISA", "bogus")  # the worker process inherits it
    capfd.readouterr()
    with LLM(EngineArgs(model=path, device="cpu")) as llm:
        got = llm.generate([[5, 6, 7, 8, 9]], sp)[0].token_ids
    assert got == ref
    assert "the CPU block kernels are not available" in capfd.readouterr().err
