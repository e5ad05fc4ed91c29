"""What every family's parity test against transformers drives: the runner through the
``PlanDriver`` (greedy, with log probabilities; chunked prefill and a preemption on
demand), and the comparison with transformers' greedy tokens and log probabilities."""

from __future__ import annotations

import pytest

from test_worker_parity import GREEDY_LP, NEW_TOKENS
from tiny_checkpoints import PlanDriver

# float32 log probabilities of 32 greedy steps against transformers' own: torch's kernels
# sum in another order on another ISA, and a tiny recurrent MoE drifted by 1.02e-4 on an
# AVX2 EPYC (session 34) where it stays under 1e-4 on an AVX-512 Xeon; a wrong layer is
# off by orders of magnitude more
LOGPROB_TOL = 2e-4


def run(runner, prompts: dict, new_tokens=NEW_TOKENS, chunk=None, preempt_after=None):
    driver = PlanDriver(runner, chunk=chunk, shuffle_blocks=1)
    for rid, prompt in prompts.items():
        driver.add(rid, prompt, GREEDY_LP, new_tokens)
    if preempt_after is not None:
        for _ in range(preempt_after):
            driver.step_once()
        driver.preempt(next(iter(prompts)))  # drops its KV: recomputed from its tokens
    return driver.run(), driver


def assert_matches(tokens, logprobs, reference, tol: float = LOGPROB_TOL):
    """``reference``: ``hf_greedy``'s (tokens, log-softmax rows): the same tokens, each
    token's log probability and the top 5 within ``tol``."""
    ref_tokens, ref_logprobs = reference
    assert tokens == ref_tokens
    for step, lp in enumerate(logprobs):
        ref = ref_logprobs[step]
        assert lp.logprob == pytest.approx(ref[tokens[step]].item(), abs=tol)
        top_vals, top_ids = ref.topk(5)
        assert lp.top_token_ids == top_ids.tolist()
        assert lp.top_logprobs == pytest.approx(top_vals.tolist(), abs=tol)


def assert_tp2_equals_one_rank(path: str, runner) -> None:
    """Two prompts through an engine at TP=2 over gloo: the tokens and log probabilities of
    ``runner`` (one rank) on each alone."""
    import random

    from pocketllm import LLM, EngineArgs, SamplingParams

    prompts = [[2] + [random.Random(i).randrange(3, 512) for _ in range(n)]
               for i, n in enumerate((5, 19))]
    ref = []
    for p in prompts:
        out, driver = run(runner, {"x": p}, new_tokens=12)
        ref.append((out["x"], [lp.logprob for lp in driver.reqs["x"].logprobs]))
    params = SamplingParams(max_tokens=12, temperature=0, logprobs=0, ignore_eos=True)
    with LLM(EngineArgs(model=path, tensor_parallel_size=2, device="cpu",
                        max_num_batched_tokens=8, shutdown_timeout=3)) as llm:
        assert llm.engine_caps().tensor_parallel_size == 2
        outs = llm.generate(prompts, params)
    for out, (tokens, logprobs) in zip(outs, ref):
        assert out.token_ids == tokens
        assert max(abs(e.logprob - lp) for e, lp in zip(out.logprobs, logprobs)) < LOGPROB_TOL
