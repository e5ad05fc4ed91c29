"""The GPU's GGUF block products (``kernels/gguf_gemv.py``) against dequantize-then-matmul:
the blocks decoded by ``loader/gguf_quants.py`` (numpy), then a float64 product.
Interpreted on the CPU at small sizes, compiled on CUDA at a real layer's."""

from __future__ import annotations

import numpy as np
import pytest

from kernel_modules import load_kernels

K, DEVICE = load_kernels()
import torch  # noqa: E402

from pocketllm.workers.kernels import gguf_gemv  # noqa: E402
from pocketllm.workers.loader.dummy_blocks import SCALE_FIELDS, random_block_tensor  # noqa: E402
from pocketllm.workers.loader.gguf_quants import GGML_TYPES  # noqa: E402

TYPES = sorted(gguf_gemv.BLOCKS)  # Q4_0, Q8_0, Q4_K, Q5_K, Q6_K, IQ4_XS
CUDA = DEVICE.type == "cuda"


def random_blocks(ggml_type: int, n: int, k: int, seed: int):
    """Random blocks whose fp16 scales differ block to block (a real file's do), with
    their numpy decoding."""
    rng = np.random.default_rng(seed)
    t = random_block_tensor(ggml_type, (n, k), rng)
    name, per, size = GGML_TYPES[ggml_type]
    raw = t.blocks.reshape(-1, size)
    for offset in SCALE_FIELDS[name.lower()][0]:
        d = raw[:, offset:offset + 2].copy().view(np.float16).astype(np.float32)
        jitter = rng.uniform(0.5, 1.5, size=d.shape).astype(np.float32)
        raw[:, offset:offset + 2] = (d * jitter).astype(np.float16).view(np.uint8)
    return t.blocks, t.read()


@pytest.mark.parametrize("ggml_type", TYPES)
@pytest.mark.parametrize("m", [1, 3])
@pytest.mark.parametrize("config", [None, (1, 1, 1), (8, 2, 4)])  # tuning's other shapes
def test_block_gemv_equals_dequantize_then_matmul(ggml_type, m, config):
    # rows not a multiple of the programs' (13), two super-blocks along the input
    n, k = (13, 512) if not CUDA else (4096 + 13, 4096)
    blocks, dense = random_blocks(ggml_type, n, k, seed=ggml_type)
    x = np.random.default_rng(1).standard_normal((m, k)).astype(np.float32)
    want = x.astype(np.float64) @ dense.astype(np.float64).T
    got = gguf_gemv.block_gemv(torch.from_numpy(x).to(DEVICE), torch.from_numpy(blocks).to(DEVICE),
                               ggml_type, n, k, config=config)
    scale = np.abs(want).max()
    np.testing.assert_allclose(got.double().cpu().numpy(), want, atol=2e-5 * scale * np.sqrt(k / 512),
                               rtol=1e-4)


@pytest.mark.parametrize("ggml_type", TYPES)
def test_block_gemv_in_bfloat16(ggml_type):
    """bf16 activations and output: the products sum in float32, one rounding at the end."""
    n, k = 8, 256
    blocks, dense = random_blocks(ggml_type, n, k, seed=3)
    x = torch.randn(1, k, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    want = x.double() @ torch.from_numpy(dense).double().T
    got = gguf_gemv.block_gemv(x.to(DEVICE), torch.from_numpy(blocks).to(DEVICE), ggml_type, n, k)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.double().cpu(), want, atol=1e-3, rtol=1e-2)


@pytest.mark.parametrize("ggml_type", TYPES)
def test_dequantize_equals_the_numpy_decoding(ggml_type):
    n, k = (13, 512) if not CUDA else (4096 + 13, 4096)
    blocks, dense = random_blocks(ggml_type, n, k, seed=5)
    b = torch.from_numpy(blocks).to(DEVICE)
    got = gguf_gemv.dequantize(b, ggml_type, n, k, torch.float32)
    np.testing.assert_array_equal(got.cpu().numpy(), dense)  # the same float32 arithmetic
    got = gguf_gemv.dequantize(b, ggml_type, n, k, torch.bfloat16)
    # rounded once when compiled; the interpreter truncates float32 -> bfloat16 (1 ulp)
    torch.testing.assert_close(got.cpu(), torch.from_numpy(dense).to(torch.bfloat16), atol=0,
                               rtol=0 if CUDA else 2 ** -7)


