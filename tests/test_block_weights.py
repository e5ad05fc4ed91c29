"""GGUF weights kept in their block types (the torch-free worker, ``workers/lite``, the one
CPU worker for them) against the same weights dequantized to float32 (the torch worker):
quality on the real embedded file, dummy block weights, and where the torch worker
serves a GGUF instead (tensor parallelism, no kernel library)."""

from __future__ import annotations

import os
import subprocess
import sys
from typing import Optional

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from pocketllm import LLM, EngineArgs, SamplingParams  # noqa: E402
from pocketllm.errors import UnsupportedFeatureError  # noqa: E402
from pocketllm.model_info import load_model_info  # noqa: E402
from pocketllm.workers.kernels import cpu_lib  # noqa: E402
from pocketllm.workers.layers.attention import ScheduledSeq  # noqa: E402
from pocketllm.workers.lite.model import LiteModel, step_view  # noqa: E402
from pocketllm.workers.runner import ModelRunner  # noqa: E402
import cpu_lib_calls as cl  # noqa: E402

needs_kernels = pytest.mark.skipif(not cpu_lib.available(),
                                   reason=f"CPU kernels: {cpu_lib.unavailable_reason()}")
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


def _log_softmax(logits: np.ndarray) -> np.ndarray:
    top = logits.max(-1, keepdims=True)
    return logits - top - np.log(np.exp(logits - top).sum(-1, keepdims=True))


def prose_ids() -> list[int]:
    """The README as the embedded model's tokens, repeated to ``TEXT_TOKENS``."""
    from pocketllm.tokenizer.tokenizer import load_tokenizer

    tok = load_tokenizer(load_model_info(EngineArgs())).tokenizer
    with open(README, encoding="utf-8") as f:
        ids = tok.encode(f.read()).ids
    while len(ids) < TEXT_TOKENS:
        ids += ids[1:]
    return ids[:TEXT_TOKENS]


