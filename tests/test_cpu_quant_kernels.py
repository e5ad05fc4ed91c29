"""The CPU quantized kernels (workers/kernels/cpu_quant): every GGUF block type with a
decoder, on every SIMD variant this CPU runs, against the loader's numpy dequantization.

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
import torch

from pocketllm.errors import UnsupportedFeatureError
from pocketllm.workers.kernels import cpu_quant as cq
from pocketllm.workers.loader.gguf_quants import GGML_TYPES, dequantize

pytestmark = pytest.mark.skipif(not cq.available(), reason=f"CPU kernels: {cq.unavailable_reason()}")

# byte offsets of the fp16 scale fields of each block type (ggml-common.h): (d fields, dmin fields)
_F16_FIELDS = {
    2: ((0,), ()), 3: ((0,), (2,)), 6: ((0,), ()), 7: ((0,), (2,)), 8: ((0,), ()),
    10: ((80,), (82,)), 11: ((108,), ()), 12: ((0,), (2,)), 13: ((0,), (2,)), 14: ((208,), ()),
    20: ((0,), ()), 23: ((0,), ()),
}
TYPES = sorted(_F16_FIELDS)
WITH_KERNEL = sorted(cq.QUANT_KERNEL_TYPES)


def random_blocks(ggml_type: int, rows: int, k: int, seed: int) -> torch.Tensor:
    """uint8 [rows, row bytes]: random bytes, fp16 scales d in [1e-3, 1e-2] (dmin too, sign random)."""
    _, elems, nbytes = GGML_TYPES[ggml_type]
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, size=(rows, k // elems, nbytes), dtype=np.uint8)
    d_fields, dmin_fields = _F16_FIELDS[ggml_type]
    for at in d_fields + dmin_fields:
        v = rng.uniform(1e-3, 1e-2, size=(rows, k // elems)) * rng.choice([-1, 1], size=(rows, k // elems))
        raw[:, :, at:at + 2] = v.astype(np.float16).view(np.uint8).reshape(rows, k // elems, 2)
    return torch.from_numpy(raw.reshape(rows, -1))


def reference(ggml_type: int, w: torch.Tensor, k: int) -> torch.Tensor:
    return torch.from_numpy(dequantize(w.contiguous().numpy().reshape(-1), ggml_type).reshape(-1, k))


def valid_ks(ggml_type: int) -> list[int]:
    elems = GGML_TYPES[ggml_type][1]
    return [k for k in (256, 640, 2048) if k % elems == 0]


CASES = [(t, k) for t in WITH_KERNEL for k in valid_ks(t)]
# |x - q * d| per element, in steps d: half a step, plus float32's rounding of the
# reciprocal 32767 / amax, of x times it and of q * d, each up to 32767 * 2^-24 (~0.002) of
# a step (300 random seeds reached 0.5038)
STEP_BOUND = 0.51


def test_default_model_types_have_kernels():
    assert {6, 8, 12, 14} <= cq.QUANT_KERNEL_TYPES  # Q5_0, Q8_0, Q4_K, Q6_K: Gemma 3 270M Q4_K_M
    assert cq.isa() in cq.supported_isas() and cq.supported_isas()[-1] == "scalar"


@pytest.mark.parametrize("ggml_type,k", CASES)
def test_dequantize_rows_bit_exact(ggml_type, k):
    w = random_blocks(ggml_type, 29, k, seed=ggml_type * 7 + k)
    ref = reference(ggml_type, w, k)
    ids = torch.tensor([28, 0, 5, 5, 17], dtype=torch.int64)
    wide = torch.full((5, k + 9), float("nan"))
    out = cq.dequantize_rows(ggml_type, w, k, ids, wide[:, 4:4 + k])
    assert torch.equal(out, ref[ids])
    assert wide[:, :4].isnan().all() and wide[:, 4 + k:].isnan().all()


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
    w = torch.from_numpy(raw.reshape(rows, -1))
    with np.errstate(invalid="ignore", over="ignore"):
        ref = reference(ggml_type, w, k)
    out = cq.dequantize_rows(ggml_type, w, k, torch.arange(rows), torch.empty(rows, k))
    nan = ref.isnan()
    assert torch.equal(out.isnan(), nan)
    assert torch.equal(out.view(torch.int32)[~nan], ref.view(torch.int32)[~nan])


@pytest.mark.parametrize("ggml_type,k", CASES)
def test_mul_mat_matches_reference_on_every_variant(ggml_type, k):
    n = 37  # odd, and not a multiple of the 16-row thread chunks
    w = random_blocks(ggml_type, n, k, seed=ggml_type * 13 + k)
    wf = reference(ggml_type, w, k).double()
    g = torch.Generator().manual_seed(k)
    for m in (1, 3, 17, 64):
        x = torch.randn(m, k, generator=g) * torch.rand(m, 1, generator=g) * 4
        act = cq.quantize_activations(x)
        xq = act.q.double() * act.d.double().repeat_interleave(32, dim=1)
        exact = xq @ wf.T
        tight = 1e-5 * (xq.abs() @ wf.abs().T) + 1e-30
        quant_bound = (act.d.double().repeat_interleave(32, dim=1) * STEP_BOUND) @ wf.abs().T
        results = {}
        for isa in cq.supported_isas():
            with cq.forcing_isa(isa):
                wide = torch.full((m, n + 7), float("nan"))
                out = cq.mul_mat(ggml_type, w, k, act, wide[:, 3:3 + n])
            assert wide[:, :3].isnan().all() and wide[:, 3 + n:].isnan().all(), isa
            err = (out.double() - exact).abs()
            assert (err <= tight).all(), (isa, m, float((err / tight).max()))
            assert ((out.double() - x.double() @ wf.T).abs() <= quant_bound + tight).all(), (isa, m)
            results[isa] = out.clone()
        base = results["scalar"].double()
        for isa, out in results.items():  # the variants agree with the portable one
            assert ((out.double() - base).abs() <= 2 * tight).all(), isa


@pytest.mark.parametrize("ggml_type,k", CASES)
def test_many_row_product_matches_reference_on_every_variant(ggml_type, k):
    """The prompt's product (gemm_i16.c: activations packed by 16-row panels, weight rows
    decoded to int16 a tile of 4 at a time): the same exact integer sums per block as the
    row dots, so within float32 rounding of float64 ``xq @ W^T`` and of the row dots, on
    every variant. Two parts at column offsets inside a NaN-fenced output; row counts
    around the panels (a half panel up to 8 rows), part sizes off the tiles; thread
    counts. Forced at every row count here; pq_linear takes it from ``gemm_rows()``."""
    rows = (37, 21)
    ws = [random_blocks(ggml_type, n, k, seed=ggml_type * 7 + n) for n in rows]
    wf = torch.cat([reference(ggml_type, w, k).double() for w in ws])
    g = torch.Generator().manual_seed(k)
    for m, threads in ((1, 0), (5, 2), (16, 1), (17, 2), (24, 0), (70, 3)):
        x = torch.randn(m, k, generator=g) * torch.rand(m, 1, generator=g) * 4
        act = cq.quantize_activations(x)
        xq = act.q.double() * act.d.double().repeat_interleave(32, dim=1)
        exact = xq @ wf.T
        tight = 1e-5 * (xq.abs() @ wf.abs().T) + 1e-30
        for isa in cq.supported_isas():
            with cq.forcing_isa(isa):
                linear = cq.BlockLinear(k, [(ggml_type, ws[0], 2), (ggml_type, ws[1], 2 + rows[0])])
                wide = torch.full((m, sum(rows) + 5), float("nan"))
                with cq.forcing_gemm_rows(1):
                    linear(x, wide, threads=threads)
                with cq.forcing_gemm_rows(1 << 40):  # the row dots, for comparison
                    dots = linear(x, torch.empty(m, sum(rows) + 5), threads=threads)
            out = wide[:, 2:2 + sum(rows)]
            assert wide[:, :2].isnan().all() and wide[:, 2 + sum(rows):].isnan().all(), isa
            err = (out.double() - exact).abs()
            assert (err <= tight).all(), (isa, m, float((err / tight).max()))
            assert ((out.double() - dots[:, 2:2 + sum(rows)].double()).abs() <= 2 * tight).all(), (isa, m)


def test_row_strided_weights_and_thread_counts():
    k, n = 640, 50
    w_wide = random_blocks(8, n, 2 * k, seed=3)  # rows twice as long: a row-strided view of the first half
    w = w_wide[:, : k // 32 * 34]
    act = cq.quantize_activations(torch.randn(2, k))
    ref = cq.mul_mat(8, w.contiguous(), k, act, torch.empty(2, n), threads=1)
    for threads in (1, 2, 3):
        assert torch.allclose(cq.mul_mat(8, w, k, act, torch.empty(2, n), threads=threads), ref,
                              rtol=0, atol=0)


def test_linear_rows_multiplies_each_part_with_its_own_rows():
    """Each part on its own run of x's rows, into those rows of out at the part's column:
    the same values as the whole-matrix product of those rows alone (a row's arithmetic
    does not depend on the rows beside it, but for a lone Q8_0 row's block order), on
    every variant; bad runs and part counts refused."""
    k = 512
    types = (12, 14, 8, 2)  # Q4_K, Q6_K, Q8_0, Q4_0: the fused and the decode-buffer paths
    weights = [random_blocks(t, 24, k, seed=t) for t in types]
    x = torch.randn(8, k, generator=torch.Generator().manual_seed(1))
    # (weight, first row, rows, column)
    runs = [(0, 2, 1, 0), (1, 2, 1, 24), (2, 0, 2, 0), (3, 4, 3, 0), (0, 4, 3, 24), (1, 7, 1, 0)]
    for isa in cq.supported_isas():
        with cq.forcing_isa(isa):
            bound = [cq.BlockLinear(k, [(types[j], weights[j], col)]).parts[0]
                     for j, _, _, col in runs]
            out = torch.full((8, 48), float("nan"))
            cq.linear_rows(bound, [(first, n) for _, first, n, _ in runs], k, x, out)
            for j, first, n, col in runs:
                alone = cq.mul_mat(types[j], weights[j], k,
                                   cq.quantize_activations(x[first:first + n]), torch.empty(n, 24))
                assert torch.equal(out[first:first + n, col:col + 24], alone), (isa, j, first)
            assert out[0:2, 24:].isnan().all() and out[3].isnan().all() and out[7, 24:].isnan().all()
    with pytest.raises(ValueError, match="row range"):
        cq.linear_rows(bound[:1], [(7, 2)], k, x, out)
    with pytest.raises(ValueError, match="row range"):
        cq.linear_rows(bound[:1], [(0, 0)], k, x, out)
    with pytest.raises(ValueError, match="1 to 128 parts"):
        cq.linear_rows(bound[:1] * 129, [(0, 1)] * 129, k, x, out)
    with pytest.raises(ValueError, match="out must be"):
        cq.linear_rows(bound[:2], [(0, 1), (1, 1)], k, x, torch.empty(8, 40))


def test_quantize_activations_scheme():
    x = torch.randn(5, 96, generator=torch.Generator().manual_seed(5)) * 3
    x[2, 32:64] = 0.0  # an all-zero block: d = 0, q = 0
    wide = torch.zeros(5, 100)
    wide[:, 2:98] = x
    act = cq.quantize_activations(wide[:, 2:98])
    blocks = x.view(5, 3, 32)
    assert act.q.dtype == torch.int16 and act.gsum.dtype == torch.int32
    assert torch.allclose(act.d, blocks.abs().amax(-1) / 32767, rtol=1e-6, atol=0)
    assert act.q.abs().max() == 32767 and act.q[2, 32:64].eq(0).all() and act.d[2, 1] == 0
    assert torch.equal(act.gsum, act.q.view(5, 6, 16).sum(-1, dtype=torch.int32))
    err = (act.dequantized() - x).abs()
    assert (err <= act.d.repeat_interleave(32, dim=1) * STEP_BOUND + 1e-12).all()


@pytest.mark.parametrize("ggml_type", [t for t in TYPES if t not in cq.QUANT_KERNEL_TYPES] or [1])
def test_types_without_kernel_are_refused(ggml_type):
    k = 256
    w = random_blocks(ggml_type, 2, k, 0) if ggml_type in _F16_FIELDS else torch.zeros(2, 2 * k, dtype=torch.uint8)
    act = cq.quantize_activations(torch.randn(1, k))
    name = GGML_TYPES[ggml_type][0]
    with pytest.raises(NotImplementedError, match=name):
        cq.mul_mat(ggml_type, w, k, act, torch.empty(1, 2))
    with pytest.raises(NotImplementedError, match=name):
        cq.dequantize_rows(ggml_type, w, k, torch.tensor([0]), torch.empty(1, k))


def test_bad_arguments_are_value_errors():
    k = 640
    w = random_blocks(8, 4, k, 1)
    act = cq.quantize_activations(torch.randn(2, k))
    with pytest.raises(ValueError, match="multiple of 32"):
        cq.quantize_activations(torch.randn(2, 48))
    with pytest.raises(ValueError, match="float32"):
        cq.quantize_activations(torch.randn(2, 64, dtype=torch.float64))
    with pytest.raises(ValueError, match="bytes"):
        cq.mul_mat(8, w[:, :-1], k, act, torch.empty(2, 4))
    with pytest.raises(ValueError, match="K=512"):
        cq.mul_mat(8, w, 512, act, torch.empty(2, 4))
    with pytest.raises(ValueError, match="out must be"):
        cq.mul_mat(8, w, k, act, torch.empty(2, 5))
    with pytest.raises(ValueError, match="column stride"):
        cq.mul_mat(8, w, k, act, torch.empty(4, 2).T)
    with pytest.raises(ValueError, match="row ids"):
        cq.dequantize_rows(8, w, k, torch.tensor([4]), torch.empty(1, k))
    with pytest.raises(ValueError, match="multiple of Q4_K"):
        cq.mul_mat(12, random_blocks(12, 1, 256, 0), 640, act, torch.empty(2, 1))


def test_forcing_a_variant_the_cpu_lacks_is_refused():
    before = cq.isa()
    with pytest.raises(UnsupportedFeatureError, match="not-an-isa"):
        cq.set_isa("not-an-isa")
    for name in set(cq.all_isas()) - set(cq.supported_isas()):
        with pytest.raises(UnsupportedFeatureError, match=name):
            cq.set_isa(name)
    assert cq.isa() == before
    with cq.forcing_isa("scalar"):
        assert cq.isa() == "scalar"
    assert cq.isa() == before


def _in_subprocess(code: str, **env: str) -> str:
    full = {**os.environ, **env}
    run = subprocess.run([sys.executable, "-c", code], env=full, capture_output=True, text=True,
                         timeout=120, cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert run.returncode == 0, run.stderr
    return run.stdout.strip()


def test_environment_forces_a_variant_and_one_openmp_runtime_is_loaded():
    code = ("import torch; from pocketllm.workers.kernels import cpu_quant as cq; "
            "maps = open('/proc/self/maps').read().splitlines(); "
            "gomp = {l.split()[-1] for l in maps if 'libgomp' in l}; "
            "print(cq.available(), cq.available() and cq.isa(), len(gomp), cq.unavailable_reason())")
    assert _in_subprocess(code, POCKETLLM_CPU_ISA="scalar").split()[:3] == ["True", "scalar", "1"]
    out = _in_subprocess(code, POCKETLLM_CPU_ISA="bogus")
    assert out.startswith("False False") and "POCKETLLM_CPU_ISA='bogus'" in out
