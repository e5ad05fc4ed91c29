"""A GGUF file on the GPU keeps its blocks (``layers/linear_method.GGUF_BLOCKS``, the
kernels of ``kernels/gguf_gemv.py``) and computes what its dequantized weights do: a
Q8_0 file that llama.cpp's converter wrote from the tiny Llama checkpoint, greedy tokens
and log probabilities against ``dequantize_weights`` (the same file expanded to float at
load), whole and in chunks (the products of many rows dequantize per step). Skips without
CUDA; the kernels themselves: test_kernels_gguf.py, the seam: test_linear_method.py."""

from __future__ import annotations

import random

import numpy as np
import pytest

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip("the GGUF block kernels run on a GPU", allow_module_level=True)

from pocketllm.workers.layers import linear_method  # noqa: E402
from family_parity import run  # noqa: E402
from llama_cpp_convert import convert  # noqa: E402
from test_worker_parity import make_runner  # noqa: E402
from tiny_checkpoints import make_tiny_checkpoint  # noqa: E402

PROMPT = [random.Random(7).randrange(12, 512) for _ in range(40)]


@pytest.fixture(scope="module")
def q8_file(tmp_path_factory):
    hf = make_tiny_checkpoint("llama")
    return convert(hf, str(tmp_path_factory.mktemp("gguf_gpu") / "q8_0.gguf"), "q8_0")


@pytest.mark.parametrize("chunk", [None, 16])
@pytest.mark.parametrize("dots", [False, True], ids=["block_gemv", "dots"])
def test_a_q8_0_file_keeps_its_blocks_and_decodes_as_dequantized(q8_file, chunk, dots,
                                                                 monkeypatch):
    """The block gemv (float x) gives the dequantized file's log probabilities to 1e-3;
    the integer dots round x to int8 blocks first (as llama.cpp's MMVQ rounds it to
    q8_1), which moves this random model's log probabilities by a few hundredths (0.03
    on an H100): the same greedy tokens, within 0.05. The dots' own bits: test_kernels_gguf.py."""
    if dots:  # float32 rows take the dots only where told (16-bit ones always do)
        monkeypatch.setattr(linear_method.GGUF_BLOCKS, "dot_dtypes",
                            linear_method.GGUFBlockMethod.dot_dtypes + (torch.float32,))
    else:
        monkeypatch.setattr(linear_method.GGUF_BLOCKS, "dot_devices", ())
    blocks = make_runner(q8_file, device="cuda")
    dense = make_runner(q8_file, device="cuda", dequantize_weights=True)
    layer = blocks.model.layers[0]
    assert layer.self_attn.qkv_proj.method is linear_method.GGUF_BLOCKS
    assert layer.mlp.down_proj.method is linear_method.GGUF_BLOCKS
    assert dense.model.layers[0].self_attn.qkv_proj.method is linear_method.DENSE
    got, got_driver = run(blocks, {"r": PROMPT}, new_tokens=16, chunk=chunk)
    want, want_driver = run(dense, {"r": PROMPT}, new_tokens=16, chunk=chunk)
    assert got["r"] == want["r"]
    lps = [np.array([lp.logprob for lp in d.reqs["r"].logprobs]) for d in (got_driver, want_driver)]
    np.testing.assert_allclose(lps[0], lps[1], atol=0.05 if dots else 1e-3)


def test_the_embedded_gguf_on_its_blocks_agrees_with_float32_over_a_long_text(default_model_path):
    """Teacher-forced over 1,100 tokens of prose in chunks of up to ``GEMV_ROWS`` rows (so
    every product of a block layer is a block gemv), float32 activations (so the float
    block gemv, not the int8 dots: ``GGUFBlockMethod.dot_dtypes``): the top-1 token
    agrees with the file dequantized to float32 at >= 99% of positions, and the perplexity
    is within 1%, the CPU block path's bar (test_block_weights.py)."""
    from test_block_weights import TEXT_TOKENS, _torch_teacher_forced, prose_ids

    from pocketllm.config import EngineArgs
    from pocketllm.model_info import load_model_info
    from pocketllm.workers.runner import ModelRunner

    ids = prose_ids()

    def runner(**kw):
        args = EngineArgs(device="cuda", dtype="float32", block_size=16, max_num_seqs=1,
                          num_kv_blocks=TEXT_TOKENS // 16 + 2, cuda_graphs=False, **kw)
        return ModelRunner(load_model_info(args), args)

    blocks = runner()
    kinds = {type(m.method).__name__ for m in blocks.model.modules() if hasattr(m, "method")}
    assert "GGUFBlockMethod" in kinds, kinds
    top_b, lp_b = _torch_teacher_forced(blocks, ids, chunk=linear_method.GEMV_ROWS)
    del blocks
    top_f, lp_f = _torch_teacher_forced(runner(dequantize_weights=True), ids)
    agree = (top_b == top_f).mean()
    ppl_b, ppl_f = np.exp(-lp_b.mean()), np.exp(-lp_f.mean())
    print(f"GPU blocks: top-1 agreement {agree:.4f}, perplexity {ppl_b:.4f} float32 {ppl_f:.4f}")
    assert agree >= 0.99
    assert abs(ppl_b / ppl_f - 1) <= 0.01