def _torch_teacher_forced(runner: ModelRunner, ids: list[int], chunk: Optional[int] = None
                          ) -> tuple[np.ndarray, np.ndarray]:
    """(argmax, log-probability of the next text token) at each position: one prefill, or
    prefill chunks of ``chunk`` rows (each attending to the cache the earlier ones wrote;
    on a GPU, chunks of up to ``linear_method.GEMV_ROWS`` rows take the block gemvs)."""
    chunk = chunk or len(ids)
    blocks = list(range(len(ids) // 16 + 1))
    top, logprob = [], []
    with torch.inference_mode():
        for start in range(0, len(ids) - 1, chunk):
            n = min(chunk, len(ids) - 1 - start)
            seq = ScheduledSeq(block_ids=blocks, start=start, num_tokens=n, row=0)
            meta = runner.metadata([[seq] for _ in runner.kv.num_blocks])  # same ids per pool
            hidden = runner.model(torch.tensor(ids[start:start + n], device=runner.device),
                                  torch.arange(start, start + n, device=runner.device),
                                  start + n - 1, meta, runner.kv_caches)
            for at in range(0, n, 128):  # the 262k-entry logits, a slice at a time
                logits = runner.model.compute_logits(hidden[at:at + 128]).double().cpu().numpy()
                top.append(logits.argmax(-1))
                nxt = np.array(ids[start + at + 1:start + at + 1 + logits.shape[0]])
                logprob.append(_log_softmax(logits)[np.arange(len(nxt)), nxt])
    return np.concatenate(top), np.concatenate(logprob)


def _lite_teacher_forced(model: LiteModel, ids: list[int], chunk: int
                         ) -> tuple[np.ndarray, np.ndarray]:
    """The same through the torch-free forward, the text in prefill chunks of ``chunk``
    rows (each attending to the cache the earlier ones wrote)."""
    cfg, bs = model.cfg, 16
    table = list(range(-(-len(ids) // bs)))
    pad = len(table) * bs
    caches = [tuple(np.zeros((pad + bs, cfg.num_kv_heads, cfg.head_dim), np.float32)
                    for _ in range(2)) for _ in range(cfg.num_layers)]
    model.bind(caches, [(0, w) for w in cfg.layer_windows])
    top, logprob = [], []
    for start in range(0, len(ids) - 1, chunk):
        n = min(chunk, len(ids) - start)
        seq = ScheduledSeq(table, start, n, 0)
        views = {(0, w): step_view([seq], w, bs, pad, n) for w in set(cfg.layer_windows)}
        rows = [r for r in range(n) if start + r + 1 < len(ids)]
        logits = model.forward(np.array(ids[start:start + n]), np.arange(start, start + n),
                               views, rows).astype(np.float64)
        top.append(logits.argmax(-1))
        nxt = np.array(ids[start + 1:start + 1 + len(rows)])
        logprob.append(_log_softmax(logits)[np.arange(len(rows)), nxt])
    return np.concatenate(top), np.concatenate(logprob)


@pytest.mark.slow
@needs_kernels
def test_embedded_blocks_agree_with_float32_over_a_long_text(default_model_path):
    """Teacher-forced over 1,100 tokens of prose, the prompt in chunks through the
    torch-free worker's float path with the many-row product and with the row dots at
    every row count, and through its decode stack: each path's top-1 token agrees with
    the dequantized float32 model at >= 99% of positions, and its perplexity is within 1%."""
    ids = prose_ids()
    dense = _runner(dequantize_weights=True)
    top_f, lp_f = _torch_teacher_forced(dense, ids)
    del dense
    model = LiteModel(load_model_info(EngineArgs(model=default_model_path, device="cpu")))
    chunk = 275  # past the model's stack_rows: the float path
    assert model.stack_rows <= chunk and cl.gemm_rows() < chunk
    paths = {"many-row product": _lite_teacher_forced(model, ids, chunk)}
    with cl.forcing_gemm_rows(len(ids) + 1):  # the row dots at every row count
        paths["row dots"] = _lite_teacher_forced(model, ids, chunk)
    paths["decode stack"] = _lite_teacher_forced(model, ids, model.stack_rows - 1)
    for name, (top_b, lp_b) in paths.items():
        agree = (top_b == top_f).mean()
        ppl_b, ppl_f = np.exp(-lp_b.mean()), np.exp(-lp_f.mean())
        print(f"{name}: top-1 agreement {agree:.4f}, perplexity {ppl_b:.4f} float32 {ppl_f:.4f}")
        assert agree >= 0.99, name
        assert abs(ppl_b / ppl_f - 1) <= 0.01, name


@needs_kernels
def test_dummy_block_weights_serve(tiny_llama, monkeypatch):
    """Random q8_0 blocks on a tiny checkpoint's shapes: the torch-free worker binds every
    matrix as Q8_0 blocks and the engine generates with them; the torch worker, where it
    serves, draws float weights of the same shapes."""
    model = LiteModel(load_model_info(EngineArgs(model=tiny_llama, load_format="dummy",
                                                 quantization="q8_0")), "q8_0")
    types = {p.type for bound in model.bound for b in bound for p in b.parts}
    assert types == {8} and model.embed.ggml_type == 8 and model.head.parts[0].type == 8
    sp = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    for torch_worker in ("0", "1"):
        monkeypatch.setenv("POCKETLLM_TORCH_WORKER", torch_worker)  # the worker inherits it
        with LLM(EngineArgs(model=tiny_llama, device="cpu", load_format="dummy",
                            quantization="q8_0")) as llm:
            out = llm.generate([[5, 6, 7, 8]], sp)[0]
        assert len(out.token_ids) == 6


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
def test_tensor_parallel_gguf_equals_one_rank(tiny_block_gguf):
    """Two CPU ranks (the torch worker: tensor parallelism) slice every block weight at
    block boundaries (the down projection's 128 columns into 64 + 64), dequantize their
    parts, and generate what one rank does with the whole file dequantized."""
    path = tiny_block_gguf(128)
    sp = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    prompts = [[5, 6, 7, 8, 9], [40, 41, 3]]
    outs = {}
    for tp in (1, 2):
        with LLM(EngineArgs(model=path, device="cpu", tensor_parallel_size=tp,
                            dequantize_weights=tp == 1)) as llm:
            outs[tp] = [o.token_ids for o in llm.generate(prompts, sp)]
    assert outs[1] == outs[2]
    assert len(set(outs[1][0] + outs[1][1])) > 2, "a degenerate model would prove little"


@pytest.mark.slow
def test_tensor_parallel_split_inside_a_block_is_refused(tiny_block_gguf):
    """96 columns over two ranks is 48 each: not a whole number of 32-element blocks. The
    engine refuses to start, naming the tensor, rather than dequantize silently."""
    path = tiny_block_gguf(96)
    with pytest.raises(UnsupportedFeatureError) as e:
        LLM(EngineArgs(model=path, device="cpu", tensor_parallel_size=2, startup_timeout=120))
    assert "blk.0.ffn_down.weight" in str(e.value) and "blocks of 32" in str(e.value)


@pytest.mark.slow
def test_engine_without_the_kernel_library_runs_dequantized(tiny_block_gguf, monkeypatch):
    """A build whose kernels cannot run here (an ISA forced that the CPU lacks stands in for
    a failed compile) still serves a GGUF: the torch-free worker refuses, naming why, and
    the torch worker gives the same tokens as --dequantize-weights."""
    path = tiny_block_gguf(128)
    code = ("from pocketllm import EngineArgs; from pocketllm.model_info import load_model_info; "
            "from pocketllm.workers.lite.model import worker_refusal; "
            f"args = EngineArgs(model={path!r}, device='cpu'); "
            "print(worker_refusal(load_model_info(args), args, 1))")
    env = {**os.environ, "POCKETLLM_CPU_ISA": "bogus"}
    why = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         check=True).stdout
    assert "POCKETLLM_CPU_ISA='bogus'" in why
    sp = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    with LLM(EngineArgs(model=path, device="cpu", dequantize_weights=True)) as llm:
        ref = llm.generate([[5, 6, 7, 8, 9]], sp)[0].token_ids
    monkeypatch.setenv("POCKETLLM_CPU_ISA", "bogus")  # the worker process inherits it
    with LLM(EngineArgs(model=path, device="cpu")) as llm:
        got = llm.generate([[5, 6, 7, 8, 9]], sp)[0].token_ids
    assert got == ref
