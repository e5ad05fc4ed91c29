"""The CPU quantized kernels (workers/kernels/cpu_quant, bound by cpu_lib): every GGUF block
type with a decoder, on every SIMD variant this CPU runs, against the loader's numpy
dequantization.

Weights are random blocks with sane fp16 scale fields. Products are checked twice: tightly
against float64 ``xq @ W^T`` where xq = q * d are the activations the kernel really
multiplies (only float32 rounding of the accumulation separates them), and loosely against
the float activations, within the bound 16-bit quantization allows (|x - xq| <= ~d/2 per
element, so the error is at most (d * STEP_BOUND) @ |W|^T).
"""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest

import cpu_lib_calls as cl
from pocketllm.workers.kernels import cpu_lib
from pocketllm.workers.loader.gguf_quants import GGML_TYPES, dequantize

pytestmark = pytest.mark.skipif(not cpu_lib.available(),
                                reason=f"CPU kernels: {cpu_lib.unavailable_reason()}")

# byte offsets of the fp16 scale fields of each block type (ggml-common.h): (d fields, dmin fields)
_F16_FIELDS = {
    2: ((0,), ()), 3: ((0,), (2,)), 6: ((0,), ()), 7: ((0,), (2,)), 8: ((0,), ()),
    10: ((80,), (82,)), 11: ((108,), ()), 12: ((0,), (2,)), 13: ((0,), (2,)), 14: ((208,), ()),
    20: ((0,), ()), 23: ((0,), ()),
}
TYPES = sorted(_F16_FIELDS)
WITH_KERNEL = sorted(cpu_lib.QUANT_KERNEL_TYPES)


