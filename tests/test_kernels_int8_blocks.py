"""The RMSNorm and gated-activation kernels that write their rows as the GGUF integer dots'
int8 blocks (``rmsnorm.rms_norm_int8``, ``gated_act.act_and_mul_int8``) against the
unfused launches they replace: the norm or the activation, then ``gguf_dot.quantize_rows``.
Bit for bit (codes, scales, sums): both round through ``int8_blocks.store_int8_blocks``.
Interpreted on the CPU, compiled on CUDA."""

from __future__ import annotations

import pytest

from kernel_modules import load_kernels

K, DEVICE = load_kernels()
import torch  # noqa: E402

DTYPES = [torch.bfloat16, torch.float32]
SHAPES = [(1, 64), (3, 96), (4, 256)]  # (rows, K): K a multiple of 32, not always a power of 2


def rand(*shape, dtype, seed, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * scale).to(dtype).to(DEVICE)


def assert_same_blocks(got, want):
    for a, b, what in zip(got, want, ("codes", "scales", "sums")):
        assert a.dtype == b.dtype and a.shape == b.shape, what
        assert torch.equal(a, b), f"{what} differ: {(a.float() - b.float()).abs().max()}"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows, k", SHAPES)
@pytest.mark.parametrize("with_residual", [False, True])
def test_norm_int8_blocks_are_the_norm_then_quantize_rows(dtype, rows, k, with_residual):
    x = rand(rows, k, dtype=dtype, seed=k + rows)
    x[0, :32] = 0  # an all-zero row block: scale 0, codes 0
    residual = rand(rows, k, dtype=dtype, seed=7, scale=3.0) if with_residual else None
    if residual is not None:
        residual[0, :32] = 0
    weight = torch.rand(k, generator=torch.Generator().manual_seed(3)).to(DEVICE) + 0.5
    blocks, res_out = K.rmsnorm.rms_norm_int8(x, residual, weight, 1e-6)
    if residual is None:
        h, want_res = K.rmsnorm.rms_norm(x, weight, 1e-6), None
    else:
        h, want_res = K.rmsnorm.add_rms_norm(x, residual, weight, 1e-6)
    assert_same_blocks(blocks, K.gguf_dot.quantize_rows(h))
    if residual is None:
        assert res_out is None
    else:
        assert torch.equal(res_out, want_res)
    assert not blocks[0][0, :32].any() and blocks[1][0, 0] == 0


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows, k", SHAPES + [(2, 2048 + 96)])  # two column programs
@pytest.mark.parametrize("hidden_act", ["silu", "gelu_pytorch_tanh"])
def test_act_int8_blocks_are_the_activation_then_quantize_rows(dtype, rows, k, hidden_act):
    gate_up = rand(rows, 2 * k, dtype=dtype, seed=k, scale=2.0)
    want = K.gguf_dot.quantize_rows(K.gated_act.act_and_mul(gate_up, hidden_act))
    assert_same_blocks(K.gated_act.act_and_mul_int8(gate_up, hidden_act), want)


def test_a_column_slice_of_gate_up_and_the_refusals():
    """A strided [gate | up] view (a wider buffer's columns) reads as its contiguous copy."""
    wide = rand(2, 3 * 64, dtype=torch.bfloat16, seed=1)
    gate_up = wide[:, :128]
    assert_same_blocks(K.gated_act.act_and_mul_int8(gate_up, "silu"),
                       K.gguf_dot.quantize_rows(K.gated_act.act_and_mul(gate_up.contiguous())))
    with pytest.raises(ValueError, match="multiple of 32"):
        K.gated_act.act_and_mul_int8(rand(1, 2 * 48, dtype=torch.float32, seed=0))
    with pytest.raises(ValueError, match="multiple of 32"):
        K.rmsnorm.rms_norm_int8(rand(1, 48, dtype=torch.float32, seed=0), None,
                                torch.ones(48, device=DEVICE), 1e-6)
