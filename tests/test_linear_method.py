"""The linear-method seam (``layers/linear_method.py``): layers built with their weights
deferred take a method per stored type, load a GGUF file's tensors into it and multiply
as a dense layer of the dequantized weights does. The block kernels run under Triton's
interpreter on the CPU (compiled on CUDA); the layers get the GPU path's policy, and
``dots`` lets the CPU's rows take the integer dots as CUDA's do."""

from __future__ import annotations

import numpy as np
import pytest

from kernel_modules import load_kernels

K, DEVICE = load_kernels()
import torch  # noqa: E402
from torch import nn  # noqa: E402

from pocketllm.errors import CheckpointError, UnsupportedFeatureError  # noqa: E402
from pocketllm.workers.distributed import SINGLE, TPGroup  # noqa: E402
from pocketllm.workers.kernel_policy import KernelPolicy  # noqa: E402
from pocketllm.workers.kernels.gguf_gemv import (IQ4_XS, Q4_0, Q4_K, Q5_K, Q6_K, Q6_K_PLANES,  # noqa: E402
                                                 Q8_0, Q8_0_SPLIT, REPACKED)
from pocketllm.workers.layers import linear, linear_method  # noqa: E402
from pocketllm.workers.layers.linear import (ColumnParallelLinear, LMHead, RowParallelLinear,  # noqa: E402
                                              Shard, even_shard)
from pocketllm.workers.loader.dummy_blocks import random_block_tensor  # noqa: E402
from pocketllm.workers.models.weight_targets import row_parallel_targets, stacked_targets  # noqa: E402

H, INTER, VOCAB = 256, 512, 40
GPU_PATH = KernelPolicy(triton=True)


class Tiny(nn.Module):
    """q/k/v stacked (64, 32, 32 rows), a row-parallel down projection, a head: built with
    the GPU path's policy (its kernels interpreted on the CPU)."""

    def __init__(self, tp=None, dtype=torch.float32):
        super().__init__()
        kw = dict(device=DEVICE, dtype=dtype)
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(linear, "policy_for", lambda device: GPU_PATH)
            self.qkv = ColumnParallelLinear(H, [Shard(0, 0, n, n) for n in (64, 32, 32)], False,
                                            **kw)
            self.down = RowParallelLinear(even_shard(INTER, tp, dim=1) if tp
                                          else Shard(1, 0, INTER, INTER), H, False,
                                          tp=tp or SINGLE, **kw)
            self.head = LMHead(H, VOCAB, **kw)

    def weight_targets(self):
        t = {}
        stacked_targets(t, "attn.", ("q_proj", "k_proj", "v_proj"), self.qkv)
        row_parallel_targets(t, "mlp.down_proj.", self.down)
        t["lm_head.weight"] = self.head.part_target()
        return t


def checkpoint(types):
    rng = np.random.default_rng(0)
    shapes = {"attn.q_proj.weight": (64, H), "attn.k_proj.weight": (32, H),
              "attn.v_proj.weight": (32, H), "mlp.down_proj.weight": (H, INTER),
              "lm_head.weight": (VOCAB, H)}
    return {name: random_block_tensor(types[name], shape, rng) for name, shape in shapes.items()}


def load(model, tensors):
    """What ``CausalLM.load_weights`` does with each target."""
    from pocketllm.workers.models.base import _stored_blocks

    for name, target in model.weight_targets().items():
        w = tensors[name]
        if target.ggml_type is not None:
            target.write(torch.from_numpy(_stored_blocks(name, w, target)))
        else:
            target.write(torch.from_numpy(w.read(target.shard)))


TYPES = {"attn.q_proj.weight": Q4_K, "attn.k_proj.weight": Q4_K, "attn.v_proj.weight": Q6_K,
         "mlp.down_proj.weight": Q8_0, "lm_head.weight": Q6_K}


def built(types, tp=None, dtype=torch.float32):
    with linear_method.deferred_weights():
        model = Tiny(tp, dtype)
    assert model.qkv.weight.is_meta
    linear_method.materialize(model, types, DEVICE)
    return model


def take_dots(monkeypatch):
    """Rows up to GEMV_ROWS take the integer dots on this device too (as on CUDA), and in
    float32 too (as in 16-bit models)."""
    monkeypatch.setattr(linear_method.GGUF_BLOCKS, "dot_devices", ("cuda", DEVICE.type))
    monkeypatch.setattr(linear_method.GGUF_BLOCKS, "dot_dtypes",
                        linear_method.GGUFBlockMethod.dot_dtypes + (torch.float32,))


