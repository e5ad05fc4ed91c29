"""Weights from a GGUF file, HuggingFace-named in HF shapes: float tensors as float32
numpy arrays, block-quantized ones as ``BlockTensor``s (the file's bytes, mapped, not
decoded). No torch here: the torch-free worker (``workers/lite``) reads files this way too.

llama.cpp's converter renames every tensor (the names are the family's, in
``pocketllm/families.py``) and changes two things on the way; this undoes both so
the values equal the HF checkpoint's:

* ``gguf_permuted_qk`` (llama): the rows of q/k are permuted per head so that llama.cpp
  can rotate adjacent pairs (x0, y0, x1, y1, ...) where HF rotates halves
  (x0..x_{d/2-1}, y0..). ``unpermute_rope_rows`` restores the halves.
* ``gguf_norm_offset`` (gemma3): Gemma's RMSNorm multiplies by ``1 + w``; the converter
  stores ``w + 1`` so llama.cpp can multiply by the stored value. We subtract 1.

Tensor data is memory-mapped. The torch worker dequantizes a block tensor when it
copies it in (numpy: gguf_quants says why not torch), one tensor at a time.
"""

from __future__ import annotations

import importlib
import logging
import re
from typing import TYPE_CHECKING, Iterator, Optional

import numpy as np

from pocketllm.errors import CheckpointError
from pocketllm.families import BY_NAME, GGUF_DERIVED_TENSORS, GGUF_GLOBAL_TENSORS
from pocketllm.gguf_meta import GGUFTensorInfo, read_gguf_header

from .block_tensor import BlockTensor, block_tensor
from .gguf_quants import GGML_TYPES, SUPPORTED_TYPES, dequantize, type_name

if TYPE_CHECKING:
    from pocketllm.model_info import ModelInfo

logger = logging.getLogger(__name__)

_BLOCK_NAME = re.compile(r"blk\.(\d+)\.([a-z_]+)\.(weight|bias)")


def hf_name(gguf_name: str, family: str) -> str:
    """The HF parameter name of a GGUF tensor; CheckpointError if it is not one we know."""
    if gguf_name in GGUF_GLOBAL_TENSORS:
        return GGUF_GLOBAL_TENSORS[gguf_name]
    m = _BLOCK_NAME.fullmatch(gguf_name)
    names = BY_NAME[family].gguf_tensors
    if m is None or m.group(2) not in names:
        raise CheckpointError(f"GGUF tensor {gguf_name!r} is not part of a {family} model")
    layer, part, kind = m.groups()
    return f"model.layers.{layer}.{names[part]}.{kind}"


def expert_tensors(gguf_name: str, w: "np.ndarray | BlockTensor", family: str
                   ) -> Optional[list[tuple[str, "np.ndarray | BlockTensor"]]]:
    """A layer's stacked experts [E, rows, cols] split into (HF name, one expert's matrix),
    views of the mapped file; None if ``gguf_name`` is not a stacked expert tensor."""
    m = _BLOCK_NAME.fullmatch(gguf_name)
    experts = BY_NAME[family].gguf_expert_tensors
    if m is None or m.group(2) not in experts or m.group(3) != "weight":
        return None
    layer, part, _ = m.groups()
    if len(w.shape) != 3:
        raise CheckpointError(f"GGUF tensor {gguf_name!r} has shape {tuple(w.shape)}, "
                              "expected [experts, rows, cols]")
    count, rows = w.shape[0], w.shape[1]
    name = f"model.layers.{layer}.mlp.experts.{{}}.{experts[part]}.weight"
    if isinstance(w, BlockTensor):  # an expert is a run of whole rows of the stack
        return [(name.format(e), BlockTensor(w.ggml_type, tuple(w.shape[1:]),
                                             w.blocks[e * rows:(e + 1) * rows], f"{w.name}[{e}]"))
                for e in range(count)]
    return [(name.format(e), w[e]) for e in range(count)]


