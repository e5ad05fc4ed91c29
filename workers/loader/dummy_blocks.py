"""Random weights in GGUF block types (``load_format="dummy"`` with ``quantization=``), so a
quantized model of a shipped shape can be benchmarked without its file.

A quantization names one block type for every matrix (``q8_0``, ``q4_k``, ...) or a mix
as llama.cpp's quantizer writes it (``q4_k_m``, ``q5_k_m``). The blocks are random bytes
with their scale fields set so that the decoded values have a spread near the float
dummy's (std ~0.02): what a decode step reads and computes is a real file's, the values
are noise.
"""

from __future__ import annotations

import numpy as np

from pocketllm.config import QUANTIZATIONS
from pocketllm.errors import InvalidRequestError

from .block_tensor import BlockTensor
from .gguf_quants import GGML_TYPES

_TYPE_IDS = {name.lower(): ggml_type for ggml_type, (name, *_rest) in GGML_TYPES.items()}
# llama.cpp's _M mixes: the base type, and a larger one for the tensors quantization hurts most
MIXES = {"q4_k_m": ("q4_k", "q6_k"), "q5_k_m": ("q5_k", "q6_k")}

# Per type: byte offsets of its fp16 scale fields (d, then the min's scale if it has one),
# the d that gives decoded values a spread near 0.02 (its integer codes times sub-scales),
# and the min's scale as a multiple of d that centres the values near 0 (the mean code;
# negative where the min is added, as in q4_1, rather than subtracted, as in q4_k).
SCALE_FIELDS = {
    "q4_0": ((0,), 0.02 / 4.6, 0), "q4_1": ((0, 2), 0.02 / 4.6, -7.5),
    "q5_0": ((0,), 0.02 / 9.2, 0), "q5_1": ((0, 2), 0.02 / 9.2, -15.5),
    "q8_0": ((0,), 0.02 / 74.0, 0), "q2_k": ((80, 82), 0.02 / 8.0, 1.5),
    "q3_k": ((108,), 0.02 / 64.0, 0), "q4_k": ((0, 2), 0.02 / 150.0, 7.5),
    "q5_k": ((0, 2), 0.02 / 300.0, 15.5), "q6_k": ((208,), 0.02 / 1200.0, 0),
    "iq4_nl": ((0,), 0.02 / 70.0, 0), "iq4_xs": ((0,), 0.02 / 1200.0, 0),
}


def _uses_more_bits(layer: int, layers: int) -> bool:
    # the first and last eighth of the layers, and every third one between
    return layer < layers // 8 or layer >= 7 * layers // 8 or (layer - layers // 8) % 3 == 2


def _fits(type_name: str, cols: int) -> str:
    """``type_name``, or Q8_0 where a row does not split into its blocks (as llama.cpp does
    for a k-quant of a row that is not a multiple of 256)."""
    return type_name if cols % GGML_TYPES[_TYPE_IDS[type_name]][1] == 0 else "q8_0"


def dummy_block_types(quantization: str, shapes: dict[str, tuple[int, ...]], num_layers: int
                      ) -> dict[str, int]:
    """HF name -> GGML type for every matrix of ``shapes`` (name -> checkpoint shape) under
    ``quantization``; vectors (norms, biases) stay float."""
    assert quantization in QUANTIZATIONS, quantization  # EngineArgs checked it
    base, more = MIXES.get(quantization, (quantization, quantization))
    types = {}
    for name, shape in shapes.items():
        if len(shape) != 2 or not name.endswith(".weight") or name.endswith(".mlp.gate.weight"):
            continue  # llama.cpp leaves an MoE router (ffn_gate_inp) in float
        chosen = base
        if name == "lm_head.weight" or (name == "model.embed_tokens.weight"
                                        and "lm_head.weight" not in shapes):
            chosen = more if quantization in MIXES else base  # the output matrix
        elif name.endswith(("self_attn.v_proj.weight", "down_proj.weight")):  # experts' too
            layer = int(name.split(".")[2])
            chosen = more if _uses_more_bits(layer, num_layers) else base
        if shape[1] % 32:
            raise InvalidRequestError(f"quantization={quantization!r}: {name} has {shape[1]} "
                                      "input features, not a multiple of 32", "quantization")
        types[name] = _TYPE_IDS[_fits(chosen, shape[1])]
    return types


def random_block_tensor(ggml_type: int, shape: tuple[int, int], rng: np.random.Generator
                        ) -> BlockTensor:
    """A (rows, cols) matrix of ``ggml_type`` blocks of random bytes with sane scales."""
    name, block_elems, block_bytes = GGML_TYPES[ggml_type]
    rows, cols = shape
    n_blocks = rows * (cols // block_elems)
    raw = rng.integers(0, 256, size=(n_blocks, block_bytes), dtype=np.uint8)
    offsets, d, centre = SCALE_FIELDS[name.lower()]
    for offset, value in zip(offsets, (d, centre * d)):
        raw[:, offset:offset + 2] = np.full((n_blocks, 1), value, np.float16).view(np.uint8)
    return BlockTensor(ggml_type, shape, raw.reshape(rows, cols // block_elems * block_bytes))

