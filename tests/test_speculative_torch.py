"""Speculative decoding on the torch worker (docs/speculative.md): tiny dense,
sliding-window, MLA and hybrid checkpoints in float32, n-gram and replayed drafts, the
same text as without speculation; on a GPU, verification steps under CUDA graphs and
bf16 drafts of the greedy output all accepted."""

from __future__ import annotations

import pytest

from speculation_checks import GPU, decoded, draft_counts, same, same_and_drafts


@pytest.mark.parametrize("family,device", [
    ("llama", "cpu"), ("deepseek_v2", "cpu"), ("qwen3_5", "cpu"),
    pytest.param("llama", "cuda", marks=GPU), pytest.param("gemma3", "cuda", marks=GPU),
    pytest.param("deepseek_v2", "cuda", marks=GPU), pytest.param("qwen3_5", "cuda", marks=GPU)])
def test_torch_worker_greedy_text_is_the_same_with_speculation(family, device, tmp_path):
    """Dense, sliding-window, MLA and hybrid (Qwen3.5: each draft row's state kept and
    the rejected ones rolled back) models on the torch worker (float32): n-gram drafts
    change no token, two requests drafting in one step and a cached prefix in play; then
    the replay drafter replays the greedy output (every draft accepted), a shifted copy
    (none accepted) and one with every third token shifted (runs cut short). On a GPU,
    verification steps replay CUDA graphs (Qwen3.5's recurrent rows in rounds; MLA's
    rows absorbed as decodes)."""
    import json

    from pocketllm import LLM, SamplingParams
    from tiny_checkpoints import make_tiny_checkpoint

    path = make_tiny_checkpoint(family)
    prompts = [[40, 41, 42, 43, 40, 41, 42, 43, 40, 41], [50, 51, 52, 50, 51, 52, 50]]
    common = dict(model=path, dtype="float32", max_model_len=256, device=device)
    greedy = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    want = decoded(prompts, greedy, **common)
    spec = LLM(**common, speculative_method="ngram")
    try:
        for _ in range(2):  # the second time from the prefix cache
            same(want, spec.generate(prompts, greedy))
    finally:
        spec.shutdown()
    for every in (0, 1, 3):  # each token right, each wrong, every third wrong
        replay = tmp_path / f"replay{every}.json"
        replay.write_text(json.dumps({"runs": [
            {"prompt": p, "output": [(t + (every and i % every == every - 1)) % 512
                                     for i, t in enumerate(o.token_ids)]}
            for p, o in zip(prompts, want)]}))
        llm = LLM(**common, speculative_method="replay", speculative_replay=str(replay),
                  num_speculative_tokens=3)
        try:
            graphs = llm.engine_caps().speculative_max_rows
            before = llm.engine_stats()
            same(want, llm.generate(prompts, greedy))
            drafted, accepted = draft_counts(llm, before)
            eager = llm.engine_stats().steps_by_path.get("eager", 0) - before.steps_by_path.get(
                "eager", 0)
        finally:
            llm.shutdown()
        assert drafted > 0
        assert accepted == drafted if every == 0 else accepted == 0 if every == 1 else (
            0 < accepted < drafted)
        if device == "cuda":  # 4 requests of 3 drafts + 1
            # (a hybrid model's prompt step is eager: no piecewise graphs for it)
            assert graphs == 4 * 4 and eager == (family == "qwen3_5")



@GPU
@pytest.mark.parametrize("family", ["llama", "gemma3", "qwen3_5", "deepseek_v2"])
@pytest.mark.parametrize("k", [4, 7])
def test_bf16_drafts_of_the_greedy_output_are_all_accepted_on_the_gpu(family, k, tmp_path):
    """In bfloat16 on CUDA, a verification step computes each of its k + 1 rows with the
    bits its decode step would have had (the gemv's rows, the decode kernel's splits; a
    hybrid model's eager step too, its recurrent rows one by one; an MLA model's absorbed
    heads row by row, its router and experts as gemvs), so every draft
    replaying the greedy output is accepted and the text is the same, though a tiny
    random model's logits are full of near ties."""
    import json

    from pocketllm import LLM, SamplingParams
    from tiny_checkpoints import make_tiny_checkpoint

    path = make_tiny_checkpoint(family)
    prompt = [[40, 41, 42, 43, 44, 45, 46]]
    common = dict(model=path, dtype="bfloat16", max_model_len=256, device="cuda")
    greedy = SamplingParams(max_tokens=64, temperature=0, ignore_eos=True)
    want = decoded(prompt, greedy, **common)
    replay = tmp_path / "replay.json"
    replay.write_text(json.dumps({"runs": [{"prompt": prompt[0],
                                            "output": list(want[0].token_ids)}]}))
    llm = LLM(**common, speculative_method="replay", speculative_replay=str(replay),
              num_speculative_tokens=k)
    drafted, accepted = same_and_drafts(llm, want, prompt, greedy)
    assert drafted > 0 and accepted == drafted
