"""The embedded default (Gemma 3 270M Q4_K_M GGUF) against transformers on the same file."""

from __future__ import annotations

import os

import pytest

from pocketllm import LLM, EngineArgs, SamplingParams

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    ",
    "Once upon a time, in a small village by the sea,",
]
STEPS = 24


@pytest.fixture(scope="module")
def default_llm():
    llm = LLM(EngineArgs())
    yield llm
    llm.shutdown()


@pytest.fixture(scope="module")
def hf_gemma(default_model_path):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    model = transformers.AutoModelForCausalLM.from_pretrained(
        os.path.dirname(default_model_path), gguf_file=os.path.basename(default_model_path),
        torch_dtype=torch.float32).eval()
    return model


@pytest.mark.slow
def test_default_model_greedy_matches_transformers(default_llm, hf_gemma):
    import torch

    from pocketllm.tokenizer.tokenizer import load_tokenizer

    tok = load_tokenizer(default_llm.model_info).tokenizer
    sp = SamplingParams(max_tokens=STEPS, temperature=0.0, ignore_eos=True)
    for prompt in PROMPTS:
        ids = tok.encode(prompt).ids
        assert ids[0] == 2  # <bos>, as the GGUF asks
        ours = default_llm.generate(prompt, sp)[0]
        with torch.inference_mode():
            ref = hf_gemma.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids),
                                    dtype=torch.long), max_new_tokens=STEPS,
                                    min_new_tokens=STEPS, do_sample=False)
        assert ours.token_ids == ref[0, len(ids):].tolist(), prompt


@pytest.mark.slow
def test_default_model_chat_stops_at_end_of_turn(default_llm):
    out = default_llm.chat([{"role": "user", "content": "Say hello in one word."}],
                           SamplingParams(max_tokens=64, temperature=0.0))[0]
    assert out.text.strip()
    assert "<end_of_turn>" not in out.text and "<start_of_turn>" not in out.text
    if out.finish_reason == "stop":  # the turn terminator ended it, hidden but counted
        assert out.usage.completion_tokens == len(out.token_ids) + 1
