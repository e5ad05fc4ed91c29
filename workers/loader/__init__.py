"""Fill a model's parameters from its checkpoint: safetensors, GGUF or dummy weights."""

from __future__ import annotations

from typing import TYPE_CHECKING

from pocketllm.config import EngineArgs
from pocketllm.errors import CheckpointError
from pocketllm.model_info import ModelInfo

if TYPE_CHECKING:
    from ..models.base import CausalLM


def stored_weight_types(info: ModelInfo, args: EngineArgs) -> dict[str, int]:
    """HF name -> GGML block type of each tensor the checkpoint stores in blocks (read from
    the GGUF header, before any weight), which lets layers keep those weights as stored.
    Empty with ``dequantize_weights``: every layer then builds float parameters."""
    if args.dequantize_weights:
        return {}
    if args.load_format == "dummy":
        if args.quantization is None:
            return {}
        from .dummy_blocks import dummy_block_types
        from ..models.registry import checkpoint_shapes

        return dummy_block_types(args.quantization, checkpoint_shapes(info),
                                 int(info.hf_config["num_hidden_layers"]))
    if info.format == "gguf":
        from .gguf import gguf_block_types

        return gguf_block_types(info.path, info)
    return {}


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

        init_dummy_weights(model, args.seed)
    elif fmt == "safetensors":
        from .safetensors import load_safetensors_weights

        # lazy: each rank reads only its part of each tensor
        model.load_weights(tracked(load_safetensors_weights(info.path, lazy=True)))
    elif fmt == "gguf":
        from .gguf import load_gguf_weights  # one tensor dequantized at a time, then sliced

        model.load_weights(tracked(load_gguf_weights(info.path, info)))
    else:
        raise CheckpointError(f"unknown checkpoint format {fmt!r}")
