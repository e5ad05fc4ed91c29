"""Qwen3-MoE on the torch-free worker (workers/lite/experts.py) against the torch worker on
the same GGUF files: greedy tokens equal, log probabilities within the lite tests'
tolerance, with the experts run in C inside the decode stack (a prompt's rows included)
and sorted into runs per expert on the float path; and what it leaves to the torch
worker."""

from __future__ import annotations

import dataclasses
import subprocess
import sys

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from pocketllm import EngineArgs  # noqa: E402
from pocketllm.errors import UnsupportedFeatureError  # noqa: E402
from pocketllm.model_info import load_model_info  # noqa: E402
from pocketllm.workers.kernels import cpu_lib  # noqa: E402
from pocketllm.workers.lite.experts import experts_refusal  # noqa: E402
from pocketllm.workers.lite.model import LiteModel, refusal  # noqa: E402
from pocketllm.workers.models.config import arch_config  # noqa: E402
from test_lite_model import _lite_greedy, _torch_greedy  # noqa: E402
from test_qwen3_moe_gguf import write_qwen3moe_gguf  # noqa: E402
from tiny_checkpoints import make_tiny_checkpoint  # noqa: E402

pytestmark = pytest.mark.skipif(not cpu_lib.available(),
                                reason=f"CPU kernels: {cpu_lib.unavailable_reason()}")

TOL = 2e-3  # test_lite_model's


@pytest.fixture(scope="module")
def hf_moe(tmp_path_factory):
    """The tiny Qwen3-MoE (8 experts, 2 a token, renormalised), every layer sparse as
    llama.cpp's qwen3moe files are."""
    path = make_tiny_checkpoint("qwen3_moe", str(tmp_path_factory.mktemp("moe")),
                                overrides={"mlp_only_layers": []})
    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)


def _write(hf_moe, directory, experts, dense) -> str:
    import gguf

    q = gguf.GGMLQuantizationType
    path = str(directory / "moe.gguf")
    types = ({"gate": q.Q4_0, "up": q.Q5_1, "down": q.Q8_0} if experts == "blocks"
             else q[experts])
    write_qwen3moe_gguf(path, hf_moe, types, dense_type=q[dense])
    return path


@pytest.fixture(scope="module")
def all_blocks(hf_moe, tmp_path_factory) -> str:
    """Experts as ``blocks_gguf``'s (gate Q4_0, up Q5_1, down Q8_0), every other matrix
    Q8_0: a file both workers run in the library."""
    return _write(hf_moe, tmp_path_factory.mktemp("moe-all-blocks"), "blocks", "Q8_0")


@pytest.mark.parametrize("prompt_len,stack_rows", [(12, 0), (63, 64), (24, 0), (150, 0),
                                                   (24, 1), (150, 1)])
def test_lite_moe_matches_the_torch_worker(all_blocks, prompt_len, stack_rows):
    """Prompts of 12 rows (under an MoE model's ``stack_rows``) and 63 (the stack forced
    to take them: 126 pairs, two library calls of 64) run their experts in C; 24 and 150
    rows take the float path, its runs past ``pq_gemm_rows()`` through the many-row
    product. With ``stack_rows`` 1 every step, decode too, takes the float path (runs of a
    pair or a few: ``pq_linear_rows``)."""
    prompt = ([5, 6, 7, 8, 9, 40, 41, 3, 200, 17, 301] * 14)[:prompt_len]
    want_tokens, want_lp = _torch_greedy(all_blocks, prompt, 12)
    tokens, lp = _lite_greedy(all_blocks, prompt, 12, stack_rows)
    assert tokens == want_tokens
    np.testing.assert_allclose(lp, want_lp, atol=TOL)
    assert len(set(tokens)) > 2, "a degenerate model would prove little"


def test_lite_moe_binds_every_layer_s_experts(all_blocks):
    model = LiteModel(load_model_info(EngineArgs(model=all_blocks, device="cpu")))
    moe = model.cfg.moe
    for desc, experts in zip(model.descs, model.experts):
        assert experts is not None and desc.experts.count == moe.num_experts == 8
        assert (desc.experts.top_k, desc.experts.renormalize, desc.inter) == (2, 1, 64)
        assert desc.gate_up.nparts == desc.down.nparts == 0
        assert [experts.gate_up[j].type for j in range(2)] == [2, 7]  # Q4_0, Q5_1
        assert experts.down[5].type == 8 and experts.gate_up[3].col == 64
    # the router and two experts' parts a layer, besides attention and the head
    per_layer = model.experts[0].read_bytes()
    assert per_layer < model.step_read_bytes() < 3 * per_layer * 8


def test_lite_moe_routes_as_layer_c(all_blocks):
    """Ties go to the lower expert, the k kept in descending order, renormalised."""
    model = LiteModel(load_model_info(EngineArgs(model=all_blocks, device="cpu")))
    experts = model.experts[0]
    experts.router = np.zeros_like(experts.router)
    experts.router[[2, 5, 6], 0] = [1.0, 3.0, 1.0]
    w, ids = experts.route(np.eye(1, 64, dtype=np.float32))
    assert ids.tolist() == [[5, 2]]
    e = np.exp([3.0, 1.0])
    np.testing.assert_allclose(w, [e / e.sum()], rtol=1e-6)


