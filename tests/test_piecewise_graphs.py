"""Piecewise graphs for steps holding a prefill: the token ladder, and the pieces' plumbing
through their static buffers against the eager forward (on the CPU, a capture that reruns
its function stands in for a CUDA graph; the GPU test in test_cuda_graphs.py replays real
ones)."""

from __future__ import annotations

import random
from unittest import mock

import pytest

from kernel_modules import compiled_only, load_kernels

# The fused-kernel variant below runs the Triton kernels: interpreted here, compiled on CUDA.
_, KERNEL_DEVICE = load_kernels()
import pocketllm.workers.kernels as kernels  # noqa: E402
from pocketllm.config import EngineArgs  # noqa: E402
from pocketllm.errors import InvalidRequestError  # noqa: E402
from pocketllm.model_info import load_model_info  # noqa: E402
from pocketllm.proto.messages import SamplingSpec  # noqa: E402
from pocketllm.workers.piecewise_graphs import MixedGraphs, token_ladder  # noqa: E402
from pocketllm.workers.runner import ModelRunner  # noqa: E402
from tiny_checkpoints import PlanDriver, make_tiny_checkpoint  # noqa: E402


def test_token_ladder_covers_every_count_up_to_the_cap():
    rungs = token_ladder(2048)
    assert rungs[0] == 8 and rungs[-1] == 2048 and rungs == sorted(set(rungs))
    assert token_ladder(100)[-1] == 100 and token_ladder(5) == [5]
    assert token_ladder(4096)[-2:] == [3840, 4096]
    for t in range(1, 2049):  # padding under 100%, and under 1/8 for long steps
        rung = next(r for r in rungs if r >= t)
        assert (rung < 2 * t or rung == 8) and (t <= 1024 or rung - t < t // 8)


class RerunGraph:
    """A CUDA graph's stand-in: ``replay`` runs the captured function again. The pieces read
    and write only their static buffers, so a rerun computes what a replay would."""

    replays = 0

    def __init__(self, fn, pool):
        self.fn = fn

    def replay(self):
        RerunGraph.replays += 1
        self.fn()

    def pool(self):
        return None


def greedy(runner: ModelRunner, chunk: int) -> tuple[dict, dict]:
    driver = PlanDriver(runner, chunk=chunk)
    rng = random.Random(5)
    spec = SamplingSpec(temperature=0.0, logprobs=3, max_tokens=12)
    for i, length in enumerate([3, 17, 30]):  # steps mix prefill chunks and decodes
        driver.add(f"r{i}", [rng.randrange(12, 512) for _ in range(length)], spec, 12)
    tokens = driver.run()
    return tokens, {rid: [lp.logprob for lp in r.logprobs] for rid, r in driver.reqs.items()}


def make_runner(path: str, device: str = "cpu") -> ModelRunner:
    """An eager runner (on CUDA too): the tests install the graphs they mean to check."""
    args = EngineArgs(model=path, device=device, dtype="float32", block_size=4,
                      num_kv_blocks=64, max_num_seqs=4, cuda_graphs=False)
    return ModelRunner(load_model_info(args), args)


_FUSED_ON_CPU = "llama's fused case runs the same pieces interpreted"


@pytest.mark.parametrize("family, fused", [
    ("llama", False), ("gemma3", False), ("qwen3", False), ("llama", True),
    ("qwen3_moe", False), compiled_only("qwen3_moe", True, reason=_FUSED_ON_CPU),
    ("gpt_oss", False), compiled_only("gpt_oss", True, reason=_FUSED_ON_CPU),
    ("deepseek_v3", False), compiled_only("deepseek_v3", True, reason=_FUSED_ON_CPU),
    ("deepseek_v2", False)])
def test_pieces_replayed_around_eager_attention_match_the_eager_forward(family, fused):
    path = make_tiny_checkpoint(family)
    device = KERNEL_DEVICE.type if fused else "cpu"
    with mock.patch.object(kernels, "kernels_usable", lambda device: fused):
        eager = greedy(make_runner(path, device), chunk=8)
        runner = make_runner(path, device)
        runner.mixed_graphs = MixedGraphs(runner.model, runner.kv_caches, runner.max_model_len,
                                          runner.device, 32, capture=RerunGraph)
        assert runner.mixed_graphs.token_counts == [8, 16, 32]
        RerunGraph.replays = 0
        results = []
        finish = runner.finish
        runner.finish = lambda step: results.append(finish(step)) or results[-1]
        piecewise = greedy(runner, chunk=8)
    # tokens equal; logprobs to float noise (a padded GEMM may block its rows differently)
    assert piecewise[0] == eager[0] and len(set(eager[0]["r1"])) > 3
    for rid, logprobs in eager[1].items():
        assert piecewise[1][rid] == pytest.approx(logprobs, abs=1e-4)
    # every step (at most 3 sequences x 8 tokens) went through the pieces
    steps = max(len(v) for v in eager[0].values()) + 30 // 8
    assert RerunGraph.replays >= steps * (len(runner.model.layers) + 1)
    assert {r.path for r in results} == {"piecewise"}  # as the step results report it


def test_steps_past_the_largest_rung_run_eagerly():
    path = make_tiny_checkpoint("llama")
    runner = make_runner(path)
    runner.mixed_graphs = MixedGraphs(runner.model, runner.kv_caches, runner.max_model_len,
                                      runner.device, 16, capture=RerunGraph)
    assert runner.mixed_graphs.rung(17) == 0 and runner.mixed_graphs.rung(9) == 16
    RerunGraph.replays = 0
    results = []
    finish = runner.finish
    runner.finish = lambda step: results.append(finish(step)) or results[-1]
    assert greedy(runner, chunk=64)[0] == greedy(make_runner(path), chunk=64)[0]
    # the 50-row prefill ran eagerly; the decode steps (3 rows) replayed
    assert [r.path for r in results] == ["eager"] + ["piecewise"] * (len(results) - 1)


def test_max_tokens_flag_is_validated():
    with pytest.raises(InvalidRequestError, match="cuda_graph_max_tokens"):
        EngineArgs(cuda_graph_max_tokens=-1).validate()


def test_flag_without_cuda_graphs_warns_and_changes_nothing(caplog):
    args = EngineArgs(model=make_tiny_checkpoint("llama"), device="cpu", dtype="float32",
                      num_kv_blocks=16, cuda_graph_max_tokens=64)
    with caplog.at_level("WARNING", logger="pocketllm.worker"):
        runner = ModelRunner(load_model_info(args), args)
    assert runner.mixed_graphs is None and runner.graphs is None
    assert "--cuda-graph-max-tokens has no effect" in caplog.text
