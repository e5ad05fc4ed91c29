"""`pocketllm bench latency`: every measured batch-1 run prefills its whole prompt."""

from __future__ import annotations

from pocketllm.bench.latency import fresh_prompt, report, run_pocketllm
from pocketllm.config import EngineArgs
from tiny_checkpoints import make_tiny_checkpoint


def test_fresh_prompt_changes_one_token_and_keeps_the_first():
    ids = [1, 50, 60, 70]
    variants = [fresh_prompt(ids, run, 100) for run in range(3)]
    assert all(v[0] == 1 and v[2:] == [60, 70] for v in variants)
    assert len({tuple(v) for v in variants + [ids]}) == 4
    assert fresh_prompt([99], 0, 100) == [0]


def test_batch1_runs_find_nothing_in_the_prefix_cache(tmp_path):
    """A repeated prompt would be served from the prefix cache that the run before filled,
    so TTFT would leave out the prefill (the transformers peer has no such cache)."""
    args = EngineArgs(model=make_tiny_checkpoint("llama", str(tmp_path / "llama")), device="cpu",
                      dtype="float32", block_size=4, enable_prefix_caching=True)
    prompt = [(7 * i + 11) % 500 for i in range(24)]
    result, ids = run_pocketllm(args, prompt, "", output_len=4, runs=2, warmup=1)
    assert ids == prompt and result.decode_tps > 0 and result.ttft_s > 0
    assert result.cached_prompt_tokens == 0
    assert "served from the prefix cache in the batch-1 runs: 0" in report([result], 4)