def test_lite_moe_needs_no_torch(all_blocks):
    code = ("import sys; from pocketllm import EngineArgs; "
            "from pocketllm.model_info import load_model_info; "
            "from pocketllm.workers.lite.model import LiteModel; "
            f"LiteModel(load_model_info(EngineArgs(model={all_blocks!r}, device='cpu'))); "
            "assert 'torch' not in sys.modules, 'torch was imported'")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_what_the_lite_worker_leaves_to_the_torch_worker(hf_moe, all_blocks, tmp_path):
    """Float experts (a type with no kernel) are refused at bind time, and the worker
    falls back to the torch one; a router bias, expert biases, a clamped SwiGLU or another
    family's routing are refused from the config."""
    from pocketllm.workers.__main__ import lite_runner

    path = _write(hf_moe, tmp_path, "F16", "Q8_0")
    args = EngineArgs(model=path, device="cpu")
    info = load_model_info(args)
    assert refusal(info) is None  # the config alone allows it
    with pytest.raises(UnsupportedFeatureError, match=r"experts\.0\.gate_proj: a float type"):
        LiteModel(info)
    runner, why = lite_runner(info, args, 1)
    assert runner is None and "a float type" in why

    cfg = arch_config(load_model_info(EngineArgs(model=all_blocks)))
    assert experts_refusal("qwen3_moe", cfg) is None

    def moe(**kw):
        return dataclasses.replace(cfg, moe=dataclasses.replace(cfg.moe, **kw))

    assert experts_refusal("qwen3_moe", moe(router_bias=True)) == "expert or router biases"
    assert experts_refusal("qwen3_moe", moe(expert_bias=True)) == "expert or router biases"
    assert "clamped" in experts_refusal("qwen3_moe", moe(swiglu_limit=7.0))
    assert experts_refusal("gpt_oss", cfg) == "the gpt_oss family's expert routing"


@pytest.mark.parametrize("tokens", [1, 5, 40])
def test_lite_experts_equal_the_dequantized_experts(all_blocks, monkeypatch, tokens):
    """The float path's experts against numpy on the dequantized weights (the same
    routing), and the same whatever the split into library calls: runs batched up to
    MAX_PARTS parts a call or a run a call, the row dots or the many-row product."""
    from pocketllm.workers.lite import experts as lite_experts
    from pocketllm.workers.loader.gguf import load_gguf_weights

    info = load_model_info(EngineArgs(model=all_blocks, device="cpu"))
    experts = LiteModel(info).experts[1]
    w = dict(load_gguf_weights(all_blocks, info))
    h = np.random.default_rng(tokens).standard_normal((tokens, 64)).astype(np.float32)
    weights, ids = experts.route(h)
    want = np.zeros((tokens, 64))
    for t in range(tokens):
        for j, e in enumerate(ids[t]):
            p = f"model.layers.1.mlp.experts.{e}."
            gate, up, down = (w[p + n + ".weight"].read().astype(np.float64)
                              for n in ("gate_proj", "up_proj", "down_proj"))
            g, u = gate @ h[t], up @ h[t]
            want[t] += weights[t, j] * (down @ (g / (1 + np.exp(-g)) * u))
    lib = cpu_lib.lib()
    outs = []
    for max_parts, gemm_rows in ((128, 0), (2, 0), (128, 1), (4, 3), (128, 1 << 30)):
        monkeypatch.setattr(lite_experts, "MAX_PARTS", max_parts)
        before = lib.pq_gemm_rows(gemm_rows) if gemm_rows else None
        try:
            outs.append(experts(h, 0))
        finally:
            if before is not None:
                lib.pq_gemm_rows(before)
    scale = np.abs(want).max()
    for out in outs:
        np.testing.assert_allclose(out, want, atol=2e-4 * scale)  # 16-bit activations
        np.testing.assert_allclose(out, outs[0], atol=2e-5 * scale)  # sum orders


@pytest.fixture(scope="module")
def q4_k_m(tmp_path_factory, tokenizer_donor) -> str:
    """``bench/synthetic_gguf``'s Q4_K_M qwen3moe file of test_qwen3_moe_gguf's tiny shape
    (Q4_K and Q6_K experts, 256-element blocks, a 49,152-token vocabulary)."""
    from pocketllm.bench.synthetic_gguf import write_synthetic_gguf
    from test_qwen3_moe_gguf import TINY_MOE

    path = str(tmp_path_factory.mktemp("synthetic") / "tiny-q4_k_m.gguf")
    write_synthetic_gguf(TINY_MOE, path, tokenizer_donor)
    return path


@pytest.mark.parametrize("stack_rows", [0, 1])
def test_lite_moe_on_a_q4_k_m_file(q4_k_m, stack_rows):
    from test_qwen3_moe_gguf import SYNTH_PROMPT

    want_tokens, want_lp = _torch_greedy(q4_k_m, SYNTH_PROMPT, 8)
    tokens, lp = _lite_greedy(q4_k_m, SYNTH_PROMPT, 8, stack_rows)
    assert tokens == want_tokens
    np.testing.assert_allclose(lp, want_lp, atol=TOL)
