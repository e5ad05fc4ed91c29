"""Loading the CPU kernels' C library (``cpu_quant/``) with ctypes, and nothing else: no torch.

The library is an optional build product (``setup.py``): ``available()`` says whether it
loaded and ``unavailable_reason()`` why not; nothing here raises at import. This is the
library's one binding: the torch-free worker (``workers/lite``), its only user, calls it
through ``lib()`` on numpy buffers, checking shapes where it binds them.

Which OpenMP runtime the library binds: its NEEDED ``libgomp.so.1``, which is torch's own
when torch was imported first (one thread pool, sized by ``torch.set_num_threads``), else
the system's (``OMP_NUM_THREADS``).
"""

from __future__ import annotations

import ctypes
import importlib.machinery
import os
from typing import Optional

from ...errors import UnsupportedFeatureError
from ..loader.gguf_quants import type_name

_HERE = os.path.dirname(os.path.abspath(__file__))
_LIB_STEM = "_cpu_quant"

# ggml type ids the C library knows (decode.h); QUANT_KERNEL_TYPES is the subset built in.
KNOWN_TYPES = (2, 3, 6, 7, 8, 10, 11, 12, 13, 14, 20, 23)

OK, ERR_TYPE, ERR_ARG, ERR_ISA, ERR_NOMEM = 0, -1, -2, -3, -4

_p = ctypes.c_void_p
_i64 = ctypes.c_int64
_int = ctypes.c_int
_f32 = ctypes.c_float
_SIGNATURES = {
    "pq_quantize_act": (_int, [_p, _i64, _i64, _i64, _p, _p, _p, _int]),
    "pq_mul_mat": (_int, [_int, _p, _i64, _i64, _i64, _p, _p, _p, _i64, _p, _i64, _int]),
    "pq_linear": (_int, [_p, _int, _i64, _p, _i64, _i64, _p, _i64, _int]),
    "pq_linear_rows": (_int, [_p, _p, _int, _i64, _p, _i64, _i64, _p, _i64, _int]),
    "pq_gemm_rows": (_i64, [_i64]),
    "pq_dequantize_rows": (_int, [_int, _p, _i64, _i64, _p, _i64, _p, _i64, _int]),
    "pq_has_kernel": (_int, [_int]),
    # ops.c
    "pq_rms_norm": (_int, [_p, _i64, _i64, _i64, _i64, _i64, _p, _i64, _i64, _p, _f32, _p, _p]),
    "pq_rotary": (_int, [_p, _i64, _i64, _i64, _i64, _i64, _p, _p, _i64]),
    "pq_act_and_mul": (_int, [_int, _p, _i64, _i64, _i64, _p]),
    "pq_decode_attention": (_int, [_p, _i64, _i64, _i64, _i64, _i64, _p, _p, _i64, _p, _i64,
                                   _p, _f32, _f32, _p, _int]),
    # gdn.c: Gated DeltaNet
    "pq_gated_delta_step": (_int, [_p, _p, _i64, _p, _i64, _p, _p, _i64, _i64, _i64, _i64, _i64,
                                   _i64, _i64, _p, _p, _p, _int]),
    "pq_gated_delta_prefill": (_int, [_p, _p, _i64, _p, _i64, _p, _p, _i64, _i64, _i64, _i64,
                                      _i64, _i64, _i64, _p, _p, _int]),
    "pq_gdn_mixer": (_int, [_p, _p, _i64, _i64, _p, _p, _p, _p, _p, _int]),
    # layer.c
    "pq_decoder_stack": (_int, [_p, _i64, _p, _p, _p, _i64, _p, _int]),
    "pq_isa": (ctypes.c_char_p, []),
    "pq_set_isa": (_int, [ctypes.c_char_p]),
    "pq_supported_isas": (ctypes.c_char_p, []),
    "pq_all_isas": (ctypes.c_char_p, []),
}


def _find_library() -> Optional[str]:
    for suffix in importlib.machinery.EXTENSION_SUFFIXES:
        path = os.path.join(_HERE, _LIB_STEM + suffix)
        if os.path.exists(path):
            return path
    return None


def _load() -> tuple[Optional[ctypes.CDLL], str]:
    path = _find_library()
    if path is None:
        return None, (f"the C library {_LIB_STEM}*.so is not built in {_HERE} (no C compiler "
                      "at install time? reinstall with one: pip install -e .)")
    try:
        lib = ctypes.CDLL(path)
        for name, (restype, argtypes) in _SIGNATURES.items():
            fn = getattr(lib, name)
            fn.restype, fn.argtypes = restype, argtypes
    except (OSError, AttributeError) as exc:
        return None, f"the C library {path} failed to load: {exc}"
    if not lib.pq_isa():
        forced = os.environ.get("POCKETLLM_CPU_ISA", "")
        return None, (f"POCKETLLM_CPU_ISA={forced!r} names no variant this CPU can run "
                      f"(it can run: {lib.pq_supported_isas().decode()})")
    return lib, ""


