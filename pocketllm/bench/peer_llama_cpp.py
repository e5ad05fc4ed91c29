"""The llama.cpp peer for `bench latency --peer llama.cpp`, through llama-cpp-python.

Same GGUF file, same prompt ids (one token changed per run, as for PocketLLM), same CPU
thread count, the prompt prefilled in one batch, greedy. llama-cpp-python is an optional
dependency, imported only here and only when this peer is asked for.
"""

from __future__ import annotations

import contextlib
import os
import statistics
import sys
import time

from ..model_info import ModelInfo
from .latency import LatencyResult, fresh_prompt

INSTALL_HINT = (
    "--peer llama.cpp needs llama-cpp-python: pip install llama-cpp-python. On some VMs "
    "its default native build crashes; this build works there: "
    'CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON '
    '-DGGML_AVX512=ON -DGGML_AVX_VNNI=ON" pip install llama-cpp-python')


def import_llama_cpp():
    try:
        import llama_cpp
    except ImportError as e:
        raise SystemExit(f"{INSTALL_HINT}\n(import llama_cpp failed: {e})") from None
    return llama_cpp


def gguf_path(info: ModelInfo, load_format: str) -> str:
    """The GGUF file llama.cpp loads: the very file PocketLLM serves, nothing else."""
    if info.format != "gguf" or load_format == "dummy":
        what = "dummy weights" if info.format == "dummy" else f"a {info.format} checkpoint"
        raise SystemExit(f"--peer llama.cpp runs a GGUF file, and {info.path!r} is {what}; "
                         "pass --model FILE.gguf (or no --model: the embedded default)")
    return info.path


@contextlib.contextmanager
def quiet_stderr():
    """llama.cpp's native code logs to file descriptor 2; send that to /dev/null."""
    sys.stderr.flush()
    saved = os.dup(2)
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, 2)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(devnull)


def run_llama_cpp(path: str, prompt_ids: list[int], vocab_size: int, output_len: int,
                  runs: int, warmup: int, threads: int) -> LatencyResult:
    import numpy as np

    llama_cpp = import_llama_cpp()
    n_prompt = len(prompt_ids)
    with quiet_stderr():
        t0 = time.perf_counter()
        llm = llama_cpp.Llama(model_path=path, n_threads=threads, n_threads_batch=threads,
                              n_ctx=n_prompt + output_len + 16, n_batch=n_prompt,
                              n_ubatch=n_prompt, logits_all=False, verbose=False)
        load_s = time.perf_counter() - t0
        n_vocab = llm.n_vocab()

        def greedy() -> int:  # argmax of the last evaluated token's logits
            logits = llama_cpp.llama_get_logits_ith(llm.ctx, -1)
            return int(np.ctypeslib.as_array(logits, shape=(n_vocab,)).argmax())

        ttfts, tps = [], []
        try:
            for i in range(warmup + runs):
                ids = fresh_prompt(prompt_ids, i, vocab_size)
                llm.reset()  # the next eval drops the whole KV cache: a fresh prefill
                start = time.perf_counter()
                llm.eval(ids)
                token = greedy()
                first = time.perf_counter()
                for _ in range(output_len - 1):
                    llm.eval([token])
                    token = greedy()
                end = time.perf_counter()
                if i >= warmup and output_len > 1:
                    ttfts.append(first - start)
                    tps.append((output_len - 1) / (end - first))
        finally:
            llm.close()
    return LatencyResult("llama.cpp", load_s, statistics.median(ttfts), statistics.median(tps),
                         runs, device="cpu", prompt_tokens=n_prompt)
