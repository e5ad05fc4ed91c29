"""The gemv's multi-row form (``kernels/gemv.py``, ``_rows_kernel``): each of up to eight rows
gets the bits the one-row launch gives it alone, with its norm, activation and rotary, so a
speculative step verifies drafts with the arithmetic that would have decoded them. Compiled
on CUDA, interpreted on the CPU."""

from __future__ import annotations

import pytest

from kernel_modules import load_kernels

K, DEVICE = load_kernels()
import torch  # noqa: E402

from pocketllm.workers.layers.activation import act_and_mul, get_activation  # noqa: E402
from pocketllm.workers.layers.rotary import RotaryTable  # noqa: E402
from test_kernels_layers import assert_product_close, rand, reference_norm  # noqa: E402

ROWS = [2, 3, 5, 8]


def one_by_one(fn, *rows_args):
    """fn applied to each row alone, the results stacked (tuples: each part stacked)."""
    outs = [fn(*(a[i:i + 1] if torch.is_tensor(a) and a.dim() == 2 else a for a in rows_args))
            for i in range(rows_args[0].shape[0])]
    if isinstance(outs[0], tuple):
        return tuple(torch.cat(parts) for parts in zip(*outs))
    return torch.cat(outs)


@pytest.mark.parametrize("m", ROWS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("n,k", [(48, 256), (64, 2048), (40, 1536)])
def test_rows_are_the_one_row_products(m, dtype, n, k):
    weight, bias = rand(n, k, dtype=dtype, seed=1), rand(n, dtype=dtype, seed=2)
    x = rand(m, k, dtype=dtype, seed=3)
    got = K.gemv.gemv(x, weight, bias)
    assert got.shape == (m, n)
    assert torch.equal(got, one_by_one(lambda r: K.gemv.gemv(r, weight, bias), x))
    expected = torch.nn.functional.linear(x, weight, bias)
    if dtype == torch.float32:  # long rows: the sums' order shows at 1e-5
        torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)
    else:
        assert_product_close(got, expected, dtype)
    logits = K.gemv.gemv(x, weight, out_dtype=torch.float32)
    assert torch.equal(logits, one_by_one(
        lambda r: K.gemv.gemv(r, weight, out_dtype=torch.float32), x))


@pytest.mark.parametrize("m", ROWS)
@pytest.mark.parametrize("pre", ["norm", "add_norm"])
def test_normed_rows_are_the_fused_one_row_launch(m, pre):
    n, k, dtype = 40, 512, torch.bfloat16
    norm = reference_norm(k, 1e-6, seed=4)
    weight = rand(n, k, dtype=dtype, seed=5)
    x, residual = rand(m, k, dtype=dtype, seed=6), rand(m, k, dtype=dtype, seed=7)
    res = residual if pre == "add_norm" else None
    with torch.no_grad():
        got, new_res = K.gemv.norm_gemv(x, res, norm.weight, norm.eps, weight)
        expected, expected_res = one_by_one(
            lambda r, s: K.gemv.norm_gemv(r, s if pre == "add_norm" else None, norm.weight,
                                          norm.eps, weight), x, residual)
        normed = torch.empty_like(x)
        K.gemv.norm_gemv(x, res, norm.weight, norm.eps, weight, normed_out=normed)
        h = (K.rmsnorm.add_rms_norm(x, residual, norm.weight, norm.eps)[0] if res is not None
             else K.rmsnorm.rms_norm(x, norm.weight, norm.eps))
    assert torch.equal(got, expected) and torch.equal(new_res, expected_res)
    assert torch.equal(normed, h)
    assert_product_close(got, torch.nn.functional.linear(
        norm(x + residual if res is not None else x), weight), dtype)


@pytest.mark.parametrize("m", [2, 5])
def test_rotated_rows_are_the_fused_one_row_launch(m):
    dim, heads, kv_heads, k, dtype = 32, 4, 2, 256, torch.bfloat16
    n = (heads + 2 * kv_heads) * dim
    norm = reference_norm(k, 1e-6, seed=8)
    weight = rand(n, k, dtype=dtype, seed=9)
    x, residual = rand(m, k, dtype=dtype, seed=10), rand(m, k, dtype=dtype, seed=11)
    table = RotaryTable(dim, {"rope_theta": 10000.0}, 64, DEVICE, dtype)
    positions = torch.arange(30, 30 + m, device=DEVICE)
    cos, sin = table.lookup(positions, 30 + m)
    rotated = (heads + kv_heads) * dim
    with torch.no_grad():
        got, _ = K.gemv.norm_gemv(x, residual, norm.weight, norm.eps, weight,
                                  rotary=(cos, sin, dim, rotated))
        expected = torch.cat([K.gemv.norm_gemv(x[i:i + 1], residual[i:i + 1], norm.weight,
                                               norm.eps, weight,
                                               rotary=(cos[i:i + 1], sin[i:i + 1], dim,
                                                       rotated))[0] for i in range(m)])
    assert torch.equal(got, expected)


