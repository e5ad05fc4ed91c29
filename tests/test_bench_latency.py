"""`pocketllm bench latency`: every measured batch-1 run prefills its whole prompt; the
prompt options, the report, and the llama.cpp peer (faked, or skipped without llama_cpp)."""

from __future__ import annotations

import os
import sys
from types import SimpleNamespace

import pytest

from pocketllm import cli
from pocketllm.bench.cli import cmd_bench_latency
from pocketllm.bench import latency, peer_llama_cpp
from pocketllm.bench.latency import (LatencyResult, fresh_prompt, prompt_ids_for, report,
                                     run_pocketllm, synthetic_ids)
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


# --- the prompt, the report and `--peer llama.cpp` (no llama.cpp needed unless said) ---

DUMMY = ["--model", "llama-3-8b", "--load-format", "dummy"]  # a shipped shape: no tokenizer


def latency_args(*extra: str):
    return cli.build_parser().parse_args(["bench", "latency", *extra])


def test_synthetic_prompt_is_fixed_and_skips_special_ids():
    ids = synthetic_ids(40, 100, skip={11, 18})
    assert len(ids) == 40 and ids == synthetic_ids(40, 100, skip={11, 18})
    assert not {11, 18} & set(ids) and all(0 <= t < 100 for t in ids)
    info = SimpleNamespace(tokenizer_path=None, vocab_size=100, bos_token_id=11,
                           eos_token_ids=[18], path="dummy")
    assert prompt_ids_for(info, None, 40) == ids
    assert len(prompt_ids_for(info, None, None)) == latency.DUMMY_PROMPT_LEN


def test_input_len_with_a_tokenizer_repeats_the_text(tmp_path):
    from pocketllm.model_info import load_model_info

    info = load_model_info(EngineArgs(model=make_tiny_checkpoint("llama", str(tmp_path / "m"))))
    text = prompt_ids_for(info, None, None)
    long = prompt_ids_for(info, None, 3 * len(text) + 1)
    assert len(long) == 3 * len(text) + 1 and long[:len(text)] == text
    assert prompt_ids_for(info, None, 2) == text[:2]


def test_prompt_and_input_len_are_refused_together(capsys):
    with pytest.raises(SystemExit):
        latency_args("--prompt", "hi", "--input-len", "8")
    assert "not allowed with argument" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        latency_args("--peer", "vllm")
    ns = latency_args("--peer", "llama.cpp", "--threads", "3", "--input-len", "64")
    assert (ns.peer, ns.threads, ns.input_len, ns.prompt) == ("llama.cpp", 3, 64, None)


def test_prompt_without_a_tokenizer_is_refused():
    with pytest.raises(SystemExit, match="--prompt needs a tokenizer.*--input-len"):
        cmd_bench_latency(latency_args(*DUMMY, "--prompt", "hello"))


def test_llama_cpp_peer_refuses_a_model_that_is_not_a_gguf():
    with pytest.raises(SystemExit, match="--peer llama.cpp runs a GGUF file.*dummy weights"):
        cmd_bench_latency(latency_args(*DUMMY, "--peer", "llama.cpp"))


def test_missing_llama_cpp_says_how_to_install_it(monkeypatch):
    monkeypatch.setitem(sys.modules, "llama_cpp", None)  # makes `import llama_cpp` fail
    with pytest.raises(SystemExit) as e:
        peer_llama_cpp.import_llama_cpp()
    assert "pip install llama-cpp-python" in str(e.value)
    assert 'CMAKE_ARGS="-DGGML_NATIVE=OFF' in str(e.value)


def test_llama_cpp_peer_prefills_each_run_afresh_in_one_batch(monkeypatch):
    """run_llama_cpp against a stand-in for llama_cpp: what it asks of llama.cpp."""
    import ctypes

    made = []

    class FakeLlama:
        def __init__(self, **kw):
            self.kw, self.calls, self.ctx = kw, [], None
            made.append(self)

        def n_vocab(self):
            return 50

        def reset(self):
            self.calls.append("reset")

        def eval(self, tokens):
            self.calls.append(list(tokens))

        def close(self):
            self.calls.append("close")

    logits = (ctypes.c_float * 50)(*[float(i == 7) for i in range(50)])
    fake = SimpleNamespace(Llama=FakeLlama, llama_get_logits_ith=lambda ctx, i: ctypes.cast(
        logits, ctypes.POINTER(ctypes.c_float)))
    monkeypatch.setattr(peer_llama_cpp, "import_llama_cpp", lambda: fake)
    ids = [2, 10, 11, 12]
    result = peer_llama_cpp.run_llama_cpp("m.gguf", ids, 50, output_len=3, runs=2, warmup=1,
                                          threads=3)
    (llm,) = made
    assert llm.kw == dict(model_path="m.gguf", n_threads=3, n_threads_batch=3, n_ctx=4 + 3 + 16,
                          n_batch=4, n_ubatch=4, logits_all=False, verbose=False)
    runs = [["reset", fresh_prompt(ids, i, 50), [7], [7]] for i in range(3)]
    assert llm.calls == [c for run in runs for c in run] + ["close"]
    assert result.name == "llama.cpp" and result.prompt_tokens == 4 and result.runs == 2
    assert result.ttft_s > 0 and result.decode_tps > 0 and result.load_s >= 0


