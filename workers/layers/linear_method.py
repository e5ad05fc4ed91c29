"""How a linear layer's weight is held, loaded and multiplied: one method per stored type.

A layer (``linear.py``: column- and row-parallel products, the LM head) holds a method
and asks it for every product and for the load targets of its checkpoint tensors; the
layer itself never branches on storage. A method also says, per x, whether it takes the
op before the product into the product's launches (``fuses(layer, x)``): a pre-norm
sublayer's add and RMSNorm (``normed``), the MLP's gated activation (``gated``); and
whether ``normed`` can also rotate q/k (``rotates``).

* ``DENSE``: one float parameter in the model dtype, ``layer.weight``. On the GPU path a
  one-row product is the fused gemv of ``kernels/gemv.py``, which takes the norm,
  activation or rotary into its own launch; more rows take the library GEMM.
  Every float checkpoint; a GGUF file's blocks where nothing reads them (the CPU's torch
  worker, a type with no GPU kernel, batch-invariant mode), dequantized at load.
* ``GGUF_BLOCKS``: the blocks as the file stores them (Q6_K and Q8_0 rows repacked as
  they land into layouts of the same bytes with aligned words, ``held_type``), uint8
  [rows, row_bytes] on the GPU,
  consecutive stacked parts of one type in one buffer (``layer.blocks``, of
  ``layer.block_types``; q and k of Q4_K are one buffer, v of Q6_K another): up to
  ``GEMV_ROWS`` rows run, per buffer, the integer dots of ``kernels/gguf_dot.py`` on 8-bit
  activation blocks (or the float block gemv of ``kernels/gguf_gemv.py`` for a type
  without a dot), more rows dequantize each buffer to the model dtype and take the GEMM.
  Where every buffer takes the dots, the norm (``kernels/rmsnorm.rms_norm_int8``) or the
  activation (``kernels/gated_act.act_and_mul_int8``) writes x's int8 blocks itself, so
  the rounding costs no launch of its own; the rotary stays a launch of its own. Weight
  memory is the file's bytes.
* ``FP8``: float8_e4m3fn ``layer.weight`` with one float32 scale per output row,
  ``layer.weight_scale``, quantized as the float values arrive (``WeightTarget.quantize``):
  ``--quantization fp8`` on a float checkpoint, and an FP8 checkpoint (its per-tensor,
  per-channel or block scales are expanded as it is read, ``loader/fp8.py``, then each row
  requantized). One row runs the fused gemv with the scale on each sum (so this method
  fuses the norm, activation and rotary as the dense one does); more rows run on the FP8
  tensor cores (``kernels/fp8_linear.scaled_linear``). Half the dense bytes.

The kernel policy chooses (``KernelPolicy.linear_method``) from the stored types of the
checkpoint tensors a layer holds (a GGUF block type, or ``FP8`` where the weights are to
be held in e4m3), which a GGUF header or the engine arguments name before any weight is
read:
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
# The stored type of a weight held in float8_e4m3fn with row scales (beside GGML's ints)
FP8 = "fp8_e4m3"

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


class _GemvMethod:
    """A float or e4m3 weight, whose one-row gemv (``kernels/gemv.py``) takes the op
    before the product in its launch: the RMSNorm (and residual add), the rotary after
    it, or the gated activation."""

    rotates = True  # ``normed`` can also rotate q/k in the same launch

    @staticmethod
    def scale(layer) -> Optional[torch.Tensor]:
        """The weight's row scales, for the fused gemv (None: float values)."""
        return None

    def fuses(self, layer, x: torch.Tensor) -> bool:
        """Whether ``normed`` / ``gated`` serve x's rows: the gemv's."""
        return layer.policy.gemv_rows(x)

    def normed(self, layer, norm, x: torch.Tensor, residual: Optional[torch.Tensor],
               rotary: Optional[tuple] = None) -> tuple[torch.Tensor, torch.Tensor]:
        return layer.norm_gemv(x, residual, norm.weight, norm.eps, layer.weight, layer.bias,
                               rotary, scale=self.scale(layer))

    def gated(self, layer, gate_up: torch.Tensor, bias: Optional[torch.Tensor],
              hidden_act: str) -> torch.Tensor:
        return layer.gated_gemv(gate_up, layer.weight, bias, hidden_act, scale=self.scale(layer))


class DenseMethod(_GemvMethod):
    def target(self, layer, part: int, rows: Optional[slice], shard, stored_shape
               ) -> "WeightTarget":
        from ..models.weight_targets import WeightTarget

        return WeightTarget(layer.weight, rows, shard=shard, by_method=True)

    def product(self, layer, x: torch.Tensor, bias: Optional[torch.Tensor],
                out_dtype: Optional[torch.dtype] = None,
                weight: Optional[torch.Tensor] = None) -> torch.Tensor:
        """``weight``: another layer's (a tied LM head reads the embedding's)."""
        weight = layer.weight if weight is None else weight
        if layer.policy.gemv_rows(x):
            return layer.gemv(x, weight, bias, out_dtype=out_dtype)
        return layer.policy.linear(x, weight, bias, out_dtype=out_dtype)

    def materialize(self, layer, types: Sequence[int], device: torch.device) -> None:
        w = layer.weight  # zeros: a padded vocabulary's rows stay zero
        layer.weight = nn.Parameter(torch.zeros(w.shape, device=device, dtype=w.dtype),
                                    requires_grad=False)


