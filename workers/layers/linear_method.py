"""How a linear layer's weight is held, loaded and multiplied: one method per stored type.

A layer (``linear.py``: column- and row-parallel products, the LM head) holds a method
and asks it for every product and for the load targets of its checkpoint tensors; the
layer itself never branches on storage.

* ``DENSE``: one float parameter in the model dtype, ``layer.weight``. On the GPU path a
  one-row product is the fused gemv of ``kernels/gemv.py`` (with the norm, activation
  or rotary beside it: only this method fuses them); more rows take the library GEMM.
  Every float checkpoint; a GGUF file's blocks where nothing reads them (the CPU's torch
  worker, a type with no GPU kernel, batch-invariant mode), dequantized at load.
* ``GGUF_BLOCKS``: each stacked part's blocks as the file stores them, uint8
  [rows, row_bytes] on the GPU (``layer.blocks``, ``layer.block_types``): up to
  ``GEMV_ROWS`` rows run the block gemv of ``kernels/gguf_gemv.py`` per part, more rows
  dequantize each part to the model dtype and take the GEMM. Weight memory is the file's
  bytes.

The kernel policy chooses (``KernelPolicy.linear_method``) from the stored types of the
checkpoint tensors a layer holds, which a GGUF header names before any weight is read:
the runner builds the model with its linear weights deferred (``deferred_weights``) and
then gives each layer its method and storage (``materialize``).
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Iterator, Optional, Sequence

import torch
import torch.nn.functional as F
from torch import nn

if TYPE_CHECKING:
    from ..models.weight_targets import WeightTarget

# A product of more rows dequantizes and multiplies: past a few rows the block gemv
# reads its weights once per row.
GEMV_ROWS = 4

_deferred = False


@contextlib.contextmanager
def deferred_weights() -> Iterator[None]:
    """Linear layers built inside leave their weight on the meta device (no memory) until
    ``materialize`` gives them their method."""
    global _deferred
    before, _deferred = _deferred, True
    try:
        yield
    finally:
        _deferred = before


def weight_param(shape: Sequence[int], device: torch.device, dtype: torch.dtype) -> nn.Parameter:
    """A linear layer's float weight, uninitialised (a loader fills it), or on the meta
    device while ``deferred_weights``."""
    device = torch.device("meta") if _deferred else device
    return nn.Parameter(torch.empty(*shape, device=device, dtype=dtype), requires_grad=False)


class DenseMethod:
    fuses = True  # the one-row gemv takes the op before it

    def target(self, layer, part: int, rows: Optional[slice], shard, stored_shape
               ) -> "WeightTarget":
        from ..models.weight_targets import WeightTarget

        return WeightTarget(layer.weight, rows, shard=shard)

    def product(self, layer, x: torch.Tensor, bias: Optional[torch.Tensor],
                out_dtype: Optional[torch.dtype] = None,
                weight: Optional[torch.Tensor] = None) -> torch.Tensor:
        """``weight``: another layer's (a tied LM head reads the embedding's)."""
        weight = layer.weight if weight is None else weight
        if layer.policy.one_row(x):
            return layer.gemv(x, weight, bias, out_dtype=out_dtype)
        return layer.policy.linear(x, weight, bias, out_dtype=out_dtype)

    def materialize(self, layer, types: Sequence[int], device: torch.device) -> None:
        w = layer.weight  # zeros: a padded vocabulary's rows stay zero
        layer.weight = nn.Parameter(torch.zeros(w.shape, device=device, dtype=w.dtype),
                                    requires_grad=False)


class GGUFBlockMethod:
    fuses = False

    def target(self, layer, part: int, rows: Optional[slice], shard, stored_shape
               ) -> "WeightTarget":
        from ..models.weight_targets import WeightTarget

        buf = layer.blocks[part]  # this part's alone: ``rows`` (the stacked ones) do not apply
        held = shard.size if shard is not None and shard.dim == 0 else stored_shape[0]
        return WeightTarget(buf, None if held == buf.shape[0] else slice(0, held),  # padding
                            shard=shard, stored_shape=stored_shape,
                            ggml_type=layer.block_types[part])

    def product(self, layer, x: torch.Tensor, bias: Optional[torch.Tensor],
                out_dtype: Optional[torch.dtype] = None) -> torch.Tensor:
        from ..kernels import gguf_gemv

        k = x.shape[-1]
        y = torch.empty(x.shape[0], layer.out_width, dtype=out_dtype or x.dtype, device=x.device)
        at = 0
        for blocks, ggml_type in zip(layer.blocks, layer.block_types):
            n = blocks.shape[0]
            if x.shape[0] <= GEMV_ROWS:
                gguf_gemv.block_gemv(x, blocks, ggml_type, n, k, out=y[:, at:at + n])
            else:
                w = gguf_gemv.dequantize(blocks, ggml_type, n, k, x.dtype)
                y[:, at:at + n] = F.linear(x, w)
            at += n
        return y if bias is None else y.add_(bias)

    def materialize(self, layer, types: Sequence[int], device: torch.device) -> None:
        from ..kernels.gguf_gemv import BLOCKS

        rows, k = layer.weight.shape
        layer.block_types = list(types)
        layer.blocks = []
        for j, (ggml_type, n) in enumerate(zip(types, layer.part_rows())):
            per, size = BLOCKS[ggml_type]
            buf = torch.zeros(n, k // per * size, dtype=torch.uint8, device=device)
            layer.register_buffer(f"blocks{j}", buf, persistent=False)
            layer.blocks.append(buf)
        layer.out_width = rows
        layer.weight = None


DENSE, GGUF_BLOCKS = DenseMethod(), GGUFBlockMethod()


def materialize(model: nn.Module, stored_types: dict[str, int], device: torch.device) -> None:
    """Give every linear layer whose weight ``deferred_weights`` left on the meta device
    its method (``KernelPolicy.linear_method``, from the stored types of the checkpoint
    tensors that fill it: ``stored_types``, HF name -> GGML type of a block tensor) and
    its storage. A layer filled through a transform (rows regrouped, a transpose) stays
    dense: only whole rows or block columns of a file's tensor can be copied as blocks."""
    from .linear import LINEAR_LAYERS

    feeds: dict[int, list] = {}
    for name, target in model.weight_targets().items():
        feeds.setdefault(id(target.param), []).append((name, target))
    for layer in model.modules():
        if not isinstance(layer, LINEAR_LAYERS) or layer.weight is None or not layer.weight.is_meta:
            continue
        parts = layer.part_rows()
        by_part: list[Optional[int]] = [None] * len(parts)
        plain = True
        for name, target in feeds.get(id(layer.weight), []):
            plain &= target.transform is None and target.stored_shape is None
            j = layer.part_of(target.rows)
            if j is None:
                plain = False
            else:
                by_part[j] = stored_types.get(name)
        method = layer.policy.linear_method(by_part if plain else [None])
        method.materialize(layer, by_part, device)
        layer.method = method