def test_report_has_prefill_threads_and_a_ratio_row():
    ours = LatencyResult("pocketllm", 5.0, 0.100, 20.0, 3, prompt_tokens=25)
    peer = LatencyResult("llama.cpp", 0.5, 0.050, 40.0, 3, prompt_tokens=25)
    text = report([ours, peer], 16, threads=2)
    lines = text.splitlines()
    assert lines[0].endswith("; CPU threads: 2")
    assert lines[1].split() == ["engine", "load", "s", "TTFT", "ms", "prefill", "tok/s",
                                "decode", "tok/s"]
    assert lines[2].split() == ["pocketllm", "5.00", "100.0", "250.0", "20.0"]
    assert lines[3].split() == ["llama.cpp", "0.50", "50.0", "500.0", "40.0"]
    assert lines[4].split() == ["pocketllm/llama.cpp", "10.00x", "2.00x", "0.50x", "0.50x"]


def test_the_command_runs_both_engines_on_one_prompt_and_thread_count(monkeypatch, capsys,
                                                                    default_model_path):
    """The wiring of `--peer llama.cpp --threads`, with both engines faked."""
    seen = {}

    def fake_ours(args, prompt_ids, prompt, output_len, runs, warmup, batches, input_len):
        seen["threads_env"] = os.environ.get("POCKETLLM_NUM_THREADS")
        ids = list(range(2, 2 + input_len))
        return LatencyResult("pocketllm", 5.0, 0.1, 20.0, runs, device="cpu",
                             prompt_tokens=len(ids)), ids

    def fake_peer(path, prompt_ids, vocab_size, output_len, runs, warmup, threads):
        seen.update(path=path, ids=prompt_ids, threads=threads, output_len=output_len)
        return LatencyResult("llama.cpp", 0.5, 0.05, 40.0, runs, prompt_tokens=len(prompt_ids))

    monkeypatch.setenv("POCKETLLM_NUM_THREADS", "")
    monkeypatch.setattr(latency, "run_pocketllm", fake_ours)
    monkeypatch.setattr(latency, "roofline", lambda result: "roofline: -")
    monkeypatch.setattr(peer_llama_cpp, "import_llama_cpp", lambda: None)
    monkeypatch.setattr(peer_llama_cpp, "run_llama_cpp", fake_peer)
    assert cli.main(["bench", "latency", "--peer", "llama.cpp", "--threads", "3",
                     "--input-len", "12", "--output-len", "16"]) == 0
    assert seen == dict(threads_env="3", path=default_model_path, ids=list(range(2, 14)),
                        threads=3, output_len=16)
    out = capsys.readouterr().out
    assert "prompt: 12 tokens" in out and "CPU threads: 3" in out
    assert "pocketllm/llama.cpp" in out


@pytest.mark.slow
def test_llama_cpp_end_to_end_on_the_embedded_default(capsys, default_model_path):
    pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed")
    assert cli.main(["bench", "latency", "--peer", "llama.cpp", "--output-len", "4",
                     "--runs", "1", "--warmup", "0"]) == 0
    lines = capsys.readouterr().out.splitlines()
    peer = next(line for line in lines if line.startswith("llama.cpp "))
    load_s, ttft_ms, prefill, decode = map(float, peer.split()[1:])
    assert load_s > 0 and ttft_ms > 0 and prefill > 0 and decode > 0
    assert any(line.startswith("pocketllm/llama.cpp ") for line in lines)


def test_a_replay_without_a_method_takes_the_draft_count(monkeypatch, capsys):
    """`--speculative-replay full --num-speculative-tokens 2` with no
    `--speculative-method`: the replay drafter's engine drafts 2 a step, and the engine
    without speculation is not handed a draft count it would refuse."""
    engines = []

    def fake_ours(args, prompt_ids, prompt, output_len, runs, warmup, batches=(),
                  input_len=None, record=None):
        engines.append((args.speculative_method, args.num_speculative_tokens))
        ids = list(range(2, 14))
        if record is not None:
            record.append((ids, list(range(20, 20 + output_len))))
        return LatencyResult("pocketllm", 5.0, 0.1, 20.0, runs, device="cpu",
                             prompt_tokens=len(ids)), ids

    monkeypatch.setattr(latency, "run_pocketllm", fake_ours)
    monkeypatch.setattr(latency, "roofline", lambda result: "roofline: -")
    assert cli.main(["bench", "latency", *DUMMY, "--speculative-replay", "full",
                     "--num-speculative-tokens", "2", "--input-len", "12",
                     "--output-len", "16"]) == 0
    assert engines == [(None, None), ("replay", 2)]
    assert "k = 2" in capsys.readouterr().out
