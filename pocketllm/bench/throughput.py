"""`pocketllm bench throughput`: offline output tokens/s over many requests at once.

Random token-id prompts of a fixed length, a fixed number of output tokens each
(``ignore_eos``), all handed to ``LLM.generate`` in one call, so the scheduler
keeps its batch as full as memory allows. Sampling at temperature 1 (seeded),
as a serving workload would.
"""

from __future__ import annotations

import random
import statistics
import time
from dataclasses import dataclass
from typing import Optional

from ..config import EngineArgs
from ..proto.messages import STEP_PATHS
from ..sampling import SamplingParams


@dataclass
class ThroughputResult:
    name: str
    num_prompts: int
    input_len: int
    output_len: int
    seconds: float
    output_tokens: int
    dtype: str = "float32"
    # Per run, by how the steps' forward ran: (steps, launch ms, device ms) summed.
    step_profile: Optional[dict[str, tuple[int, float, float]]] = None
    cached_prompt_tokens: int = 0  # per run, served from the prefix cache (should be ~0)
    run_seconds: float = 0.0  # mean wall time of a run, what the per-run profile sums over

    @property
    def output_tps(self) -> float:
        return self.output_tokens / self.seconds

    @property
    def total_tps(self) -> float:
        return (self.output_tokens + self.num_prompts * self.input_len) / self.seconds

    def row(self) -> str:
        return (f"{self.name:<14} {self.num_prompts:>8} {self.seconds:>9.2f} "
                f"{self.output_tps:>14,.0f} {self.total_tps:>14,.0f}")


def random_prompts(vocab_size: int, num_prompts: int, input_len: int, seed: int
                   ) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(vocab_size) for _ in range(input_len)] for _ in range(num_prompts)]


def run_pocketllm(args: EngineArgs, num_prompts: int, input_len: int, output_len: int,
                  seed: int, runs: int, penalties: Optional["Penalties"] = None
                  ) -> tuple[ThroughputResult, list[list[int]]]:
    """``penalties``: penalty / logit_bias fields for the measured runs (None: unused)."""
    from .. import LLM

    with LLM(args) as llm:
        dtype = llm.engine_caps().dtype
        vocab = llm.model_info.vocab_size
        # Each run draws its own prompts: a repeated prompt would be served from the prefix
        # cache that the run before it filled, and the run would skip its prefill.
        prompts = [random_prompts(vocab, num_prompts, input_len, seed + run) for run in range(runs)]
        sp = SamplingParams(max_tokens=output_len, temperature=1.0, seed=seed, ignore_eos=True,
                            **(penalties.fields(vocab, seed)
                               if penalties is not None else {}))
        # Warm-up: kernels compiled, allocator grown (prompts differ: no prefix-cache help).
        warm = random_prompts(vocab, min(num_prompts, 64), input_len, seed + runs)
        llm.generate(warm, SamplingParams(max_tokens=8, ignore_eos=True))
        before = settled_stats(llm)
        times, produced = [], 0
        for run_prompts in prompts:
            start = time.perf_counter()
            outputs = llm.generate(run_prompts, sp)
            times.append(time.perf_counter() - start)
            produced = sum(len(o.token_ids) for o in outputs)
        after = settled_stats(llm, newer_than=before)
    cached = (after.prefix_cache_hits - before.prefix_cache_hits) // runs
    return ThroughputResult("pocketllm", num_prompts, input_len, output_len,
                            statistics.median(times), produced, dtype,
                            step_profile(before, after, runs), cached,
                            statistics.mean(times)), prompts[0]


def step_profile(before, after, runs: int) -> dict[str, tuple[int, float, float]]:
    """(steps, launch ms, device ms) per run and path, between two SchedulerStats."""
    def per_run(field: str, path: str) -> float:
        return (getattr(after, field).get(path, 0) - getattr(before, field).get(path, 0)) / runs

    return {path: (round(per_run("steps_by_path", path)),
                   per_run("step_launch_ms_by_path", path),
                   per_run("step_device_ms_by_path", path)) for path in STEP_PATHS}


def settled_stats(llm, newer_than=None, timeout: float = 2.0):
    """The engine's stats once they say idle: the scheduler sends them after its last step
    (``newer_than``: a stats message they must have replaced)."""
    deadline = time.monotonic() + timeout
    stats = llm.engine_stats()
    while time.monotonic() < deadline and (
            stats is newer_than or stats.running or stats.waiting):
        time.sleep(0.02)
        stats = llm.engine_stats()
    return stats


def report(results: list[ThroughputResult]) -> str:
    r0 = results[0]
    lines = [f"{r0.input_len} input / {r0.output_len} output tokens per request; median of runs",
             f"{'engine':<14} {'requests':>8} {'seconds':>9} {'output tok/s':>14} "
             f"{'total tok/s':>14}"]
    lines += [r.row() for r in results]
    for r in results:
        if r.step_profile is not None:
            lines.append(f"{r.name} prompt tokens per run served from the prefix cache: "
                         f"{r.cached_prompt_tokens:,}")
        if r.step_profile:
            lines.append(f"{r.name} steps per run by how their forward ran, with the total ms "
                         "spent launching them and their device span (CUDA only):")
            lines += [f"  {path:<10} {n:>7,} steps  launch {launch:>9,.0f}  device "
                      f"{device:>9,.0f}" for path, (n, launch, device) in r.step_profile.items()]
            device_s = sum(device for _n, _launch, device in r.step_profile.values()) / 1e3
            if device_s and r.run_seconds:  # the rest of the wall time the GPU waited
                lines.append(f"  device spans cover {device_s / r.run_seconds:.0%} of a run's "
                             f"{r.run_seconds:.2f} s")
    if len(results) == 2:
        lines.append(f"ratio {results[0].name}/{results[1].name}: output tokens/s "
                     f"{results[0].output_tps / results[1].output_tps:.2f}x")
    return "\n".join(lines)


@dataclass
class Penalties:
    """What the penalty flags ask for; the defaults leave every one unused."""
    frequency: float = 0.0
    presence: float = 0.0
    repetition: float = 1.0
    bias_tokens: int = 0  # logit_bias on this many random token ids

    def fields(self, vocab_size: int, seed: int) -> dict:
        out: dict = {}
        if self.frequency:
            out["frequency_penalty"] = self.frequency
        if self.presence:
            out["presence_penalty"] = self.presence
        if self.repetition != 1.0:
            out["repetition_penalty"] = self.repetition
        if self.bias_tokens:  # small biases on random tokens: the sampling stays a real draw
            rng = random.Random(seed + 1)
            out["logit_bias"] = {t: rng.choice((-2.0, 2.0))
                                 for t in rng.sample(range(vocab_size), self.bias_tokens)}
        return out
