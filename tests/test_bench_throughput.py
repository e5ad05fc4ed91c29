"""`pocketllm bench throughput`'s step profile: per-run differences of the engine's stats."""

from __future__ import annotations

from pocketllm.bench.throughput import ThroughputResult, report, step_profile
from pocketllm.proto.messages import SchedulerStats


def test_step_profile_is_the_per_run_difference_and_is_reported():
    before = SchedulerStats(steps_by_path={"eager": 4}, step_launch_ms_by_path={"eager": 40.0})
    after = SchedulerStats(steps_by_path={"eager": 24, "graph": 300},
                           step_launch_ms_by_path={"eager": 640.0, "graph": 90.0},
                           step_device_ms_by_path={"eager": 900.0, "graph": 1500.0})
    profile = step_profile(before, after, runs=2)
    assert profile == {"graph": (150, 45.0, 750.0), "piecewise": (0, 0.0, 0.0),
                       "eager": (10, 300.0, 450.0)}
    result = ThroughputResult("pocketllm", 8, 16, 16, 2.0, 128, step_profile=profile,
                              run_seconds=1.5)
    lines = report([result]).splitlines()
    assert lines[-4].split() == ["graph", "150", "steps", "launch", "45", "device", "750"]
    assert lines[-2].split() == ["eager", "10", "steps", "launch", "300", "device", "450"]
    # (750 + 450) ms of device spans in a 1.5 s run: the GPU waited for the host 20% of it
    assert lines[-1].strip() == "device spans cover 80% of a run's 1.50 s"


def test_each_run_prefills_its_own_prompts(tmp_path):
    """A run that repeated the previous run's prompts would find them in the prefix cache and
    skip their prefill: the measured runs draw fresh prompts and report the cache's help."""
    from pocketllm.bench.throughput import run_pocketllm
    from pocketllm.config import EngineArgs
    from tiny_checkpoints import make_tiny_checkpoint

    args = EngineArgs(model=make_tiny_checkpoint("llama", str(tmp_path / "llama")), device="cpu",
                      dtype="float32", block_size=4, enable_prefix_caching=True)
    result, _ = run_pocketllm(args, num_prompts=6, input_len=16, output_len=4, seed=3, runs=2)
    assert result.output_tokens == 6 * 4
    assert result.cached_prompt_tokens == 0
    assert "served from the prefix cache: 0" in report([result])
