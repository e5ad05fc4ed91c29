"""MXFP4 (OCP microscaling FP4) tensors, as the released gpt-oss checkpoints store their
experts: dequantized at load into the float tensor transformers' unquantized model holds.

A quantized parameter ``P`` of shape [E, rows, cols] (its HF layout transposed) is stored
as two tensors: ``P_blocks`` uint8 [E, rows, cols / 32, 16], each byte two FP4 (e2m1)
codes, the low nibble first, 32 values per block; and ``P_scales`` uint8
[E, rows, cols / 32], one power-of-two exponent per block, biased by 127. A value is
``FP4[code] * 2 ** (scale - 127)``. The float result is transposed back to the HF
parameter's [E, cols, rows] (``gate_up_proj`` [E, H, 2I], ``down_proj`` [E, I, H]).
"""

from __future__ import annotations

from typing import Iterable, Iterator

import torch

from pocketllm.errors import CheckpointError

# The 16 e2m1 codes: sign bit 3, then exponent and mantissa.
FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
              -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
SUFFIXES = ("_blocks", "_scales")


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """blocks uint8 [..., rows, G, 16] and scales uint8 [..., rows, G] -> float32
    [..., G * 32, rows] (the quantized matrix, transposed back)."""
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise CheckpointError(f"MXFP4 blocks and scales must be uint8, got {blocks.dtype} "
                              f"and {scales.dtype}")
    if blocks.dim() < 3 or blocks.shape[-1] != 16 or blocks.shape[:-1] != scales.shape:
        raise CheckpointError(f"MXFP4 blocks {tuple(blocks.shape)} do not match scales "
                              f"{tuple(scales.shape)} (expected [..., G, 16] and [..., G])")
    lut = torch.tensor(FP4_VALUES, dtype=torch.float32)
    *lead, rows, groups, _ = blocks.shape
    out = torch.empty(*lead, groups * 32, rows, dtype=torch.float32)
    # one expert (leading index) at a time: the code indices of a whole layer of
    # gpt-oss-20b would take gigabytes
    for i, (b, s) in enumerate(zip(blocks.reshape(-1, rows, groups, 16),
                                   scales.reshape(-1, rows, groups))):
        codes = torch.stack((b & 0x0F, b >> 4), dim=-1).int()  # low nibble first
        # times 2 ** (s - 127): exact in float32, as ldexp (and faster)
        values = lut[codes].flatten(-2) * torch.exp2(s.float() - 127).unsqueeze(-1)
        out.view(-1, groups * 32, rows)[i] = values.flatten(-2).T
    return out


def dequantized(named_tensors: Iterable[tuple[str, object]]) -> Iterator[tuple[str, object]]:
    """The checkpoint's tensors with each ``P_blocks``/``P_scales`` pair replaced by ``P``
    in float32, yielded once both parts have arrived (a pair's first part is read and held
    until then); every other tensor passes through untouched."""
    pending: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in named_tensors:
        suffix = next((s for s in SUFFIXES if name.endswith(s)), None)
        if suffix is None:
            yield name, tensor
            continue
        base = name[:-len(suffix)]
        parts = pending.setdefault(base, {})
        parts[suffix] = tensor if isinstance(tensor, torch.Tensor) else tensor.read(None)
        if len(parts) == 2:
            del pending[base]
            yield base, dequantize_mxfp4(parts["_blocks"], parts["_scales"])
    if pending:
        base, parts = next(iter(pending.items()))
        missing = "_scales" if "_blocks" in parts else "_blocks"
        raise CheckpointError(f"MXFP4 tensor {base + missing!r} is missing from the checkpoint "
                              f"(its {base + next(iter(parts))!r} is there)")