@pytest.fixture(params=[False, True], ids=["block_gemv", "dots"])
def dots(request, monkeypatch):
    """Whether rows up to GEMV_ROWS take the integer dots here (these float32 layers take
    the float block gemv unless told)."""
    if request.param:
        take_dots(monkeypatch)
    return request.param


def int8_exact_rows(rows: int, k: int, seed: int) -> torch.Tensor:
    """Rows that 8-bit blocks of 32 hold exactly (integers up to 127, one 127 a block,
    times a scale per block): the integer dots' product of them is the float one."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(-127, 128, (rows, k // 32, 32), generator=g).float()
    q[:, :, 5] = 127
    return (q * torch.rand(rows, k // 32, 1, generator=g)).view(rows, k).to(DEVICE)


@pytest.mark.parametrize("rows", [1, 2, 9])  # the block kernels up to GEMV_ROWS, then dequantize
def test_block_layers_multiply_as_their_dequantized_weights(rows, dots):
    tensors = checkpoint(TYPES)
    model = built(TYPES)
    assert model.qkv.method is linear_method.GGUF_BLOCKS and model.qkv.weight is None
    # q and k (both Q4_K) share one buffer, their rows stacked: one product launch
    assert model.qkv.part_types == [Q4_K, Q4_K, Q6_K]
    assert model.qkv.block_types == [Q4_K, Q6_K]
    assert [b.shape for b in model.qkv.blocks] == [(96, 144), (32, 210)]
    assert model.qkv.part_place == [(0, 0), (0, 64), (1, 0)]
    load(model, tensors)
    dense = {name: torch.from_numpy(w.read()).to(DEVICE) for name, w in tensors.items()}
    qkv = torch.cat([dense[f"attn.{p}_proj.weight"] for p in "qkv"])
    # the integer dots round x to 8-bit blocks: exact on rows that such blocks hold, and
    # within that rounding (about 2^-8 of a block's largest) on any rows
    x = int8_exact_rows(rows, H, seed=1)
    torch.testing.assert_close(model.qkv(x), x @ qkv.T, atol=1e-4, rtol=1e-4)
    x_any = torch.randn(rows, H, generator=torch.Generator().manual_seed(1)).to(DEVICE)
    want = x_any @ qkv.T
    tol = 1.5e-2 if dots and rows <= linear_method.GEMV_ROWS else 1e-5
    assert ((model.qkv(x_any) - want).abs().max() / want.abs().max()).item() < tol
    # the norm before it joins the product where every buffer takes the dots
    assert model.qkv.fuses(x[:1]) == dots and not model.qkv.rotates(x[:1])
    h = int8_exact_rows(rows, INTER, seed=2)
    torch.testing.assert_close(model.down(h), h @ dense["mlp.down_proj.weight"].T,
                               atol=1e-4, rtol=1e-4)
    logits = model.head(x)
    assert logits.dtype == torch.float32 and logits.shape == (rows, VOCAB)
    torch.testing.assert_close(logits, x @ dense["lm_head.weight"].T, atol=1e-4, rtol=1e-4)


def test_each_part_loads_into_its_rows_of_its_types_buffer():
    model = built(TYPES)
    t = model.weight_targets()
    q, k, v = (t[f"attn.{p}_proj.weight"] for p in "qkv")
    assert q.param is k.param is model.qkv.blocks[0] and v.param is model.qkv.blocks[1]
    assert (q.rows, k.rows, v.rows) == (slice(0, 64), slice(64, 96), None)
    assert [x.ggml_type for x in (q, k, v)] == [Q4_K, Q4_K, Q6_K]
    assert k.checkpoint_shape == (32, H) and k.shape == (32, 144)
    # a type between two of another keeps them apart: three buffers
    model = built(dict(TYPES, **{"attn.k_proj.weight": Q8_0}))
    assert model.qkv.block_types == [Q4_K, Q8_0_SPLIT, Q6_K]
    assert [b.shape for b in model.qkv.blocks] == [(64, 144), (32, 272), (32, 210)]


def test_a_padded_vocabulary_loads_its_real_rows():
    """Three ranks' 14 rows of a 40-word vocabulary: the last holds 12 real ones."""
    with linear_method.deferred_weights(), pytest.MonkeyPatch.context() as mp:
        mp.setattr(linear, "policy_for", lambda device: GPU_PATH)
        head = LMHead(H, VOCAB, DEVICE, torch.float32, tp=TPGroup(2, 3))
    holder = nn.Module()
    holder.head = head
    holder.weight_targets = lambda: {"lm_head.weight": head.part_target()}
    linear_method.materialize(holder, {"lm_head.weight": Q8_0}, DEVICE)
    target = head.part_target()
    assert head.blocks[0].shape == (14, 272) and target.rows == slice(0, 12)
    assert target.checkpoint_shape == (VOCAB, H)


