"""Fill a model's parameters from its checkpoint: safetensors, GGUF or dummy weights."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from pocketllm.config import EngineArgs
from pocketllm.errors import CheckpointError
from pocketllm.model_info import ModelInfo

if TYPE_CHECKING:
    from ..models.base import CausalLM

logger = logging.getLogger("pocketllm.worker")


def load_model_weights(model: "CausalLM", info: ModelInfo, args: EngineArgs,
                       show_progress: bool = False) -> None:
    fmt = "dummy" if args.load_format == "dummy" else info.format

    def tracked(tensors):
        if not show_progress:
            return tensors
        from .progress import with_progress

        return with_progress(tensors, len(model.weight_targets()))

    if fmt == "dummy":
        from .dummy import init_dummy_weights

        from ..models.base import block_buffers

        if args.quantization not in (None, "fp8") and not block_buffers(model):
            logger.warning("quantization=%s: this worker draws float weights of the model's "
                           "shapes (random blocks are the GPU block kernels' and the torch-free "
                           "CPU worker's)", args.quantization)

        init_dummy_weights(model, args.seed)
    elif fmt == "safetensors":
        from .safetensors import load_safetensors_weights

        from .fp8 import dequantized, fp8_scheme

        # lazy: each rank reads only its part of each tensor
        tensors = load_safetensors_weights(info.path, lazy=True)
        fp8 = fp8_scheme(info.hf_config)
        if fp8 is not None:
            logger.info("FP8 weights (scales %s) are read as float32: each layer stores them "
                        "as its method holds them (e4m3 rows on an FP8 GPU, else %s)",
                        "of %d x %d blocks" % fp8.block if fp8.block else "per tensor or row",
                        args.dtype)
            tensors = dequantized(tensors, fp8)
        model.load_weights(tracked(tensors))
    elif fmt == "gguf":
        from .gguf import load_gguf_weights  # one tensor dequantized at a time, then sliced

        model.load_weights(tracked(load_gguf_weights(info.path, info)))
    else:
        raise CheckpointError(f"unknown checkpoint format {fmt!r}")