def random_blocks(ggml_type: int, rows: int, k: int, seed: int) -> np.ndarray:
    """uint8 [rows, row bytes]: random bytes, fp16 scales d in [1e-3, 1e-2] (dmin too, sign random)."""
    _, elems, nbytes = GGML_TYPES[ggml_type]
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, size=(rows, k // elems, nbytes), dtype=np.uint8)
    d_fields, dmin_fields = _F16_FIELDS[ggml_type]
    for at in d_fields + dmin_fields:
        v = rng.uniform(1e-3, 1e-2, size=(rows, k // elems)) * rng.choice([-1, 1], size=(rows, k // elems))
        raw[:, :, at:at + 2] = v.astype(np.float16).view(np.uint8).reshape(rows, k // elems, 2)
    return raw.reshape(rows, -1)


def reference(ggml_type: int, w: np.ndarray, k: int) -> np.ndarray:
    return dequantize(np.ascontiguousarray(w).reshape(-1), ggml_type).reshape(-1, k)


def randn(rng: np.random.Generator, m: int, k: int) -> np.ndarray:
    """Rows of different scales."""
    return (rng.standard_normal((m, k)) * rng.uniform(0, 4, (m, 1))).astype(np.float32)


def valid_ks(ggml_type: int) -> list[int]:
    elems = GGML_TYPES[ggml_type][1]
    return [k for k in (256, 640, 2048) if k % elems == 0]


CASES = [(t, k) for t in WITH_KERNEL for k in valid_ks(t)]
# |x - q * d| per element, in steps d: half a step, plus float32's rounding of the
# reciprocal 32767 / amax, of x times it and of q * d, each up to 32767 * 2^-24 (~0.002) of
# a step (300 random seeds reached 0.5038)
STEP_BOUND = 0.51


def test_default_model_types_have_kernels():
    assert {6, 8, 12, 14} <= cpu_lib.QUANT_KERNEL_TYPES  # Q5_0, Q8_0, Q4_K, Q6_K: Gemma 3 270M Q4_K_M
    assert cl.isa() in cl.supported_isas() and cl.supported_isas()[-1] == "scalar"


@pytest.mark.parametrize("ggml_type,k", CASES)
def test_dequantize_rows_bit_exact(ggml_type, k):
    w = random_blocks(ggml_type, 29, k, seed=ggml_type * 7 + k)
    ref = reference(ggml_type, w, k)
    ids = np.array([28, 0, 5, 5, 17])
    wide = np.full((5, k + 9), np.nan, np.float32)
    out = cl.dequantize_rows(ggml_type, w, k, ids, wide[:, 4:4 + k])
    assert np.array_equal(out, ref[ids])
    assert np.isnan(wide[:, :4]).all() and np.isnan(wide[:, 4 + k:]).all()


_SPECIAL_F16 = np.array([0.0, -0.0, 6e-8, -6e-8, 3e-5, 65504, -65504, np.inf, -np.inf, np.nan,
                         1e-3, -2.5], dtype=np.float16)


@pytest.mark.parametrize("ggml_type", WITH_KERNEL)
def test_dequantize_rows_special_scales(ggml_type):
    """Zero, subnormal, huge, inf and nan fp16 scale fields: the same bits as the reference
    (signed zeros included) wherever it is not nan, nan where it is. A nan's sign may differ:
    types with a min store offset = -(dmin * m) and add it, the reference subtracts."""
    _, elems, nbytes = GGML_TYPES[ggml_type]
    k, rows = 2048, 12
    rng = np.random.default_rng(ggml_type)
    raw = rng.integers(0, 256, size=(rows, k // elems, nbytes), dtype=np.uint8)
    for at in sum(_F16_FIELDS[ggml_type], ()):
        raw[:, :, at:at + 2] = rng.choice(_SPECIAL_F16, size=(rows, k // elems, 1)).view(np.uint8)
    w = raw.reshape(rows, -1)
    with np.errstate(invalid="ignore", over="ignore"):
        ref = reference(ggml_type, w, k)
    out = cl.dequantize_rows(ggml_type, w, k, np.arange(rows))
    nan = np.isnan(ref)
    assert np.array_equal(np.isnan(out), nan)
    assert np.array_equal(out.view(np.int32)[~nan], ref.view(np.int32)[~nan])


@pytest.mark.parametrize("ggml_type,k", CASES)
def test_mul_mat_matches_reference_on_every_variant(ggml_type, k):
    n = 37  # odd, and not a multiple of the 16-row thread chunks
    w = random_blocks(ggml_type, n, k, seed=ggml_type * 13 + k)
    wf = reference(ggml_type, w, k).astype(np.float64)
    rng = np.random.default_rng(k)
    for m in (1, 3, 17, 64):
        x = randn(rng, m, k)
        act = cl.quantize(x)
        xq = cl.dequantized_act(act[0], act[1])
        exact = xq @ wf.T
        tight = 1e-5 * (np.abs(xq) @ np.abs(wf).T) + 1e-30
        quant_bound = (np.repeat(act[1].astype(np.float64), 32, axis=1) * STEP_BOUND) @ np.abs(wf).T
        results = {}
        for isa in cl.supported_isas():
            with cl.forcing_isa(isa):
                out = cl.mul_mat(ggml_type, w, k, act).astype(np.float64)
            err = np.abs(out - exact)
            assert (err <= tight).all(), (isa, m, float((err / tight).max()))
            assert (np.abs(out - x.astype(np.float64) @ wf.T) <= quant_bound + tight).all(), (isa, m)
            results[isa] = out
        for isa, out in results.items():  # the variants agree with the portable one
            assert (np.abs(out - results["scalar"]) <= 2 * tight).all(), isa


@pytest.mark.parametrize("ggml_type,k", CASES)
def test_many_row_product_matches_reference_on_every_variant(ggml_type, k):
    """The prompt's product (gemm_i16.c: activations packed by 16-row panels, weight rows
    decoded to int16 a tile of 4 at a time): the same exact integer sums per block as the
    row dots, so within float32 rounding of float64 ``xq @ W^T`` and of the row dots, on
    every variant. Two parts at column offsets inside a NaN-fenced output; row counts
    around the panels (a half panel up to 8 rows), part sizes off the tiles; thread
    counts. Forced at every row count here; pq_linear takes it from ``pq_gemm_rows``."""
    rows = (37, 21)
    ws = [random_blocks(ggml_type, n, k, seed=ggml_type * 7 + n) for n in rows]
    wf = np.concatenate([reference(ggml_type, w, k).astype(np.float64) for w in ws])
    parts = [(ggml_type, ws[0], 2), (ggml_type, ws[1], 2 + rows[0])]
    rng = np.random.default_rng(k)
    for m, threads in ((1, 0), (5, 2), (16, 1), (17, 2), (24, 0), (70, 3)):
        x = randn(rng, m, k)
        xq = cl.dequantized_act(*cl.quantize(x)[:2])
        exact = xq @ wf.T
        tight = 1e-5 * (np.abs(xq) @ np.abs(wf).T) + 1e-30
        for isa in cl.supported_isas():
            with cl.forcing_isa(isa):
                wide = np.full((m, sum(rows) + 5), np.nan, np.float32)
                with cl.forcing_gemm_rows(1):
                    cl.linear(k, parts, x, wide, threads)
                with cl.forcing_gemm_rows(1 << 40):  # the row dots, for comparison
                    dots = cl.linear(k, parts, x, np.empty((m, sum(rows) + 5), np.float32), threads)
            out = wide[:, 2:2 + sum(rows)].astype(np.float64)
            assert np.isnan(wide[:, :2]).all() and np.isnan(wide[:, 2 + sum(rows):]).all(), isa
            err = np.abs(out - exact)
            assert (err <= tight).all(), (isa, m, float((err / tight).max()))
            assert (np.abs(out - dots[:, 2:2 + sum(rows)]) <= 2 * tight).all(), (isa, m)


def test_linear_of_mixed_types_is_the_per_part_products():
    """One call for parts of three types at their columns: below ``pq_gemm_rows`` rows
    (the row dots) bit for bit each part's own product; from there (the many-row product)
    within float32 rounding of it; nothing written past the last part."""
    k = 512
    parts = [(8, random_blocks(8, 40, k, 1), 0), (12, random_blocks(12, 23, k, 2), 40),
             (6, random_blocks(6, 17, k, 3), 63)]
    rng = np.random.default_rng(4)
    for m in (1, 3, cl.gemm_rows(), 40):
        x = randn(rng, m, k)
        act = cl.quantize(x)
        want = np.concatenate([cl.mul_mat(t, w, k, act) for t, w, _ in parts], axis=1)
        wide = np.full((m, 90), np.nan, np.float32)
        cl.linear(k, parts, x, wide)
        assert np.isnan(wide[:, 80:]).all()
        if m < cl.gemm_rows():
            assert np.array_equal(wide[:, :80], want), m
        else:
            np.testing.assert_allclose(wide[:, :80], want, rtol=1e-5, atol=1e-5 * np.abs(want).max())


def test_row_strided_weights_and_thread_counts():
    k, n = 640, 50
    w_wide = random_blocks(8, n, 2 * k, seed=3)  # rows twice as long: a row-strided view of the first half
    w = w_wide[:, : k // 32 * 34]
    act = cl.quantize(np.random.default_rng(0).standard_normal((2, k)).astype(np.float32))
    ref = cl.mul_mat(8, np.ascontiguousarray(w), k, act, threads=1)
    for threads in (1, 2, 3):
        assert np.array_equal(cl.mul_mat(8, w, k, act, threads=threads), ref)


def test_linear_rows_multiplies_each_part_with_its_own_rows():
    """Each part on its own run of x's rows, into those rows of out at the part's column:
    the same values as the whole-matrix product of those rows alone (a row's arithmetic
    does not depend on the rows beside it, but for a lone Q8_0 row's block order), on
    every variant; bad runs and part counts refused."""
    k = 512
    types = (12, 14, 8, 2)  # Q4_K, Q6_K, Q8_0, Q4_0: the fused and the decode-buffer paths
    weights = [random_blocks(t, 24, k, seed=t) for t in types]
    x = np.random.default_rng(1).standard_normal((8, k)).astype(np.float32)
    # (weight, first row, rows, column)
    runs = [(0, 2, 1, 0), (1, 2, 1, 24), (2, 0, 2, 0), (3, 4, 3, 0), (0, 4, 3, 24), (1, 7, 1, 0)]
    parts = [(types[j], weights[j], col) for j, _, _, col in runs]
    ranges = [(first, n) for _, first, n, _ in runs]
    for isa in cl.supported_isas():
        with cl.forcing_isa(isa):
            out = np.full((8, 48), np.nan, np.float32)
            assert cl.linear_rows(k, parts, ranges, x, out) == cpu_lib.OK
            for j, first, n, col in runs:
                alone = cl.mul_mat(types[j], weights[j], k, cl.quantize(x[first:first + n]))
                assert np.array_equal(out[first:first + n, col:col + 24], alone), (isa, j, first)
            assert np.isnan(out[0:2, 24:]).all() and np.isnan(out[3]).all() and np.isnan(out[7, 24:]).all()
    out = np.empty((8, 48), np.float32)
    assert cl.linear_rows(k, parts[:1], [(7, 2)], x, out) == cpu_lib.ERR_ARG  # past the rows
    assert cl.linear_rows(k, parts[:1], [(0, 0)], x, out) == cpu_lib.ERR_ARG  # an empty run
    assert cl.linear_rows(k, parts[:1] * 129, [(0, 1)] * 129, x, out) == cpu_lib.ERR_ARG
    assert cl.linear_rows(k, parts[:2], [(0, 1), (1, 1)], x, np.empty((8, 40), np.float32)
                          ) == cpu_lib.ERR_ARG  # out narrower than the parts' columns


def test_quantize_activations_scheme():
    x = np.random.default_rng(5).standard_normal((5, 96)).astype(np.float32) * 3
    x[2, 32:64] = 0.0  # an all-zero block: d = 0, q = 0
    q, d, gsum = cl.quantize(x)
    blocks = x.reshape(5, 3, 32)
    np.testing.assert_allclose(d, np.abs(blocks).max(-1) / 32767, rtol=1e-6, atol=0)
    assert np.abs(q).max() == 32767 and (q[2, 32:64] == 0).all() and d[2, 1] == 0
    assert np.array_equal(gsum, q.reshape(5, 6, 16).sum(-1, dtype=np.int32))
    err = np.abs(cl.dequantized_act(q, d) - x)
    assert (err <= np.repeat(d.astype(np.float64), 32, axis=1) * STEP_BOUND + 1e-12).all()


@pytest.mark.parametrize("ggml_type", [t for t in TYPES if t not in cpu_lib.QUANT_KERNEL_TYPES] or [1])
def test_types_without_kernel_are_refused(ggml_type):
    k = 256
    w = (random_blocks(ggml_type, 2, k, 0) if ggml_type in _F16_FIELDS
         else np.zeros((2, 2 * k), np.uint8))
    act = cl.quantize(np.ones((1, k), np.float32))
    name = GGML_TYPES[ggml_type][0]
    with pytest.raises(NotImplementedError, match=name):
        cl.mul_mat(ggml_type, w, k, act)
    with pytest.raises(NotImplementedError, match=name):
        cl.dequantize_rows(ggml_type, w, k, np.array([0]))


def test_bad_arguments_are_refused():
    """The library's own checks: a size or stride out of range is ERR_ARG, raised as a
    ValueError, never computed."""
    k = 640
    w = random_blocks(8, 4, k, 1)
    x = np.ones((2, k), np.float32)
    act = cl.quantize(x)
    with pytest.raises(ValueError, match="refused the arguments"):
        cl.quantize(np.ones((2, 48), np.float32))  # K not a multiple of 32
    with pytest.raises(ValueError, match="refused the arguments"):
        cl.mul_mat(8, np.ascontiguousarray(w[:, :-34]), k, act)  # rows short of K
    with pytest.raises(ValueError, match="refused the arguments"):
        cl.mul_mat(12, random_blocks(12, 1, 256, 0), 640, act)  # K not a multiple of Q4_K's
    with pytest.raises(ValueError, match="refused the arguments"):
        cl.linear(k, [(8, w, 1)], x, np.empty((2, 4), np.float32))  # columns past out


def test_forcing_a_variant_the_cpu_lacks_is_refused():
    lib, before = cl.lib(), cl.isa()
    assert lib.pq_set_isa(b"not-an-isa") == cpu_lib.ERR_ISA
    for name in set(cl.all_isas()) - set(cl.supported_isas()):
        assert lib.pq_set_isa(name.encode()) == cpu_lib.ERR_ISA, name
    assert cl.isa() == before
    with cl.forcing_isa("scalar"):
        assert cl.isa() == "scalar"
    assert cl.isa() == before


def _in_subprocess(code: str, **env: str) -> str:
    full = {**os.environ, **env}
    run = subprocess.run([sys.executable, "-c", code], env=full, capture_output=True, text=True,
                         timeout=120, cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert run.returncode == 0, run.stderr
    return run.stdout.strip()


def test_environment_forces_a_variant_and_one_openmp_runtime_is_loaded():
    code = ("import torch; from pocketllm.workers.kernels import cpu_lib; "
            "maps = open('/proc/self/maps').read().splitlines(); "
            "gomp = {l.split()[-1] for l in maps if 'libgomp' in l}; "
            "ok = cpu_lib.available(); "
            "print(ok, ok and cpu_lib.lib().pq_isa().decode(), len(gomp), cpu_lib.unavailable_reason())")
    assert _in_subprocess(code, POCKETLLM_CPU_ISA="scalar").split()[:3] == ["True", "scalar", "1"]
    out = _in_subprocess(code, POCKETLLM_CPU_ISA="bogus")
    assert out.startswith("False False") and "POCKETLLM_CPU_ISA='bogus'" in out
