"""FP8 (e4m3) checkpoints, read and dequantized at load: weight-only, every device.

A checkpoint says how its weights are stored in ``quantization_config``:

* ``quant_method: "fp8"`` (DeepSeek-V3, Qwen3-*-FP8): each quantized matrix is
  ``*.weight`` in float8_e4m3fn beside ``*.weight_scale_inv`` (float32): one scale per
  ``weight_block_size`` block (128 x 128, the edge blocks partial), or one per tensor;
  w = q * scale.
* ``quant_method: "compressed-tensors"`` with 8-bit float weights: ``*.weight`` beside
  ``*.weight_scale``, per tensor ([1]), per output channel ([rows, 1]) or per block.
  Static activation scales (``*.input_scale``) are not used: activations stay in the
  model dtype.

Each matrix is expanded to float32 as its pair arrives (in either order; a pair split
across shard files waits for its other half), then loaded as a float checkpoint's. So an
FP8 checkpoint serves with the float model's memory and speed; FP8 kept in GPU memory and
multiplied on FP8 tensor cores is a linear method still to come (issue 36). Any other
``quant_method`` is refused by name (gpt-oss's ``mxfp4`` is its family's own).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Iterable, Iterator, Optional

import torch

from pocketllm.errors import CheckpointError, UnsupportedFeatureError

logger = logging.getLogger("pocketllm.worker")

# Handled by a family of their own (models/gpt_oss.py)
FAMILY_METHODS = ("mxfp4",)


@dataclass(frozen=True)
class Fp8Scheme:
    scale_suffix: str  # the scale tensor beside each "<prefix>.weight": "weight_scale_inv" | "weight_scale"
    block: Optional[tuple[int, int]]  # (rows, cols) a scale covers; None: per tensor or channel


def fp8_scheme(hf_config: dict) -> Optional[Fp8Scheme]:
    """The checkpoint's FP8 storage, None for a float checkpoint; UnsupportedFeatureError
    for any other quantization."""
    q = hf_config.get("quantization_config")
    if not q:
        return None
    method = q.get("quant_method") if isinstance(q, dict) else None
    if method in FAMILY_METHODS:
        return None
    if method == "fp8":
        if q.get("fmt", "e4m3") != "e4m3":
            raise UnsupportedFeatureError(f"quantization_config: FP8 format {q.get('fmt')!r} "
                                          "(only e4m3 weights are read)")
        return Fp8Scheme("weight_scale_inv", _block(q.get("weight_block_size")))
    if method == "compressed-tensors":
        blocks = set()
        for name, group in (q.get("config_groups") or {}).items():
            w = (group or {}).get("weights") or {}
            if w.get("type") != "float" or w.get("num_bits") != 8:
                raise UnsupportedFeatureError(
                    f"quantization_config: compressed-tensors group {name!r} stores "
                    f"{w.get('num_bits')}-bit {w.get('type')} weights (only 8-bit float, FP8, "
                    "is read)")
            blocks.add(_block(w.get("block_structure")) if w.get("strategy") == "block" else None)
        if len(blocks) != 1:
            raise UnsupportedFeatureError("quantization_config: compressed-tensors needs one "
                                          "FP8 weight group")
        return Fp8Scheme("weight_scale", blocks.pop())
    raise UnsupportedFeatureError(
        f"quantization_config.quant_method={method!r} is not supported (FP8 checkpoints, "
        "'fp8' and 'compressed-tensors', are; or serve a bfloat16 or GGUF version)")


def _block(size) -> Optional[tuple[int, int]]:
    if size is None:
        return None
    if (not isinstance(size, (list, tuple)) or len(size) != 2
            or not all(isinstance(n, int) and n > 0 for n in size)):
        raise CheckpointError(f"quantization_config: FP8 block size {size!r} is not two "
                              "positive integers")
    return int(size[0]), int(size[1])


def dequantize_fp8(q: torch.Tensor, scale: torch.Tensor, block: Optional[tuple[int, int]],
                   name: str = "") -> torch.Tensor:
    """float32 weights of an e4m3 matrix and its scales (one per block, per channel or
    per tensor)."""
    w, scale = q.float(), scale.float()
    if block is not None:
        rows, cols = w.shape
        grid = (-(-rows // block[0]), -(-cols // block[1]))
        if tuple(scale.shape) != grid:
            raise CheckpointError(f"{name}: {tuple(scale.shape)} scales for a {rows} x {cols} "
                                  f"matrix in blocks of {block[0]} x {block[1]} (want {grid})")
        scale = scale.repeat_interleave(block[0], 0)[:rows].repeat_interleave(block[1], 1)[:, :cols]
    elif scale.numel() not in (1, w.shape[0]):
        raise CheckpointError(f"{name}: {scale.numel()} scales for {w.shape[0]} rows "
                              "(want one, or one per row)")
    else:
        scale = scale.reshape(-1, 1) if scale.numel() > 1 else scale.reshape(())
    return w * scale


def dequantized(tensors: Iterable, scheme: Fp8Scheme) -> Iterator[tuple[str, object]]:
    """``tensors`` (HF name, tensor or lazy slice) with each FP8 matrix and its scale
    replaced by the float32 matrix under the matrix's name; everything else as it comes."""
    weights: dict[str, torch.Tensor] = {}
    scales: dict[str, torch.Tensor] = {}
    suffix = "." + scheme.scale_suffix
    skipped = 0
    for name, t in tensors:
        if name.endswith(".input_scale"):
            skipped += 1
            continue
        if name.endswith(suffix):
            key = name[:-len(suffix)] + ".weight"
            scales[key] = _read(t)
        elif _is_fp8(t):
            key = name
            weights[key] = _read(t)
        else:
            yield name, t
            continue
        if key in weights and key in scales:
            yield key, dequantize_fp8(weights.pop(key), scales.pop(key), scheme.block, key)
    if skipped:
        logger.info("FP8 checkpoint: %d static activation scales not used (activations stay "
                    "in the model dtype)", skipped)
    for key in weights:
        raise CheckpointError(f"FP8 tensor {key!r} has no {scheme.scale_suffix} beside it")
    for key in scales:
        raise CheckpointError(f"{key[:-len('.weight')]}.{scheme.scale_suffix} scales no FP8 "
                              "weight")


def _is_fp8(t) -> bool:
    dtype = getattr(t, "dtype", None)
    return dtype in (torch.float8_e4m3fn, "F8_E4M3")


def _read(t) -> torch.Tensor:
    return t if isinstance(t, torch.Tensor) else t.read()
