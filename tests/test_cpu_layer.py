"""The fused CPU decode path (kernels/cpu_layer.py: each decoder layer one library call)
against the module path it replaces: the same greedy tokens and the same log
probabilities, bit for bit, on tiny all-block GGUF files of every family and on the
embedded model; and the models and steps it must leave to the module path."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from pocketllm import EngineArgs  # noqa: E402
from pocketllm.model_info import load_model_info  # noqa: E402
from pocketllm.proto.messages import SamplingSpec  # noqa: E402
from pocketllm.workers.kernels import cpu_quant  # noqa: E402
from pocketllm.workers.runner import ModelRunner  # noqa: E402
from tiny_checkpoints import PlanDriver  # noqa: E402

pytestmark = pytest.mark.skipif(not cpu_quant.available(),
                                reason=f"CPU kernels: {cpu_quant.unavailable_reason()}")

FAMILIES = ["llama", "qwen2", "qwen3", "gemma3"]


def _all_block_gguf(tmp_path, family: str) -> str:
    import gguf
    from test_gguf_weights import _tiny_hf_model, write_tiny_gguf

    Q = gguf.GGMLQuantizationType
    path = str(tmp_path / f"tiny-{family}.gguf")
    write_tiny_gguf(path, family, _tiny_hf_model(family),
                    qtypes=[(Q.Q8_0, 0), (Q.Q4_0, 0), (Q.Q5_1, 0), (Q.Q4_1, 0), (Q.Q5_0, 0)])
    return path


def _runner(path=None, **kw) -> ModelRunner:
    args = EngineArgs(model=path, device="cpu", num_kv_blocks=64, block_size=16, **kw)
    return ModelRunner(load_model_info(args), args)


def _generate(runner: ModelRunner, fused: bool, prompts, steps: int):
    """Greedy tokens and their log probabilities, all prompts decoding side by side."""
    runner.model._fused = None if fused else []  # [] = "cannot bind": the module path
    driver = PlanDriver(runner)
    for i, prompt in enumerate(prompts):
        driver.add(str(i), prompt, SamplingSpec(temperature=0.0, logprobs=0), steps)
    out = driver.run()
    assert bool(runner.model._fused) == fused
    return [(out[str(i)], [lp.logprob for lp in driver.reqs[str(i)].logprobs])
            for i in range(len(prompts))]


@pytest.mark.parametrize("family", FAMILIES)
def test_fused_layers_equal_the_module_path(family, tmp_path):
    """70 steps of three sequences (past Gemma's 64-token window), batched: q/k norms
    (qwen3, gemma3), biases (qwen2), sandwich norms and sliding windows (gemma3)."""
    runner = _runner(_all_block_gguf(tmp_path, family))
    prompts = [[5, 6, 7, 8, 9], [40, 41, 3], [11] * 12]
    fused = _generate(runner, True, prompts, 70)
    assert fused == _generate(runner, False, prompts, 70)
    assert len({t for tokens, _ in fused for t in tokens}) > 3, "a degenerate model proves little"


def test_fused_layers_on_the_embedded_model(default_model_path):
    runner = _runner(default_model_path)
    prompts = [[2, 651, 6037, 529, 7001, 563], [2, 4521, 3105, 496]]
    assert _generate(runner, True, prompts, 24) == _generate(runner, False, prompts, 24)


def test_models_the_fused_path_leaves_alone(tmp_path, tiny_llama):
    """A float weight anywhere (a mixed-type GGUF, a safetensors checkpoint) keeps the
    module path; so does a step with a prefill chunk in it."""
    from test_gguf_weights import _tiny_hf_model, write_tiny_gguf

    mixed = str(tmp_path / "mixed.gguf")
    write_tiny_gguf(mixed, "llama", _tiny_hf_model("llama"))  # F16/BF16/F32 among the blocks
    assert _runner(mixed).model._fused_layers() is False
    assert _runner(tiny_llama).model._fused_layers() is False
    runner = _runner(_all_block_gguf(tmp_path, "llama"))
    calls = []
    real = runner.model._fused_decode
    runner.model._fused_decode = lambda *a: calls.append(a[3][0].num_tokens) or real(*a)
    driver = PlanDriver(runner)
    driver.add("a", [5, 6, 7], SamplingSpec(temperature=0.0), 3)
    driver.run()
    assert calls == [1, 1], "the prompt's prefill step takes the module path, decodes the fused one"