class Norm(nn.Module):
    """``layers.norm.RMSNorm`` with the GPU path's kernels (interpreted on the CPU)."""

    def __init__(self, dim):
        super().__init__()
        self.weight = nn.Parameter(torch.rand(dim, generator=torch.Generator().manual_seed(4))
                                   .to(DEVICE) + 0.5, requires_grad=False)
        self.eps = 1e-6

    def forward(self, x):
        return K.rmsnorm.rms_norm(x, self.weight, self.eps)

    def add(self, x, residual):
        return K.rmsnorm.add_rms_norm(x, residual, self.weight, self.eps)


@pytest.mark.parametrize("rows, dtype", [(1, torch.float32), (2, torch.bfloat16)])
def test_the_norm_fused_before_the_dots_gives_the_unfused_bits(rows, dtype, monkeypatch):
    """``normed``: the add and norm write x's int8 blocks, then the dots of each buffer;
    the same bits as the norm's own launch, then the product (which rounds x itself)."""
    take_dots(monkeypatch)
    model = built(TYPES, dtype=dtype)
    load(model, checkpoint(TYPES))
    norm, g = Norm(H), torch.Generator().manual_seed(5)
    x = torch.randn(rows, H, generator=g).to(dtype).to(DEVICE)
    residual = torch.randn(rows, H, generator=g).to(dtype).to(DEVICE)
    assert model.qkv.fuses(x)
    got, new_residual = model.qkv.normed(norm, x, residual)
    h, want_residual = norm.add(x, residual)
    assert torch.equal(got, model.qkv(h)) and torch.equal(new_residual, want_residual)
    got, same = model.qkv.normed(norm, x, None)  # the first layer: no residual yet
    assert torch.equal(got, model.qkv(norm(x))) and same is x
    with pytest.raises(ValueError, match="rotary"):  # the rotary runs on its own
        model.qkv.normed(norm, x, residual, (None, None, 16, 128))


