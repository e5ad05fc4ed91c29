"""The linear-method seam (``layers/linear_method.py``): layers built with their weights
deferred take a method per stored type, load a GGUF file's tensors into it and multiply
as a dense layer of the dequantized weights does. The block kernels run under Triton's
interpreter on the CPU (compiled on CUDA); the layers get the GPU path's policy."""

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
from pocketllm.workers.kernels.gguf_gemv import Q4_K, Q6_K, Q8_0  # noqa: E402
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

    def __init__(self, tp=None):
        super().__init__()
        kw = dict(device=DEVICE, dtype=torch.float32)
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


def built(types, tp=None):
    with linear_method.deferred_weights():
        model = Tiny(tp)
    assert model.qkv.weight.is_meta
    linear_method.materialize(model, types, DEVICE)
    return model


@pytest.mark.parametrize("rows", [1, 3, 9])  # the block gemv up to GEMV_ROWS, then dequantize
def test_block_layers_multiply_as_their_dequantized_weights(rows):
    tensors = checkpoint(TYPES)
    model = built(TYPES)
    assert model.qkv.method is linear_method.GGUF_BLOCKS and model.qkv.weight is None
    assert model.qkv.block_types == [Q4_K, Q4_K, Q6_K]
    assert [b.shape for b in model.qkv.blocks] == [(64, 144), (32, 144), (32, 210)]
    load(model, tensors)
    x = torch.randn(rows, H, generator=torch.Generator().manual_seed(1)).to(DEVICE)
    dense = torch.from_numpy(np.concatenate([tensors[f"attn.{p}_proj.weight"].read()
                                             for p in "qkv"])).to(DEVICE)
    want = x @ dense.T
    if DEVICE.type == "cuda" and rows <= linear_method.GEMV_ROWS:
        # q and k (Q4_K) take the integer dots: x rounded to 8-bit blocks first
        # (test_kernels_gguf.py checks them exactly); v (Q6_K) the float block gemv
        scale = want.abs().max().item()
        assert (model.qkv(x) - want).abs().max().item() < 1.5e-2 * scale
        torch.testing.assert_close(model.qkv(x)[:, 96:], want[:, 96:], atol=1e-4, rtol=1e-4)
    else:
        torch.testing.assert_close(model.qkv(x), want, atol=1e-4, rtol=1e-4)
    assert not model.qkv.fuses(x[:1])  # the norm before it runs on its own
    h = torch.randn(rows, INTER, generator=torch.Generator().manual_seed(2)).to(DEVICE)
    want = h @ torch.from_numpy(tensors["mlp.down_proj.weight"].read()).to(DEVICE).T
    torch.testing.assert_close(model.down(h), want, atol=1e-4, rtol=1e-4)
    logits = model.head(x)
    assert logits.dtype == torch.float32 and logits.shape == (rows, VOCAB)
    want = x @ torch.from_numpy(tensors["lm_head.weight"].read()).to(DEVICE).T
    torch.testing.assert_close(logits, want, atol=1e-4, rtol=1e-4)


def test_a_float_part_or_a_type_without_a_kernel_keeps_the_layer_dense(caplog):
    types = dict(TYPES, **{"attn.v_proj.weight": None, "mlp.down_proj.weight": 13})  # Q5_K
    model = built({k: v for k, v in types.items() if v is not None})
    assert model.qkv.method is linear_method.DENSE and not model.qkv.weight.is_meta
    assert model.down.method is linear_method.DENSE
    assert "Q5_K blocks have no GPU kernel" in caplog.text
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
