"""Decode under CUDA graphs: the ladder, and greedy parity of the GPU path (graphs on and
off, piecewise graphs for the prefill steps) with the CPU torch path on every family's tiny
checkpoint (GPU tests skip without CUDA)."""

from __future__ import annotations

import random

import pytest

torch = pytest.importorskip("torch")

from pocketllm.config import EngineArgs  # noqa: E402
from pocketllm.model_info import load_model_info  # noqa: E402
from pocketllm.proto.messages import SamplingSpec  # noqa: E402
from pocketllm.workers.cuda_graphs import ladder  # noqa: E402
from pocketllm.workers.runner import ModelRunner  # noqa: E402
from tiny_checkpoints import PlanDriver, make_tiny_checkpoint  # noqa: E402

FAMILIES = ["llama", "qwen2", "qwen3", "gemma3", "qwen3_moe", "gpt_oss", "deepseek_v3",
            "deepseek_v2", "qwen3_5", "qwen3_5_moe", "qwen3_next"]
CUDA = torch.cuda.is_available()


def test_ladder_covers_every_batch_up_to_the_cap():
    rungs = ladder(256)
    assert rungs[:5] == [1, 2, 4, 8, 16] and rungs[-1] == 256
    assert rungs == sorted(set(rungs))
    assert ladder(100)[-1] == 100 and ladder(1) == [1] and ladder(3) == [1, 2, 3]
    for b in range(1, 257):  # the padding a batch pays is bounded
        rung = next(r for r in rungs if r >= b)
        assert rung - b < max(8, b // 4)


def greedy_batch(path: str, device: str, **kw) -> dict[str, list[int]]:
    args = EngineArgs(model=path, device=device, dtype="float32", block_size=4,
                      num_kv_blocks=128, max_num_seqs=8, **kw)
    runner = ModelRunner(load_model_info(args), args)
    if device == "cuda":
        assert (runner.graphs is not None) == kw.get("cuda_graphs", True)
        # (no piecewise graphs for a linear-attention model's prefill steps yet)
        assert (runner.mixed_graphs is not None) == (kw.get("cuda_graphs", True)
                                                     and kw.get("cuda_graph_max_tokens") != 0
                                                     and not any(runner.state_groups))
    driver = PlanDriver(runner)
    rng = random.Random(3)
    spec = SamplingSpec(temperature=0.0, max_tokens=24)
    for i, length in enumerate([5, 13, 21]):  # 3 decodes pad to the rung of 4
        driver.add(f"r{i}", [rng.randrange(12, 512) for _ in range(length)], spec, 24)
    return driver.run()


def test_verify_rounds_give_each_sequence_its_rows_slots_and_snapshots():
    """A hybrid model's verify graph (verify_graphs.py) reads, per round j, each
    sequence's j-th row, state slot and snapshot slot from buffers written before the
    replay: a sequence with fewer rows, and the padding sequences of the rung, point
    those rounds at the step's last row (padding then) and the spare slot."""
    from pocketllm.workers.step_rows import ScheduledSeq
    from pocketllm.workers.verify_graphs import VerifyGraphs

    graphs = VerifyGraphs.__new__(VerifyGraphs)  # the buffers alone: no capture on the CPU
    graphs.query_rows, graphs.pad_blocks = 3, [99, 7]  # k = 2; group 1 a state group
    graphs.rounds = [None, torch.zeros(3, 3, 8, dtype=torch.long)]
    seqs = [ScheduledSeq([4], 10, 3, 0), ScheduledSeq([5], 20, 2, 3)]  # 2 and 1 drafts
    graphs._write_rounds(1, seqs, [(0, 1), (1, 2), (3, 6)], rung=4)  # (row, snapshot slot)
    rows, slots, snapshots = graphs.rounds[1][:, :, :4].tolist()
    last = 4 * 3 - 1
    assert rows == [[0, 3, last, last], [1, 4, last, last], [2, last, last, last]]
    assert slots == [[4, 5, 7, 7], [4, 5, 7, 7], [4, 7, 7, 7]]
    assert snapshots == [[1, 6, 7, 7], [2, 7, 7, 7], [7, 7, 7, 7]]
    assert not graphs.rounds[1][:, :, 4:].any()  # past the rung: untouched


def test_a_verification_replays_the_fewest_rows_that_hold_its_longest_sequence():
    """A hybrid model's verify graphs come in two row counts (``VerifyGraphSet``): a probe
    of one draft replays the two-row graphs (two rounds of each linear-attention layer),
    a longer proposal the k + 1-row ones; a batch past every rung runs eagerly."""
    from pocketllm.workers.step_rows import ScheduledSeq
    from pocketllm.workers.verify_graphs import VerifyGraphs, VerifyGraphSet

    def graphs(rows: int, rungs: list[int]) -> VerifyGraphs:
        g = VerifyGraphs.__new__(VerifyGraphs)  # no capture on the CPU
        g.query_rows, g.graphs = rows, dict.fromkeys(rungs)
        return g

    two, five = graphs(2, [1, 2, 4]), graphs(5, [1, 2, 4])
    ladder = VerifyGraphSet([five, two])
    probe, longer = ScheduledSeq([4], 10, 2, 0), ScheduledSeq([5], 20, 4, 2)
    assert ladder.fits([probe]) == (two, 1)
    assert ladder.fits([probe, longer, probe]) == (five, 4)
    assert ladder.fits([probe] * 5) == (None, 0)
    assert ladder.fits([ScheduledSeq([4], 10, 6, 0)]) == (None, 0)  # past k + 1 rows
    assert ladder.max_rows == 20


@pytest.mark.skipif(not CUDA, reason="CUDA graphs need a GPU")
@pytest.mark.parametrize("family", FAMILIES)
def test_gpu_greedy_matches_cpu_with_graphs_on_and_off(family, tmp_path):
    path = make_tiny_checkpoint(family, str(tmp_path / family))
    cpu = greedy_batch(path, "cpu")
    assert greedy_batch(path, "cuda", cuda_graphs=False) == cpu
    assert greedy_batch(path, "cuda", cuda_graphs=True, cuda_graph_max_tokens=0) == cpu
    # and with the prefill steps (39 tokens, then fewer) on piecewise graphs (the default)
    assert greedy_batch(path, "cuda", cuda_graphs=True) == cpu


@pytest.mark.skipif(not CUDA, reason="CUDA graphs need a GPU")
def test_gpu_sliding_cache_groups_match_cpu_with_graphs_on_and_off(tmp_path):
    """Gemma 3's sliding layers in a pool of their own, under the real scheduler (blocks
    behind the window freed and reused, prefix hits): the decode graphs' and the piecewise
    graphs' static block tables are per group."""
    from test_sliding_window_cache import Engine, make_runner, shared_prefix_workload

    path = make_tiny_checkpoint("gemma3", str(tmp_path / "gemma3"))
    kw = dict(num_kv_blocks=64, max_num_batched_tokens=16)
    cpu = shared_prefix_workload(Engine(make_runner(path, **kw)))
    for graphs in (dict(cuda_graphs=False), dict(cuda_graphs=True, cuda_graph_max_tokens=0),
                   dict(cuda_graphs=True)):
        runner = make_runner(path, device="cuda", **kw, **graphs)
        assert len(runner.kv.pools) == 2
        assert (runner.graphs is not None) == graphs["cuda_graphs"]
        assert shared_prefix_workload(Engine(runner)) == cpu, graphs


@pytest.mark.skipif(not CUDA, reason="needs a GPU")
@pytest.mark.parametrize("graphs", [dict(cuda_graphs=False),
                                    dict(cuda_graphs=True, cuda_graph_max_tokens=0),
                                    dict(cuda_graphs=True)])
@pytest.mark.parametrize("family", ["llama", "qwen3_5"])
def test_launching_a_step_never_waits_for_the_gpu(graphs, family, tmp_path):
    """Overlapped scheduling needs ``launch`` to queue a step and return: one synchronizing
    call (a blocking host-to-GPU copy, an .item()) would hold the host until the GPU had
    run everything queued, the previous step included. CUDA's sync debug mode turns any
    such call into an error, under every sampling option that costs device work, and in a
    hybrid model's linear-attention layers (several prompts' chunks in one step)."""
    path = make_tiny_checkpoint(family, str(tmp_path / family))
    args = EngineArgs(model=path, device="cuda", dtype="float32", block_size=4,
                      num_kv_blocks=128, max_num_seqs=8, **graphs)
    runner = ModelRunner(load_model_info(args), args)
    rng = random.Random(4)
    specs = [SamplingSpec(temperature=1.0, seed=7, logprobs=2, max_tokens=10),
             SamplingSpec(temperature=0.8, top_k=5, min_p=0.05, max_tokens=10),
             SamplingSpec(temperature=0.0, presence_penalty=0.5, logit_bias={7: -100.0},
                          max_tokens=10),
             SamplingSpec(temperature=0.0, max_tokens=10)]

    def run():
        driver = PlanDriver(runner, chunk=16)  # 16-token chunks: steps mix prefill and decode
        for i, spec in enumerate(specs):
            driver.add(f"r{i}", [rng.randrange(12, 512) for _ in range(9 + 11 * i)], spec, 10)
        return driver.run()

    run()  # compiles the kernels (a compile may synchronize)
    launch, paths = runner.launch, set()

    def strict_launch(plan):
        torch.cuda.set_sync_debug_mode("error")
        try:
            step = launch(plan)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        paths.add(step.path)
        return step

    runner.launch = strict_launch
    assert all(len(tokens) == 10 for tokens in run().values())  # PlanDriver checks errors
    piecewise = graphs["cuda_graphs"] and "cuda_graph_max_tokens" not in graphs
    mixed = "piecewise" if piecewise and not any(runner.state_groups) else "eager"
    assert paths == {mixed, "graph" if graphs["cuda_graphs"] else "eager"}