class GGUFBlockMethod:
    """Consecutive parts of one type share a buffer (``layer.blocks[g]``, of type
    ``layer.block_types[g]``; ``layer.part_types`` and ``layer.part_place`` say each part's
    type and (group, first row)): q and k of Q4_K are one integer-dot launch, gate and up
    another."""

    rotates = False  # the integer dots write no rotated heads: the rotary runs on its own
    # Devices whose rows up to GEMV_ROWS take the integer dots (the tests add the CPU, whose
    # Triton interpreter runs them)
    dot_devices = ("cuda",)
    # Activations the dots round to int8 blocks: 16-bit ones, whose mantissas are already
    # 8 bits. A float32 model asks for float32's precision, so it takes the float block gemv:
    # the embedded Gemma 3's top-1 token agreed at 95.9% with the dots and 100% without
    # (teacher-forced on an H100, docs/gpu_kernels.md)
    dot_dtypes = (torch.bfloat16, torch.float16)

    def target(self, layer, part: int, rows: Optional[slice], shard, stored_shape
               ) -> "WeightTarget":
        from ..models.weight_targets import WeightTarget

        from ..kernels.gguf_gemv import FORMATS, REPACKED

        group, first = layer.part_place[part]  # ``rows`` (the float layout's) do not apply
        buf = layer.blocks[group]
        held = shard.size if shard is not None and shard.dim == 0 else stored_shape[0]
        whole = first == 0 and held == buf.shape[0]
        repack = None
        if layer.block_types[group] in REPACKED:  # each row's bytes repacked as they land
            _, _, layout = REPACKED[layer.block_types[group]]
            per, size = FORMATS[layer.block_types[group]]
            k = buf.shape[1] // size * per

            def repack(value: torch.Tensor, rows: Optional[slice]) -> None:
                buf[rows if rows is not None else slice(None)].copy_(layout(value, k))
        return WeightTarget(buf, None if whole else slice(first, first + held),  # padding
                            shard=shard, stored_shape=stored_shape, quantize=repack,
                            ggml_type=layer.part_types[part], by_method=True)

    def _dots(self, x: torch.Tensor) -> bool:
        return (x.shape[0] <= GEMV_ROWS and x.device.type in self.dot_devices
                and x.dtype in self.dot_dtypes)

    def fuses(self, layer, x: torch.Tensor) -> bool:
        """Whether every group of x's rows takes the integer dots, so that the norm or the
        activation before can write x's int8 blocks itself (``normed`` / ``gated``)."""
        from ..kernels import gguf_dot

        return (x.shape[0] > 0 and self._dots(x)
                and all(t in gguf_dot.DOTS for t in layer.block_types))

    def normed(self, layer, norm, x: torch.Tensor, residual: Optional[torch.Tensor],
               rotary: Optional[tuple] = None) -> tuple[torch.Tensor, torch.Tensor]:
        """The add and norm write x's int8 blocks (one launch), then the dots."""
        from ..kernels.rmsnorm import rms_norm_int8

        if rotary is not None:
            raise ValueError("GGUF blocks take no rotary in their product")
        xq, res_out = rms_norm_int8(x, residual, norm.weight, norm.eps)
        return self.product(layer, x, layer.bias, xq=xq), x if residual is None else res_out

    def gated(self, layer, gate_up: torch.Tensor, bias: Optional[torch.Tensor],
              hidden_act: str) -> torch.Tensor:
        """act(gate) * up written as int8 blocks (one launch), then the dots."""
        from ..kernels.gated_act import act_and_mul_int8

        xq = act_and_mul_int8(gate_up, hidden_act)
        return self.product(layer, gate_up[:, :gate_up.shape[1] // 2], bias, xq=xq)

    def product(self, layer, x: torch.Tensor, bias: Optional[torch.Tensor],
                out_dtype: Optional[torch.dtype] = None,
                xq: Optional[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = None
                ) -> torch.Tensor:
        """``xq``: x already as int8 blocks (``gguf_dot.quantize_rows``' triple, written by
        the op before; only where ``fuses(x)``): x then gives only its shape and dtype."""
        from ..kernels import gguf_dot, gguf_gemv

        k = x.shape[-1]
        y = torch.empty(x.shape[0], layer.out_width, dtype=out_dtype or x.dtype, device=x.device)
        at = 0
        dots = self._dots(x)
        given = xq is not None
        for blocks, ggml_type in zip(layer.blocks, layer.block_types):
            n = blocks.shape[0]
            if dots and ggml_type in gguf_dot.DOTS:
                if xq is None:  # x in 8-bit blocks, for the groups the integer dots read
                    xq = gguf_dot.quantize_rows(x)
                gguf_dot.DOTS[ggml_type](xq, blocks, n, k, out=y[:, at:at + n])
            elif given:  # (a part without dots beside ones with them takes float x)
                raise ValueError("int8 blocks of x given to a product that does not take them")
            elif x.shape[0] <= GEMV_ROWS:
                gguf_gemv.block_gemv(x, blocks, ggml_type, n, k, out=y[:, at:at + n])
            else:
                w = gguf_gemv.dequantize(blocks, ggml_type, n, k, x.dtype)
                y[:, at:at + n] = F.linear(x, w)
            at += n
        return y if bias is None else y.add_(bias)

    @staticmethod
    def held_type(ggml_type: int, k: int) -> "int | str":
        """How a group of ``ggml_type`` rows of ``k`` weights is held: in a layout of the
        same bytes that the dots read as aligned words where one exists for the type and
        row length (``gguf_gemv.REPACKED``: Q6_K's planes, Q8_0's split codes and scales),
        else as the file's blocks."""
        from ..kernels.gguf_gemv import REPACKED

        return next((layout for layout, (source, multiple, _) in REPACKED.items()
                     if ggml_type == source and k % multiple == 0), ggml_type)

    def materialize(self, layer, types: Sequence[int], device: torch.device) -> None:
        from ..kernels.gguf_gemv import FORMATS

        rows, k = layer.weight.shape
        layer.part_types = list(types)
        layer.part_place, sizes = [], []  # per part: (group, first row); per group: rows
        for j, (ggml_type, n) in enumerate(zip(types, layer.part_rows())):
            if j and ggml_type == types[j - 1]:  # the run goes on: rows stacked below
                layer.part_place.append((len(sizes) - 1, sizes[-1]))
                sizes[-1] += n
            else:
                layer.part_place.append((len(sizes), 0))
                sizes.append(n)
        layer.block_types = [self.held_type(types[j], k)
                             for j, (g, first) in enumerate(layer.part_place) if first == 0]
        layer.blocks = []
        for g, (ggml_type, n) in enumerate(zip(layer.block_types, sizes)):
            per, size = FORMATS[ggml_type]
            buf = torch.zeros(n, k // per * size, dtype=torch.uint8, device=device)
            layer.register_buffer(f"blocks{g}", buf, persistent=False)
            layer.blocks.append(buf)
        layer.out_width = rows
        layer.weight = None


class Fp8Method(_GemvMethod):
    @staticmethod
    def scale(layer) -> torch.Tensor:  # the gemv reads e4m3 rows and scales each sum
        return layer.weight_scale

    def target(self, layer, part: int, rows: Optional[slice], shard, stored_shape
               ) -> "WeightTarget":
        from ..models.weight_targets import WeightTarget

        def quantize(value: torch.Tensor, rows: Optional[slice]) -> None:
            from ..kernels.fp8_linear import quantize_weight

            q, scale = quantize_weight(value.to(layer.weight.device))
            span = slice(None) if rows is None else rows
            layer.weight[span] = q
            layer.weight_scale[span] = scale

        return WeightTarget(layer.weight, rows, shard=shard, quantize=quantize, by_method=True)

    def product(self, layer, x: torch.Tensor, bias: Optional[torch.Tensor],
                out_dtype: Optional[torch.dtype] = None) -> torch.Tensor:
        if layer.policy.gemv_rows(x):
            return layer.gemv(x, layer.weight, bias, out_dtype=out_dtype, scale=layer.weight_scale)
        from ..kernels.fp8_linear import scaled_linear

        return scaled_linear(x, layer.weight, layer.weight_scale, bias, out_dtype)

    def materialize(self, layer, types: Sequence[int], device: torch.device) -> None:
        rows, k = layer.weight.shape
        layer.weight = nn.Parameter(torch.zeros(rows, k, device=device, dtype=torch.float8_e4m3fn),
                                    requires_grad=False)
        layer.weight_scale = nn.Parameter(torch.ones(rows, device=device), requires_grad=False)


DENSE, GGUF_BLOCKS, FP8_ROWS = DenseMethod(), GGUFBlockMethod(), Fp8Method()


def materialize(model: nn.Module, stored_types: dict[str, "int | str"], device: torch.device
                ) -> None:
    """Give every linear layer whose weight ``deferred_weights`` left on the meta device
    its method (``KernelPolicy.linear_method``, from the stored types of the checkpoint
    tensors that fill it: ``stored_types``, HF name -> GGML type of a block tensor or
    ``FP8``) and
    its storage. A layer filled through a transform (rows regrouped, a transpose) stays
    dense: only whole rows or block columns of a file's tensor can be copied as blocks;
    so does one whose family builds a target of its own (whose weight it reads itself)."""
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
            plain &= target.by_method and target.transform is None
            j = layer.part_of(target.rows)
            if j is None:
                plain = False
            else:
                by_part[j] = stored_types.get(name)
        method = layer.policy.linear_method(by_part if plain else [None])
        method.materialize(layer, by_part, device)
        layer.method = method
