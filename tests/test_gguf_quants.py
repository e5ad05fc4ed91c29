"""Every dequantizer against gguf-py's reference, on random raw blocks and on real quantized data."""

from __future__ import annotations

import gguf
import numpy as np
import pytest

from pocketllm.workers.loader.gguf_quants import GGML_TYPES, SUPPORTED_TYPES, dequantize

Q = gguf.GGMLQuantizationType
_N_BLOCKS = 257  # odd, so no accidental power-of-two alignment


def _ours(raw: np.ndarray, ggml_type: int) -> np.ndarray:
    with np.errstate(all="ignore"):  # random scales include NaN and inf
        return dequantize(raw.reshape(-1).copy(), ggml_type)


@pytest.mark.parametrize("ggml_type", sorted(SUPPORTED_TYPES - {Q.Q8_K}),
                         ids=lambda t: GGML_TYPES[t][0])
def test_random_blocks_match_reference(ggml_type):
    """Random bytes hit every bit pattern of quants and scales (NaN/inf scales included)."""
    _, block_elems, block_bytes = GGML_TYPES[ggml_type]
    raw = np.random.default_rng(ggml_type).integers(0, 256, _N_BLOCKS * block_bytes, dtype=np.uint8)
    with np.errstate(all="ignore"):
        ref = gguf.quants.dequantize(raw.reshape(-1, block_bytes), Q(ggml_type)).reshape(-1)
    got = _ours(raw, ggml_type)
    assert got.dtype == np.float32 and got.shape == (_N_BLOCKS * block_elems,)
    assert np.array_equal(got, ref.astype(np.float32), equal_nan=True)


@pytest.mark.parametrize("qtype", [Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0, Q.BF16, Q.F16],
                         ids=lambda t: t.name)
def test_quantized_weights_match_reference(qtype):
    """Realistic data: gguf-py quantizes normal weights; both sides dequantize them."""
    w = np.random.default_rng(1).normal(0, 0.02, size=(48, 256)).astype(np.float32)
    raw = gguf.quants.quantize(w, qtype)
    ref = gguf.quants.dequantize(raw, qtype).reshape(-1)
    got = _ours(raw.view(np.uint8), qtype)
    assert np.array_equal(got, ref)
    assert np.abs(got - w.reshape(-1)).max() < 0.1 * np.abs(w).max()


def test_q8_k_by_hand():
    """gguf-py has no Q8_K dequantizer: value = f32 d * int8 q, bsums ignored."""
    rng = np.random.default_rng(2)
    d = rng.normal(size=(_N_BLOCKS, 1)).astype(np.float32)
    q = rng.integers(-128, 128, size=(_N_BLOCKS, 256), dtype=np.int8)
    bsums = rng.integers(-999, 999, size=(_N_BLOCKS, 16), dtype=np.int16)
    raw = np.concatenate([d.view(np.uint8), q.view(np.uint8), bsums.view(np.uint8)], axis=1)
    assert raw.shape[1] == GGML_TYPES[Q.Q8_K][2]
    assert np.array_equal(_ours(raw, Q.Q8_K), (q.astype(np.float32) * d).reshape(-1))


def test_plain_types_are_copies():
    raw = np.arange(16, dtype=np.float32).view(np.uint8)
    out = dequantize(raw, Q.F32)
    out += 1
    assert raw.view(np.float32)[0] == 0  # the source (a read-only file mapping in practice) is untouched


def test_plain_types_at_odd_offsets():
    values = np.array([1.5, -2.0, 3.25], dtype=np.float16)
    buffer = np.concatenate([np.zeros(1, dtype=np.uint8), values.view(np.uint8)])
    assert dequantize(buffer[1:], Q.F16).tolist() == [1.5, -2.0, 3.25]
    bf16 = np.array([1.5, -2.0], dtype=np.float32).view(np.uint16)[1::2].copy()  # high halves
    buffer = np.concatenate([np.zeros(1, dtype=np.uint8), bf16.view(np.uint8)])
    assert dequantize(buffer[1:], Q.BF16).tolist() == [1.5, -2.0]