_LIB, _REASON = _load()

QUANT_KERNEL_TYPES: frozenset[int] = frozenset(
    t for t in KNOWN_TYPES if _LIB is not None and _LIB.pq_has_kernel(t))


def available() -> bool:
    """The library is built and loaded."""
    return _LIB is not None


def unavailable_reason() -> str:
    """Why ``available()`` is False ('' when it is True)."""
    return _REASON


def lib() -> ctypes.CDLL:
    """The loaded library; refused (``UnsupportedFeatureError``) where it did not load."""
    if _LIB is None:
        raise UnsupportedFeatureError(f"CPU quantized kernels unavailable: {_REASON}")
    return _LIB


class Part(ctypes.Structure):
    """``pq_part`` (cpu_quant.h): one stacked part of a linear layer's weight."""
    _fields_ = [("type", _i64), ("rows", _i64), ("row_bytes", _i64), ("col", _i64), ("w", _p)]


def raise_for(rc: int, ggml_type: Optional[int], what: str) -> None:
    """A library return code as the exception it means (nothing for OK)."""
    if rc == OK:
        return
    if rc == ERR_TYPE:
        raise NotImplementedError(f"no CPU quantized kernel for GGUF type {type_name(ggml_type)}")
    if rc == ERR_ISA:
        raise UnsupportedFeatureError(f"{what}: {_REASON or 'the forced CPU kernel variant cannot run'}")
    if rc == ERR_NOMEM:
        raise MemoryError(f"{what}: scratch allocation failed")
    raise ValueError(f"{what}: the library refused the arguments (code {rc})")

# ctypes mirrors of cpu_quant.h's layer structs (layer.c): a layer's description, a stack
# entry, and a step's views (a KV cache group's slots, one window's gather) and rope tables.
class Linear(ctypes.Structure):
    """``pq_layer_linear``: a projection's bound parts and its bias (or NULL)."""
    _fields_ = [("parts", _p), ("nparts", _i64), ("bias", _p)]


class Experts(ctypes.Structure):
    """``pq_layer_experts``: routed experts in place of the MLP (count 0: none), and a
    shared expert beside them (shared_inter 0: none)."""
    _fields_ = [("count", _i64), ("top_k", _i64), ("renormalize", _i64), ("router", _p),
                ("gate_up", _p), ("down", _p), ("shared_inter", _i64), ("shared_gate", _p),
                ("shared_gate_up", Linear), ("shared_down", Linear)]


class GdnLayer(ctypes.Structure):
    """``pq_layer_gdn``: a Gated DeltaNet token mixer (gdn.c)."""
    _fields_ = ([(name, _i64) for name in ("k_heads", "v_heads", "k_dim", "v_dim", "kernel",
                                           "tiled")]
                + [("eps", _f32)]
                + [(name, _p) for name in ("conv_w", "ba", "a_log", "dt_bias", "norm")]
                + [("in_proj", Linear), ("out", Linear)])


class Layer(ctypes.Structure):
    """``pq_layer``; ``gdn`` (a ``GdnLayer``'s address) replaces attention when set."""
    _fields_ = ([(name, _i64) for name in ("hidden", "heads", "kv_heads", "head_dim", "inter")]
                + [(name, _f32) for name in ("eps", "scale", "softcap")] + [("act", _i64)]
                + [(name, _p) for name in ("attn_norm", "q_norm", "k_norm", "post_attn_norm",
                                           "ff_norm", "post_ff_norm")]
                + [(name, Linear) for name in ("qkv", "o", "gate_up", "down")]
                + [("experts", Experts), ("q_gate", _i64), ("rotary_dim", _i64), ("gdn", _p)])


class StackLayer(ctypes.Structure):
    _fields_ = [("layer", _p), ("k_cache", _p), ("v_cache", _p), ("view", _i64), ("rope", _i64)]


class StepView(ctypes.Structure):
    _fields_ = [("slots", _p), ("gather", _p), ("lengths", _p), ("Lk", _i64), ("snapshots", _p)]


class StepRope(ctypes.Structure):
    _fields_ = [("cos", _p), ("sin", _p), ("lc", _i64)]


# ops.c's PQ_ACT_* by activation form (the forms of ``models.config.ACTIVATION_KINDS``)
ACT_IDS = {"silu": 0, "gelu_tanh": 1, "gelu": 2}

