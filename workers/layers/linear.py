"""Linear layers, the token embedding and the LM head, split across tensor-parallel ranks.

* ``ColumnParallelLinear`` holds a slice of the output features (q/k/v heads,
  gate/up columns); it needs no communication. It may stack several checkpoint
  matrices along its output dimension (q/k/v -> qkv, gate/up -> gate_up) so one
  matmul replaces several; each is sliced to this rank's part before stacking.
* ``RowParallelLinear`` holds a slice of the input features (o_proj, down_proj)
  and sums the partial outputs over the ranks: one all_reduce.
* ``VocabParallelEmbedding`` / ``LMHead`` hold a slice of the vocabulary (padded
  so every rank holds the same number of rows); the head's logits are gathered
  on rank 0, which samples.

Which kernel computes a product is the kernel policy's call (``kernel_policy.py``) and
the layer's method's (``linear_method.py``): how the weight is held (``DENSE``: one float
parameter in the model dtype, for float checkpoints and GGUF blocks that nothing reads
in place, dequantized at load by ``BlockTensor.read``; ``FP8``: e4m3 rows and their
scales; ``GGUF_BLOCKS``: a GGUF file's blocks as stored, read by the GPU's block kernels)
and how it is multiplied. On the GPU path a few-row product (a batch-1 decode step) also
takes in the op before it where its method ``fuses(x)``: the RMSNorm (and residual add)
before q/k/v and gate/up (``ColumnParallelLinear.normed``), the gated activation before
the down projection (``RowParallelLinear(hidden_act=)``). The dense and FP8 methods run
the op inside the Triton gemv's launch (``kernels/gemv.py``; the rotary of q/k too,
where ``rotates(x)``); GGUF blocks have the norm or activation kernel write x as the
8-bit blocks their integer dots read, in place of x.

Each layer says, as a ``Shard``, which part of a checkpoint tensor it holds, so a
loader reads only that part. At world 1 every shard is the whole tensor and the
forward passes are exactly the plain ones.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from ..distributed import SINGLE, TPGroup
from ..kernel_policy import policy_for
from .linear_method import DENSE, weight_param
from .norm import RMSNorm


@dataclass(frozen=True)
class Shard:
    """This rank's part of a checkpoint tensor: ``[start, stop)`` along ``dim``, of ``full``."""

    dim: int
    start: int
    stop: int
    full: int

    @property
    def size(self) -> int:
        return self.stop - self.start

    @property
    def whole(self) -> bool:
        return self.start == 0 and self.stop == self.full

    def take(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor if self.whole else tensor.narrow(self.dim, self.start, self.size)


def even_shard(full: int, tp: TPGroup, dim: int = 0) -> Shard:
    """Rank r's r-th equal part (the caller checked that ``full`` divides by the world)."""
    part = full // tp.world
    return Shard(dim, tp.rank * part, (tp.rank + 1) * part, full)


def vocab_shard(vocab_size: int, tp: TPGroup) -> tuple[int, Shard]:
    """Rows each rank holds (the vocabulary padded to a multiple of the world) and this
    rank's real rows; the last rank's slice may be short, or even empty."""
    rows = math.ceil(vocab_size / tp.world)
    start = min(tp.rank * rows, vocab_size)
    return rows, Shard(0, start, min(start + rows, vocab_size), vocab_size)


def _zero_padding(weight: torch.Tensor, valid: int) -> None:
    # Padding rows are never looked up and give zero logits, which rank 0 trims.
    if valid < weight.shape[0] and not weight.is_meta:
        with torch.no_grad():
            weight[valid:].zero_()


def _param(shape: Sequence[int], device: torch.device, dtype: torch.dtype) -> nn.Parameter:
    # Uninitialised: every parameter is filled by a loader (or the dummy init).
    return nn.Parameter(torch.empty(*shape, device=device, dtype=dtype), requires_grad=False)


class ColumnParallelLinear(nn.Module):
    """Output features split across ranks; ``parts`` are this rank's slices (dim 0) of
    the stacked checkpoint matrices, in stacking order."""

    def __init__(self, in_features: int, parts: Sequence[Shard], bias: bool,
                 device: torch.device, dtype: torch.dtype):
        super().__init__()
        self.parts = list(parts)
        self.out_sizes = [p.size for p in self.parts]
        self.in_features = in_features
        self.policy = policy_for(device)
        self.method = DENSE
        self.weight = weight_param((sum(self.out_sizes), in_features), device, dtype)
        self.bias: Optional[nn.Parameter] = (
            _param((sum(self.out_sizes),), device, dtype) if bias else None)
        self.gemv = self.policy.kernel("gemv", "gemv")
        self.norm_gemv = self.policy.kernel("gemv", "norm_gemv")

    def out_rows(self, index: int) -> slice:
        """The rows of ``weight`` that the index-th stacked matrix fills."""
        start = sum(self.out_sizes[:index])
        return slice(start, start + self.out_sizes[index])

    def part_shard(self, index: int) -> Optional[Shard]:
        """What the index-th checkpoint matrix contributes here (None: all of it)."""
        part = self.parts[index]
        return None if part.whole else part

    def part_rows(self) -> list[int]:
        return list(self.out_sizes)

    def part_of(self, rows: Optional[slice]) -> Optional[int]:
        """The stacked part a load target's ``rows`` fill (None: no single one)."""
        spans = [self.out_rows(j) for j in range(len(self.parts))]
        if rows is None:
            return 0 if len(spans) == 1 else None
        return spans.index(rows) if rows in spans else None

    def part_target(self, index: int):
        """The load target of the index-th checkpoint matrix (its method's)."""
        shard = self.part_shard(index)
        full = shard.full if shard is not None else self.out_sizes[index]
        return self.method.target(self, index, self.out_rows(index), shard,
                                  (full, self.in_features))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.method.product(self, x, self.bias)

    def fuses(self, x: torch.Tensor) -> bool:
        """Whether ``normed`` takes the norm into the product's launches for x's rows
        (its method's call: the gemv's rows, or the GGUF blocks' integer dots)."""
        return self.method.fuses(self, x)

    def rotates(self, x: torch.Tensor) -> bool:
        """Whether ``normed`` can also rotate q/k for x's rows (``rotary``)."""
        return self.method.rotates and self.method.fuses(self, x)

    def normed(self, norm: RMSNorm, x: torch.Tensor, residual: Optional[torch.Tensor],
               rotary: Optional[tuple] = None) -> tuple[torch.Tensor, torch.Tensor]:
        """``(self(norm(x + residual)), x + residual)``, or with no residual yet
        ``(self(norm(x)), x)``: a pre-norm sublayer's entry, the norm fused where
        ``fuses(x)``. ``rotary`` (only where ``rotates(x)``): see ``kernels.gemv.norm_gemv``."""
        if self.fuses(x):
            return self.method.normed(self, norm, x, residual, rotary)
        if rotary is not None:
            raise ValueError("rotary is fused only into a gemv projection on the GPU path")
        h, residual = norm.add(x, residual) if residual is not None else (norm(x), x)
        return self(h), residual


class RowParallelLinear(nn.Module):
    """Input features split across ranks (``in_shard``, dim 1); the outputs are summed."""

    def __init__(self, in_shard: Shard, out_features: int, bias: bool, device: torch.device,
                 dtype: torch.dtype, tp: TPGroup = SINGLE):
        super().__init__()
        self.in_shard, self.tp = in_shard, tp
        self.out_features = out_features
        self.policy = policy_for(device)
        self.method = DENSE
        self.weight = weight_param((out_features, in_shard.size), device, dtype)
        # The bias is added once, after the sum, so every rank holds all of it.
        self.bias: Optional[nn.Parameter] = _param((out_features,), device, dtype) if bias else None
        self.gemv = self.policy.kernel("gemv", "gemv")
        self.gated_gemv = self.policy.kernel("gemv", "gated_gemv")

    def weight_shard(self) -> Optional[Shard]:
        return None if self.in_shard.whole else self.in_shard

    def part_rows(self) -> list[int]:
        return [self.out_features]

    def part_of(self, rows: Optional[slice]) -> Optional[int]:
        return 0 if rows is None else None

    def part_target(self, index: int = 0):
        return self.method.target(self, 0, None, self.weight_shard(),
                                  (self.out_features, self.in_shard.full))

    def fuses(self, x: torch.Tensor) -> bool:
        """Whether ``[gate | up]`` rows x can take their activation inside the product's
        launches (``hidden_act``; its method's call, as ``ColumnParallelLinear.fuses``)."""
        return self.method.fuses(self, x)

    def forward(self, x: torch.Tensor, hidden_act: str = "", reduce: bool = True) -> torch.Tensor:
        """x @ W.T (+ bias). With ``hidden_act`` (only where ``fuses(x)``), x is
        ``[gate | up]`` rows and the input is their ``act(gate) * up`` (the GPU path's fused
        MLP tail: the gemv's prologue, or the activation writing the GGUF dots' int8 x).
        ``reduce=False``: this rank's partial sum, the all-reduce left to the caller
        (who sums it with another partial first; no bias then)."""
        if self.tp.world == 1:
            return self._product(x, self.bias, hidden_act)
        if not reduce:
            if self.bias is not None:
                raise ValueError("a partial sum has no bias: it is added after the all-reduce")
            return self._product(x, None, hidden_act)
        out = self.tp.all_reduce(self._product(x, None, hidden_act))
        return out if self.bias is None else out + self.bias

    def _product(self, x: torch.Tensor, bias: Optional[torch.Tensor], hidden_act: str
                 ) -> torch.Tensor:
        if hidden_act:
            return self.method.gated(self, x, bias, hidden_act)
        return self.method.product(self, x, bias)


class VocabParallelEmbedding(nn.Module):
    """Token embedding over this rank's vocabulary rows, optionally scaled (Gemma multiplies
    by sqrt(hidden_size)). Ids outside the slice give zeros; the sum over ranks fills them."""

    def __init__(self, vocab_size: int, hidden_size: int, device: torch.device,
                 dtype: torch.dtype, scale: Optional[float] = None, tp: TPGroup = SINGLE):
        super().__init__()
        self.tp = tp
        self.rows, self.shard = vocab_shard(vocab_size, tp)
        self.vocab_start, self.num_valid = self.shard.start, self.shard.size
        self.weight = _param((self.rows, hidden_size), device, dtype)
        _zero_padding(self.weight, self.num_valid)
        # The scale is rounded to the model dtype first, as the reference does.
        self.scale = None if scale is None else torch.tensor(scale, dtype=dtype).item()

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp.world == 1:
            x = self._lookup(input_ids)
        else:
            local = input_ids - self.vocab_start
            outside = (local < 0) | (local >= self.num_valid)
            x = self._lookup(local.masked_fill(outside, 0))
            x = self.tp.all_reduce(x.masked_fill_(outside.unsqueeze(-1), 0))
        return x if self.scale is None else x * self.scale

    def _lookup(self, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, self.weight)

    def unread_bytes(self) -> int:
        """Bytes of the table a one-token step does not read: all rows but the one it looks
        up (unless the LM head shares the table: ``CausalLM.step_read_bytes``)."""
        return self.weight.nbytes - self.weight.nbytes // self.weight.shape[0]


class LMHead(nn.Module):
    """hidden -> vocabulary logits (float32), optionally soft-capped; may share the embedding.

    Each rank computes the logits of its vocabulary slice; rank 0 gathers and joins
    them. ``forward`` returns None on the other ranks (they do not sample).
    """

    def __init__(self, hidden_size: int, vocab_size: int, device: torch.device,
                 dtype: torch.dtype, tied_to: Optional[VocabParallelEmbedding] = None,
                 softcap: Optional[float] = None, tp: TPGroup = SINGLE):
        super().__init__()
        self.tied_to, self.softcap, self.tp, self.vocab_size = tied_to, softcap, tp, vocab_size
        self.hidden_size = hidden_size
        self.weight: Optional[nn.Parameter] = None
        self.policy = policy_for(device)
        self.method = DENSE
        if tied_to is None:  # the same vocabulary split as the embedding
            self.rows, self.shard = vocab_shard(vocab_size, tp)
            self.weight = weight_param((self.rows, hidden_size), device, dtype)
            _zero_padding(self.weight, self.shard.size)
        else:
            self.rows, self.shard = tied_to.rows, None
        self.gemv = self.policy.kernel("gemv", "gemv")

    def part_rows(self) -> list[int]:
        return [self.rows]

    def part_of(self, rows: Optional[slice]) -> Optional[int]:
        return 0 if rows is None or rows == slice(0, self.shard.size) else None

    def part_target(self, index: int = 0):
        """The padded vocabulary: only the first shard.size rows are real."""
        whole = self.shard.whole and self.shard.size == self.rows
        return self.method.target(self, 0, None if whole else slice(0, self.shard.size),
                                  None if self.shard.whole else self.shard,
                                  (self.vocab_size, self.hidden_size))

    def forward(self, hidden: torch.Tensor) -> Optional[torch.Tensor]:
        if self.tied_to is not None:  # the embedding's table: dense
            logits = DENSE.product(self, hidden, None, torch.float32, weight=self.tied_to.weight)
        else:
            logits = self.method.product(self, hidden, None, torch.float32)
        if self.softcap is not None:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        if self.tp.world == 1:
            return logits
        parts = self.tp.gather_to_first(logits)
        if parts is None:
            return None
        return torch.cat(parts, dim=-1)[:, :self.vocab_size]


# The layers a linear method serves (``linear_method.materialize``)
LINEAR_LAYERS = (ColumnParallelLinear, RowParallelLinear, LMHead)
