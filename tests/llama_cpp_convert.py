"""llama.cpp's own HF -> GGUF converter (``convert_hf_to_gguf.py``, which ships in the
llama-cpp-python sdist's ``vendor/llama.cpp``), run on the tiny checkpoints so that the
GGUF loaders are checked against files this project did not write.

Where it lives: ``$POCKETLLM_LLAMA_CPP_DIR`` (a ``vendor/llama.cpp`` directory), else the
directory ``.ci/run`` extracts it to (``~/.cache/pocketllm/llama.cpp``). Without it, the
tests that need it skip and say so.

The tiny checkpoints' tokenizer is trained here, so llama.cpp's table of known
pre-tokenizers (keyed by a hash of how a tokenizer cuts a test text) does not know it;
the conversion names it ``qwen2``. The model tests feed token ids, so that name only
decides how text would be split, never what a model computes.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

DEFAULT_DIR = os.path.expanduser("~/.cache/pocketllm/llama.cpp")

_WRAPPER = """
import sys
root = sys.argv[1]
sys.path[:0] = [root, root + "/gguf-py"]
import conversion.base as base
base.TextModel.get_vocab_base_pre = lambda self, tokenizer: "qwen2"
sys.argv = [root + "/convert_hf_to_gguf.py"] + sys.argv[2:]
import runpy
runpy.run_path(root + "/convert_hf_to_gguf.py", run_name="__main__")
"""


def converter_dir() -> str:
    root = os.environ.get("POCKETLLM_LLAMA_CPP_DIR", DEFAULT_DIR)
    if not os.path.isfile(os.path.join(root, "convert_hf_to_gguf.py")):
        pytest.skip(f"llama.cpp's convert_hf_to_gguf.py is not at {root} "
                    "(set POCKETLLM_LLAMA_CPP_DIR; .ci/run extracts it)")
    return root


def convert(hf_dir: str, out: str, outtype: str = "f32", *extra: str) -> str:
    """``hf_dir`` converted by llama.cpp into ``out`` (``outtype``: f32, f16, bf16, q8_0)."""
    root = converter_dir()
    done = subprocess.run([sys.executable, "-c", _WRAPPER, root, hf_dir, "--outfile", out,
                           "--outtype", outtype, *extra],
                          capture_output=True, text=True, timeout=300)
    if done.returncode != 0:
        raise RuntimeError(f"convert_hf_to_gguf.py failed:\n{done.stderr[-3000:]}")
    return out