def unpermute_rope_rows(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's per-head interleave of q/k rows (its convert script's ``permute``).

    GGUF row ``h*d + 2j + t`` is HF row ``h*d + t*d/2 + j`` (t in {0, 1}).
    """
    half = w.shape[0] // n_heads // 2
    return w.reshape(n_heads, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


FLOAT_TYPES = frozenset({0, 1, 30})  # F32, F16, BF16: loaded as float32 arrays


def _check_type(t: GGUFTensorInfo, path: str) -> None:
    if t.ggml_type not in SUPPORTED_TYPES:
        raise CheckpointError(
            f"{path!r}: tensor {t.name!r} has GGML type {type_name(t.ggml_type)}, which PocketLLM "
            f"cannot dequantize (supported: {', '.join(sorted(type_name(x) for x in SUPPORTED_TYPES))})")


def _read_tensor(data: np.ndarray, t: GGUFTensorInfo, path: str) -> "np.ndarray | BlockTensor":
    _check_type(t, path)
    shape = tuple(reversed(t.shape))  # GGUF lists the fastest-varying dimension first
    if not t.shape:
        raise CheckpointError(f"{path!r}: tensor {t.name!r} has no dimensions")
    if t.ggml_type not in FLOAT_TYPES:
        return block_tensor(data, t.ggml_type, shape, t.offset, t.name, path)
    _, _, elem_bytes = GGML_TYPES[t.ggml_type]
    n_bytes = int(np.prod(t.shape)) * elem_bytes
    if t.offset + n_bytes > data.size:
        raise CheckpointError(f"{path!r} is truncated: tensor {t.name!r} ends past the end of the file")
    return dequantize(data[t.offset:t.offset + n_bytes], t.ggml_type).reshape(shape)


def _unpermuted(w: "np.ndarray | BlockTensor", n_heads: int) -> "np.ndarray | BlockTensor":
    if isinstance(w, BlockTensor):  # whole rows move: the blocks stay as they are
        return w.with_rows(unpermute_rope_rows(np.arange(w.shape[0]), n_heads))
    return unpermute_rope_rows(w, n_heads)


def _hook(path: Optional[str]):
    if path is None:
        return None
    module, _, attribute = path.partition(":")
    return getattr(importlib.import_module(module), attribute)


def load_gguf_weights(path: str, info: "ModelInfo", as_stored: bool = False
                      ) -> Iterator[tuple[str, "np.ndarray | BlockTensor"]]:
    """Yield (HF parameter name, tensor in HF shape) for every tensor of the file: float32
    arrays for float types, ``BlockTensor``s (mapped, not decoded) for block types.
    ``as_stored``: a family hook leaves the file's order of heads as it is (where a
    reader maps it instead: gguf_hybrid.py's tiled value heads)."""
    header = read_gguf_header(path)
    family = BY_NAME[info.family]
    cfg = info.hf_config
    n_heads = int(cfg["num_attention_heads"])
    n_kv_heads = int(cfg.get("num_key_value_heads") or n_heads)
    # copy-on-write: the views are writable for torch.from_numpy, and nothing writes them;
    # one map per file (a split model's parts)
    maps: dict[str, np.memmap] = {}
    hook = _hook(family.gguf_tensor_hook)
    for gguf_name, t in header.tensors.items():
        if gguf_name in GGUF_DERIVED_TENSORS:
            logger.warning("%s: skipping %s (derived from the config, not an HF parameter)",
                           path, gguf_name)
            continue
        file = t.file or path
        if file not in maps:
            maps[file] = np.memmap(file, dtype=np.uint8, mode="c")
        w = _read_tensor(maps[file], t, file)
        mapped = hook(gguf_name, w, cfg, as_stored) if hook is not None else None
        if mapped is not None:  # the family's own mapping (gguf_hybrid.py)
            yield from mapped
            continue
        per_expert = expert_tensors(gguf_name, w, family.name)
        if per_expert is not None:
            yield from per_expert
            continue
        name = hf_name(gguf_name, family.name)
        if family.gguf_permuted_qk and name.endswith(("q_proj.weight", "q_proj.bias")):
            w = _unpermuted(w, n_heads)
        elif family.gguf_permuted_qk and name.endswith(("k_proj.weight", "k_proj.bias")):
            w = _unpermuted(w, n_kv_heads)
        elif family.gguf_norm_offset and name.endswith("norm.weight"):
            w = (w.read() if isinstance(w, BlockTensor) else w) - family.gguf_norm_offset
        yield name, w


def stored_block_types(path: str, info: "ModelInfo") -> dict[str, int]:
    """HF name -> GGML block type of each tensor whose name maps plainly (not a family
    hook's, not a stack of experts), from the header alone: what a model's linear layers
    hold, known before any weight is read (``layers/linear_method.materialize``)."""
    family = BY_NAME[info.family]
    types = {}
    for gguf_name, t in read_gguf_header(path).tensors.items():
        if t.ggml_type in FLOAT_TYPES or gguf_name in GGUF_DERIVED_TENSORS:
            continue
        try:
            types[hf_name(gguf_name, family.name)] = t.ggml_type
        except CheckpointError:  # a hooked or stacked tensor: its layer stays dense
            continue
    return types
