"""Loads the Triton kernel modules for the kernel tests: compiled on a CUDA machine,
under Triton's CPU interpreter otherwise.

Triton decides interpreter-or-compiler when a kernel is defined, i.e. when its
module is imported -- triton.language's own helpers included -- and reads the
variable again when it lazily imports more of itself at a launch, so without CUDA
TRITON_INTERPRET=1 is set before triton's first import and stays set for the test
process. (Engine processes that other tests start inherit it; harmless: the worker
takes the Triton path on CUDA only.)
"""

from __future__ import annotations

import importlib
import os
import sys
import types

import pytest

MODULES = ("kv_fp8", "kv_write", "paged_decode_attention", "prefill_attention", "rmsnorm", "rotary",
           "gated_act", "gemv", "attention_backend", "bi_matmul", "fused_moe", "moe_gemv", "pdl",
           "gated_delta_decode", "gguf_gemv", "gguf_dot")


def load_kernels() -> tuple[types.SimpleNamespace, "object"]:
    """(namespace of the kernel modules, the torch device their tests use)."""
    torch = pytest.importorskip("torch")
    cuda = torch.cuda.is_available()
    interpreting = os.environ.get("TRITON_INTERPRET") == "1"
    if not cuda and "triton.language" in sys.modules and not interpreting:
        raise RuntimeError("triton was imported before the kernel tests could turn on its "
                           "interpreter; import kernel_modules first")
    if not cuda:
        os.environ["TRITON_INTERPRET"] = "1"
    pytest.importorskip("triton")
    pytest.importorskip("triton.language")
    mods = {name: importlib.import_module(f"pocketllm.workers.kernels.{name}") for name in MODULES}
    return types.SimpleNamespace(**mods), torch.device("cuda" if cuda else "cpu")


def compiled_only(*values, reason: str):
    """``pytest.param(*values)`` that runs where the kernels compile (CUDA) and skips under
    the interpreter: a case whose kernels another interpreted case already runs, and that
    costs minutes there (docs/testing.md, "What the CPU suite leaves to the GPU")."""
    import torch

    return pytest.param(*values, marks=pytest.mark.skipif(
        not torch.cuda.is_available(), reason=f"compiled only: {reason}"))

