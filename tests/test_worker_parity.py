"""The torch data plane against transformers on tiny random checkpoints of every family."""

from __future__ import annotations

import random

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from pocketllm.config import EngineArgs  # noqa: E402
from pocketllm.model_info import load_model_info  # noqa: E402
from pocketllm.proto.messages import SamplingSpec  # noqa: E402
from pocketllm.workers.runner import ModelRunner  # noqa: E402
from tiny_checkpoints import PlanDriver, make_tiny_checkpoint  # noqa: E402

FAMILIES = ["llama", "qwen2", "qwen3", "gemma3"]
PROMPT = [random.Random(7).randrange(3, 512) for _ in range(20)]  # + 32 generated > window 8
NEW_TOKENS = 32
GREEDY_LP = SamplingSpec(temperature=0.0, logprobs=5, max_tokens=NEW_TOKENS)


def make_runner(path: str, device: str = "cpu", **kw) -> ModelRunner:
    args = EngineArgs(model=path, device=device, dtype="float32", block_size=4,
                      num_kv_blocks=64, max_num_seqs=4, **kw)
    return ModelRunner(load_model_info(args), args)


def hf_greedy(path: str, prompt: list[int], new_tokens: int):
    model = transformers.AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, attn_implementation="eager")
    model.generation_config.eos_token_id = None  # generate exactly new_tokens
    with torch.inference_mode():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=new_tokens, do_sample=False,
                             output_logits=True, return_dict_in_generate=True, pad_token_id=0)
    tokens = out.sequences[0, len(prompt):].tolist()
    logprobs = torch.stack(out.logits)[:, 0].float().log_softmax(-1)
    return tokens, logprobs


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_tokens_and_logprobs_match_transformers(family, tmp_path):
    path = make_tiny_checkpoint(family, str(tmp_path / family))
    ref_tokens, ref_logprobs = hf_greedy(path, PROMPT, NEW_TOKENS)

    driver = PlanDriver(make_runner(path))
    driver.add("r", PROMPT, GREEDY_LP, NEW_TOKENS)
    tokens = driver.run()["r"]
    assert tokens == ref_tokens
    assert len(set(tokens)) > 3, "a degenerate reference would prove little"
    for step, lp in enumerate(driver.reqs["r"].logprobs):
        ref = ref_logprobs[step]
        assert lp.logprob == pytest.approx(ref[tokens[step]].item(), abs=1e-4)
        top_vals, top_ids = ref.topk(5)
        assert lp.top_token_ids == top_ids.tolist()
        assert lp.top_logprobs == pytest.approx(top_vals.tolist(), abs=1e-4)


def greedy_logprobs(runner: ModelRunner, prompt: list[int], new_tokens: int) -> list[float]:
    driver = PlanDriver(runner)
    driver.add("r", prompt, GREEDY_LP, new_tokens)
    driver.run()
    return [lp.logprob for lp in driver.reqs["r"].logprobs]


def test_gemma_sliding_window_is_honoured(tmp_path):
    """With the window longer than any sequence, the tiny Gemma's outputs change: the
    window matters. (A window that long makes the layers full attention: one cache group.)"""
    path = make_tiny_checkpoint("gemma3", str(tmp_path / "g"))
    runner = make_runner(path)
    assert [layer.self_attn.window for layer in runner.model.layers] == [8, 8, None]
    assert runner.model.layer_group == (1, 1, 0) and len(runner.kv.num_blocks) == 2
    windowed = greedy_logprobs(runner, PROMPT, 8)
    wide = make_runner(make_tiny_checkpoint("gemma3", str(tmp_path / "wide"),
                                            overrides={"sliding_window": 100_000}))
    assert wide.model.layer_group == (0, 0, 0) and len(wide.kv.num_blocks) == 1
    unwindowed = greedy_logprobs(wide, PROMPT, 8)
    assert max(abs(a - b) for a, b in zip(windowed, unwindowed)) > 1e-3


def test_gemma_final_softcapping_matches_transformers(tmp_path):
    # (transformers' Gemma 3 never applies attn_logit_softcapping; test_worker_attention
    # checks that path of ours against a dense reference instead.)
    overrides = dict(final_logit_softcapping=3.0)
    path = make_tiny_checkpoint("gemma3", str(tmp_path / "cap"), overrides=overrides)
    ref_tokens, ref_logprobs = hf_greedy(path, PROMPT, 12)
    driver = PlanDriver(make_runner(path))
    driver.add("r", PROMPT, GREEDY_LP, 12)
    assert driver.run()["r"] == ref_tokens
    for step, lp in enumerate(driver.reqs["r"].logprobs):
        assert lp.logprob == pytest.approx(ref_logprobs[step][ref_tokens[step]].item(), abs=1e-4)
