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
def test_a_q8_0_file_keeps_its_blocks_and_decodes_as_dequantized(q8_file, chunk):
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
    np.testing.assert_allclose(lps[0], lps[1], atol=1e-3)