@pytest.mark.parametrize("rows, down_type", [(1, Q8_0), (2, Q4_K)])  # Q4_K reads the sums too
def test_the_activation_fused_before_the_dots_gives_the_unfused_bits(rows, down_type,
                                                                    monkeypatch):
    """``RowParallelLinear(hidden_act=)``: act(gate) * up written as int8 blocks, then the
    dots; the same bits as the activation's own launch, then the product."""
    take_dots(monkeypatch)
    types = dict(TYPES, **{"mlp.down_proj.weight": down_type})
    gate_up = torch.randn(rows, 2 * INTER, generator=torch.Generator().manual_seed(6)
                          ).to(torch.bfloat16).to(DEVICE)
    if down_type == Q8_0:
        model = built(types, dtype=torch.bfloat16)
        load(model, checkpoint(types))
        assert model.down.fuses(gate_up)
        want = model.down(K.gated_act.act_and_mul(gate_up, "silu"))
        assert torch.equal(model.down(gate_up, hidden_act="silu"), want)
        return
    # a tensor-parallel rank's partial sum (the all-reduce left to the caller)
    model = built(types, tp=TPGroup(0, 2), dtype=torch.bfloat16)
    load(model, checkpoint(types))
    half = torch.cat([gate_up[:, :INTER // 2], gate_up[:, INTER:INTER + INTER // 2]], dim=1)
    want = model.down(K.gated_act.act_and_mul(half, "silu"), reduce=False)
    assert torch.equal(model.down(half, hidden_act="silu", reduce=False), want)


@pytest.mark.parametrize("rows", [1, 9])  # the block kernels up to GEMV_ROWS, then dequantize
def test_q5_k_q4_0_and_iq4_xs_layers_multiply_as_their_dequantized_weights(rows, dots):
    """A Q5_K_M file's Q5_K, a Q4_0 file's and an IQ4_XS file's blocks in one stacked
    layer: Q8_0's and Q5_K's parts take the integer dots where they run, Q4_0's and
    IQ4_XS's (no dots taken) float x beside them."""
    types = dict(TYPES, **{"attn.q_proj.weight": Q8_0, "attn.k_proj.weight": Q5_K,
                           "attn.v_proj.weight": Q4_0, "mlp.down_proj.weight": IQ4_XS})
    tensors = checkpoint(types)
    model = built(types)
    assert model.qkv.method is linear_method.GGUF_BLOCKS
    assert model.qkv.block_types == [Q8_0_SPLIT, Q5_K, Q4_0] and not model.qkv.fuses(torch.ones(1, H))
    load(model, tensors)
    dense = {name: torch.from_numpy(w.read()).to(DEVICE) for name, w in tensors.items()}
    qkv = torch.cat([dense[f"attn.{p}_proj.weight"] for p in "qkv"])
    x = int8_exact_rows(rows, H, seed=1)  # the Q8_0 part's dots: exact on these
    torch.testing.assert_close(model.qkv(x), x @ qkv.T, atol=1e-4, rtol=1e-4)
    h = torch.randn(rows, INTER, generator=torch.Generator().manual_seed(2)).to(DEVICE)
    torch.testing.assert_close(model.down(h), h @ dense["mlp.down_proj.weight"].T,
                               atol=1e-4, rtol=1e-4)


def test_a_float_part_or_a_type_without_a_kernel_keeps_the_layer_dense(caplog):
    types = dict(TYPES, **{"attn.v_proj.weight": None, "mlp.down_proj.weight": 3})  # Q4_1
    model = built({k: v for k, v in types.items() if v is not None})
    assert model.qkv.method is linear_method.DENSE and not model.qkv.weight.is_meta
    assert model.down.method is linear_method.DENSE
    assert "Q4_1 blocks have no GPU kernel taken yet" in caplog.text
    assert model.head.method is linear_method.GGUF_BLOCKS


def test_a_file_of_another_type_than_the_header_said_is_refused():
    model = built(TYPES)
    tensors = checkpoint(dict(TYPES, **{"attn.k_proj.weight": Q8_0}))
    with pytest.raises(CheckpointError, match="attn.k_proj.weight.*Q8_0 where the model was "
                                              "built for Q4_K blocks"):
        load(model, tensors)


def test_a_row_parallel_split_inside_a_block_is_refused_by_name():
    """Eight ranks' 64 of the down projection's 512 inputs each cut a Q4_K super-block of
    256: refused at load, naming the inputs."""
    types = dict(TYPES, **{"mlp.down_proj.weight": Q4_K})
    model = built(types, tp=TPGroup(1, 8))
    with pytest.raises(UnsupportedFeatureError, match="input features \\[64, 128\\) do not fall"):
        load(model, checkpoint(types))


@pytest.mark.parametrize("rows", [1, 2, 9])
@pytest.mark.parametrize("down_type, held", [(Q6_K, Q6_K_PLANES), (Q8_0, Q8_0_SPLIT)])
def test_q6_k_and_q8_0_rows_are_held_in_their_word_layouts(rows, down_type, held, dots):
    """A Q6_K down projection of 512 input features is held as planes, a Q8_0 one as split
    codes and scales (their bytes repacked as they land), Q6_K v of 256 as the file's
    blocks; each multiplies as its dequantized weights, through the dots, the float gemv
    and the dequantizing path."""
    types = dict(TYPES, **{"mlp.down_proj.weight": down_type})
    tensors = checkpoint(types)
    model = built(types)
    assert model.down.block_types == [held] and model.qkv.block_types == [Q4_K, Q6_K]
    load(model, tensors)
    w = tensors["mlp.down_proj.weight"]
    repack = REPACKED[held][2]
    assert torch.equal(model.down.blocks[0].cpu(), repack(torch.from_numpy(w.blocks), INTER))
    dense = torch.from_numpy(w.read()).to(DEVICE)
    x = int8_exact_rows(rows, INTER, seed=2)
    torch.testing.assert_close(model.down(x), x @ dense.T, atol=1e-4, rtol=1e-4)


def test_dummy_blocks_are_drawn_into_block_layers():
    """``--load-format dummy --quantization``: random blocks of each layer's types, drawn on
    the device, decoding to about the float dummy's spread."""
    from pocketllm.workers.kernels.gguf_gemv import dequantize
    from pocketllm.workers.loader.dummy import init_dummy_weights

    model = built(TYPES)
    model.device = DEVICE
    init_dummy_weights(model, seed=3)
    for blocks, ggml_type in zip(model.qkv.blocks, model.qkv.block_types):
        w = dequantize(blocks, ggml_type, blocks.shape[0], H, torch.float32)
        assert 0.005 < w.std().item() < 0.05 and abs(w.mean().item()) < 0.01, ggml_type