def test_block_gemv_into_a_column_slice():
    """A stacked layer's parts write their columns of one output."""
    blocks, dense = random_blocks(gguf_gemv.Q8_0, 8, 64, seed=6)
    x = torch.randn(2, 64, generator=torch.Generator().manual_seed(0))
    y = torch.zeros(2, 20, device=DEVICE)
    gguf_gemv.block_gemv(x.to(DEVICE), torch.from_numpy(blocks).to(DEVICE), gguf_gemv.Q8_0, 8, 64,
                         out=y[:, 4:12])
    torch.testing.assert_close(y[:, 4:12].cpu(), x @ torch.from_numpy(dense).T, atol=1e-4, rtol=1e-4)
    assert not y[:, :4].any() and not y[:, 12:].any()


def test_refusals():
    x = torch.zeros(1, 256, device=DEVICE)
    with pytest.raises(Exception, match="no GPU kernel reads GGUF type 3"):  # Q4_1
        gguf_gemv.block_gemv(x, torch.zeros(4, 160, dtype=torch.uint8, device=DEVICE), 3, 4, 256)
    with pytest.raises(ValueError, match="do not hold"):
        gguf_gemv.block_gemv(x, torch.zeros(4, 100, dtype=torch.uint8, device=DEVICE),
                             gguf_gemv.Q4_K, 4, 256)


# --- the int8-dot products (kernels/gguf_dot.py) -----------------------------------------

def block_exact_rows(m: int, k: int, seed: int) -> torch.Tensor:
    """Rows that 8-bit blocks of 32 hold exactly: integers up to 127 (one of them 127
    in each block) times a scale per block."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(-127, 128, (m, k // 32, 32), generator=g).float()
    q[:, :, 5] = 127
    return (q * torch.rand(m, k // 32, 1, generator=g)).view(m, k)


def test_activation_blocks_round_to_int8():
    x = torch.randn(3, 96, generator=torch.Generator().manual_seed(0))
    x[1, 32:64] = 0  # a block of zeros: scale 0, codes 0
    q, d, s = (t.cpu() for t in K.gguf_dot.quantize_rows(x.to(DEVICE)))
    blocks = x.view(3, 3, 32)
    torch.testing.assert_close(d, blocks.abs().amax(-1) / 127)
    want = torch.round(blocks / torch.where(d > 0, d, 1)[:, :, None]).view(3, 96)
    assert torch.equal(q.float(), want)
    torch.testing.assert_close(s, blocks.sum(-1))


DOT_TYPES = sorted(K.gguf_dot.KERNELS) if hasattr(K, "gguf_dot") else []


@pytest.mark.parametrize("ggml_type", DOT_TYPES)
@pytest.mark.parametrize("m", [1, 3])
@pytest.mark.parametrize("config", [None, (1, 1, 1), (16, 4, 4)])
def test_integer_dots_are_exact_on_int8_activations(ggml_type, m, config):
    """Where the activations are exactly 8-bit blocks, the integer dots are the float
    product (up to float32 sums); on any rows, within 8-bit rounding of the activations."""
    n, k = (13, 512) if not CUDA else (4096 + 13, 4096)
    blocks, dense = random_blocks(ggml_type, n, k, seed=5)
    w = torch.from_numpy(dense).double()
    b = torch.from_numpy(blocks).to(DEVICE)
    rows = torch.randn(m, k, generator=torch.Generator().manual_seed(2))
    # any rows: within the rounding of x to 8 bits (about 2^-8 of each block's largest)
    for x, tol in ((block_exact_rows(m, k, 1), 1e-5), (rows, 3e-2)):
        out = torch.empty(m, n, device=DEVICE)
        got = K.gguf_dot.KERNELS[ggml_type](K.gguf_dot.quantize_rows(x.to(DEVICE)), b, n, k,
                                            out, config=config).cpu().double()
        want = x.double() @ w.T
        assert ((got - want).abs().max() / want.abs().max()).item() < tol


@pytest.mark.parametrize("m", [1, 3])
@pytest.mark.parametrize("config", [None, (1, 1, 1), (4, 4, 2)])
def test_q6_k_planes_give_the_file_layouts_bits(m, config):
    """Q6_K rows repacked into planes (``q6_k_planes``: the same bytes, each plane 4-byte
    aligned) give the file layout's products: the dequantization bit for bit, the integer
    dots and the float gemv up to the order of their float32 sums (compiled, the planes'
    kernels add a row's groups in another order)."""
    n, k = (13, 512) if not CUDA else (4096 + 13, 4096)
    blocks, _ = random_blocks(gguf_gemv.Q6_K, n, k, seed=11)
    b = torch.from_numpy(blocks).to(DEVICE)
    planes = gguf_gemv.q6_k_planes(b, k)
    assert planes.shape == b.shape and not torch.equal(planes, b)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(6)).to(DEVICE)
    xq = K.gguf_dot.quantize_rows(x)
    out = lambda: torch.empty(m, n, device=DEVICE)  # noqa: E731
    got = K.gguf_dot.q6_k_planes_dot(xq, planes, n, k, out(), config=config)
    want = K.gguf_dot.q6_k_dot(xq, b, n, k, out(), config=config)
    assert ((got - want).abs().max() / want.abs().max()).item() < 1e-5
    gemv_config = config and config[:2] + (config[2],)
    # the float gemv: the same products, added in the order its compiled layout takes
    torch.testing.assert_close(
        gguf_gemv.block_gemv(x, planes, gguf_gemv.Q6_K_PLANES, n, k, config=gemv_config),
        gguf_gemv.block_gemv(x, b, gguf_gemv.Q6_K, n, k, config=gemv_config), rtol=1e-5, atol=1e-5)
    assert torch.equal(gguf_gemv.dequantize(planes, gguf_gemv.Q6_K_PLANES, n, k, torch.float32),
                       gguf_gemv.dequantize(b, gguf_gemv.Q6_K, n, k, torch.float32))
    with pytest.raises(ValueError, match="multiple of 512"):
        K.gguf_dot.q6_k_planes_dot(xq, planes[:, :210], n, 256, out())