@pytest.mark.parametrize("m", [3, 8])
def test_gated_rows_are_the_fused_one_row_launch(m):
    n, k, dtype = 48, 512, torch.bfloat16
    weight = rand(n, k, dtype=dtype, seed=12)
    gate_up = rand(m, 2 * k, dtype=dtype, seed=13) * 3
    got = K.gemv.gated_gemv(gate_up, weight, None, "silu")
    assert torch.equal(got, one_by_one(
        lambda r: K.gemv.gated_gemv(r, weight, None, "silu"), gate_up))
    assert_product_close(got, torch.nn.functional.linear(
        act_and_mul(get_activation("silu"), gate_up), weight), dtype)


def test_fp8_rows_are_the_one_row_products():
    n, k = 48, 512
    weight = (rand(n, k, seed=14) * 0.5).to(torch.float8_e4m3fn)
    scale = rand(n, seed=15).abs() + 0.1
    x = rand(5, k, dtype=torch.bfloat16, seed=16)
    got = K.gemv.gemv(x, weight, scale=scale)
    assert torch.equal(got, one_by_one(lambda r: K.gemv.gemv(r, weight, scale=scale), x))


def test_the_rows_tile_does_not_change_the_bits():
    # any BLOCK_N and warp count, at the one-row launch's BLOCK_K: the same sums
    n, k, dtype = 64, 1024, torch.bfloat16
    weight, x = rand(n, k, dtype=dtype, seed=17), rand(5, k, dtype=dtype, seed=18)
    lanes = K.gemv._config(n, k, "")[1]
    default = K.gemv.gemv(x, weight)
    for tile in [(1, lanes, 2), (4, lanes, 8), (16, lanes, 4)]:
        assert torch.equal(K.gemv.gemv(x, weight, config=tile), default)


def test_more_rows_than_a_launch_takes_are_refused():
    weight = rand(8, 16)
    with pytest.raises(ValueError, match="1 to 8 rows"):
        K.gemv.gemv(rand(9, 16), weight)
    with pytest.raises(ValueError, match="does not match"):
        K.gemv.norm_gemv(rand(2, 16), rand(3, 16), torch.ones(16, device=DEVICE), 1e-6, weight)


def test_several_rows_take_the_gemv_only_inside_a_verification():
    # outside, a batch of decodes keeps the GEMM (the gemv's rows take about twice its time)
    from pocketllm.workers.kernel_policy import KernelPolicy, rows_as_alone

    policy = KernelPolicy(triton=True)
    one, five, nine = rand(1, 16), rand(5, 16), rand(9, 16)
    assert policy.gemv_rows(one) and not policy.gemv_rows(five)
    with rows_as_alone():
        assert policy.gemv_rows(five) and not policy.gemv_rows(nine)
        assert not KernelPolicy(triton=True, batch_invariant=True).gemv_rows(five)
    assert not policy.gemv_rows(five)


def test_a_verifications_routers_experts_and_absorbed_heads_compute_each_row_alone():
    """Inside ``rows_as_alone`` (a verification's rows) up to eight tokens take the experts'
    per-pair gemvs (outside, more than four take the grouped GEMM), and MLA's absorbing
    per-head products run one row at a time: each row then has its decode step's bits."""
    from pocketllm.workers.kernel_policy import ExpertsByTokens, rows_as_alone
    from pocketllm.workers.layers import mla

    experts = ExpertsByTokens(4, lambda x: "gemv", lambda x: "grouped", alone_tokens=8)
    five, nine = rand(5, 16), rand(9, 16)
    assert experts(five) == "grouped"
    with rows_as_alone():
        assert experts(five) == "gemv" and experts(nine) == "grouped"
    heads, weights = rand(3, 5, 16), rand(3, 16, 8)
    with rows_as_alone():
        rows = mla._heads_bmm(heads, weights)
    for i in range(5):
        assert torch.equal(rows[:, i:i + 1], torch.bmm(heads[:, i:i + 1], weights))
