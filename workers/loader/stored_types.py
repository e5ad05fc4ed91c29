"""What each linear weight is held as on this device, known before any weight is read:
the input to ``layers/linear_method.materialize``.

* A GGUF file's blocks (its header names each tensor's type), or ``--quantization``'s
  random blocks of a dummy model, may stay blocks on the GPU path.
* ``--quantization fp8`` holds every linear weight but the LM head in e4m3 with row
  scales (the head's logits stay in the model dtype, as FP8 checkpoints ship it); an FP8
  checkpoint keeps in e4m3 exactly the weights it stores so. Where FP8 cannot stay FP8
  (``KernelPolicy.fp8_refusal``), ``--quantization fp8`` is refused with the reason and an
  FP8 checkpoint is expanded to the model dtype with a one-line warning.
"""

from __future__ import annotations

import logging
from typing import Union

import torch

from pocketllm.config import EngineArgs
from pocketllm.errors import UnsupportedFeatureError
from pocketllm.model_info import ModelInfo

from ..layers.linear_method import FP8

logger = logging.getLogger("pocketllm.worker")

# A stored type: a GGML block type, or FP8
StoredType = Union[int, str]


def stored_types(info: ModelInfo, args: EngineArgs, policy, device: torch.device
                 ) -> dict[str, StoredType]:
    """HF name -> stored type of the checkpoint tensors held other than as floats of the
    model dtype (empty: every layer dense)."""
    if args.dequantize_weights:
        return {}
    if args.quantization == "fp8":
        why = policy.fp8_refusal(device)
        if why is not None:
            raise UnsupportedFeatureError(f"quantization=fp8: {why}", "quantization")
        if args.load_format != "dummy" and info.format != "safetensors":
            raise UnsupportedFeatureError(
                f"quantization=fp8 quantizes a float safetensors checkpoint, not a "
                f"{info.format} file (served in the types it stores)", "quantization")
        return {name: FP8 for name in _linear_weights(info)}
    if args.load_format != "dummy" and info.format == "safetensors":
        from .fp8 import fp8_scheme

        scheme = fp8_scheme(info.hf_config)
        if scheme is None:
            return {}
        why = policy.fp8_refusal(device)
        if why is not None:
            if device.type == "cuda":
                logger.warning("FP8 checkpoint expanded to %s at load: %s", args.dtype, why)
            return {}
        return {name: FP8 for name in _fp8_weights(info.path, scheme)}
    if not policy.keeps_blocks():
        return {}
    if args.load_format == "dummy":
        if args.quantization is None:
            return {}
        from ..models.registry import arch_config, checkpoint_shapes
        from .dummy_blocks import dummy_block_types

        return dummy_block_types(args.quantization, checkpoint_shapes(info),
                                 arch_config(info).num_layers)
    if info.format != "gguf":
        return {}
    from .gguf import stored_block_types

    return stored_block_types(info.path, info)


def _linear_weights(info: ModelInfo) -> list[str]:
    """Every matrix the checkpoint holds but the LM head (only linear layers' take a
    method: embeddings, routers and experts stay as they are)."""
    from ..models.registry import checkpoint_shapes

    return [name for name, shape in checkpoint_shapes(info).items()
            if name.endswith(".weight") and len(shape) == 2 and name != "lm_head.weight"]


def _fp8_weights(path: str, scheme) -> set[str]:
    """The names of the matrices an FP8 checkpoint stores in e4m3: those with a scale
    beside them (from the files' headers; nothing is read)."""
    from .safetensors import load_safetensors_weights

    suffix = "." + scheme.scale_suffix
    return {name[:-len(suffix)] + ".weight"
            for name, _ in load_safetensors_weights(path, lazy=True) if name.endswith(suffix)}