@pytest.mark.parametrize("m", [1, 3])
@pytest.mark.parametrize("config", [None, (1, 1, 1), (16, 4, 4)])
def test_split_q8_0_rows_give_the_q8_0_dots_bits(m, config):
    """Q8_0 rows repacked as codes then scales (``q8_0_split``: the same bytes, aligned
    for word reads) multiply as the file's blocks do, bit for bit at the same config (the
    float gemv and the dequantization at any)."""
    n, k = (13, 512) if not CUDA else (4096 + 13, 4096)
    blocks, _ = random_blocks(gguf_gemv.Q8_0, n, k, seed=9)
    b = torch.from_numpy(blocks).to(DEVICE)
    split = gguf_gemv.q8_0_split(b, k)
    assert split.shape == b.shape
    config = config or K.gguf_dot.Q8_0_SPLIT_CONFIG
    xq = K.gguf_dot.quantize_rows(torch.randn(m, k, generator=torch.Generator().manual_seed(4))
                                  .to(DEVICE))
    want = K.gguf_dot.q8_0_dot(xq, b, n, k, torch.empty(m, n, device=DEVICE), config=config)
    got = K.gguf_dot.q8_0_split_dot(xq, split, n, k, torch.empty(m, n, device=DEVICE),
                                    config=config)
    assert torch.equal(got, want)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(5)).to(DEVICE)
    assert torch.equal(gguf_gemv.block_gemv(x, split, gguf_gemv.Q8_0_SPLIT, n, k),
                       gguf_gemv.block_gemv(x, b, gguf_gemv.Q8_0, n, k))
    assert torch.equal(gguf_gemv.dequantize(split, gguf_gemv.Q8_0_SPLIT, n, k, torch.float32),
                       gguf_gemv.dequantize(b, gguf_gemv.Q8_0, n, k, torch.float32))
    with pytest.raises(ValueError, match="multiple of 64"):
        gguf_gemv.q8_0_split(b[:, :34], 32)
