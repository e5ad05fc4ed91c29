"""Steps holding a prefill chunk under piecewise CUDA graphs.

Such a step cannot replay one whole-forward graph: its attention depends on how
many sequences of what lengths it holds. Nothing else does. Each piece between
two attention calls (``CausalLM.segment``: a layer's output projection, MLP and
norms, then the next layer's norm, q/k/v projection and rotary) depends only on
the token count. So every rung of a token-count ladder captures
``num_layers + 1`` graphs; a step pads its tokens to a rung, replays the pieces
in order, and runs each layer's attention eagerly between them over its real
rows only. An eager step of an 8B model spends tens of milliseconds launching
hundreds of kernels per layer from Python; here it launches one graph per layer
plus the attention's few kernels.

The pieces hand their results to each other through static buffers (q, k, v,
the residual, the attention rows, the rotary rows), so the rungs' graphs share
one memory pool and hold nothing per piece. A padded row reads token 0 at
position 0 and is never attended to or sampled.
"""

from __future__ import annotations

import logging
import time
from typing import Callable, Optional, Sequence

import torch

from .cuda_graphs import capture_cuda_graph, capture_ladder, smallest_rung, write_inputs
from .models.base import CausalLM, Segment, as_group_metas

logger = logging.getLogger("pocketllm.worker")

CAPTURE_BUDGET_S = 60.0  # startup stops adding rungs past this (on top of the decode graphs')


def token_ladder(max_tokens: int) -> list[int]:
    """8, 16, 32, 64, 128, 192, 256, then every 128 up to 2048 and every 256 after."""
    rungs, t = [8, 16, 32, 64, 128, 192, 256], 256
    while t < max_tokens:
        t += 128 if t < 2048 else 256
        rungs.append(t)
    return sorted({min(r, max_tokens) for r in rungs})


class MixedGraphs:
    """``capture(fn, pool) -> graph`` records ``fn`` into an object with ``replay()`` and
    ``pool()`` (tests pass one that reruns ``fn``: CUDA graphs need a GPU)."""

    def __init__(self, model: CausalLM, kv_caches: list, max_model_len: int,
                 device: torch.device, max_tokens: int,
                 capture: Callable = capture_cuda_graph):
        self.model, self.kv_caches, self.max_model_len = model, kv_caches, max_model_len
        rungs = token_ladder(max_tokens)
        t = rungs[-1]

        def buffer(*shape, dtype=model.dtype):
            return torch.zeros(t, *shape, dtype=dtype, device=device)

        def like(x: torch.Tensor) -> torch.Tensor:
            return buffer(*x.shape[1:], dtype=x.dtype)

        self.input_ids, self.positions = buffer(dtype=torch.long), buffer(dtype=torch.long)
        self.attn = buffer(*model.layers[0].self_attn.output_shape)
        self.residual = buffer(model.cfg.hidden_size)
        self.hidden = buffer(model.cfg.hidden_size)
        # The buffers take the shapes the first piece hands on (q/k/v heads, or an MLA
        # layer's query parts and latent rows). This also grows the rotary tables to
        # max_model_len, as the pieces expect them.
        first = model.embed(self.input_ids, self.positions, max_model_len - 1)
        self.qkv = tuple(like(x) for x in first.qkv)
        self.rope = {kind: (like(cos), like(sin)) for kind, (cos, sin) in first.rope.items()}
        self.graphs: dict[int, list] = {}
        self._capture(rungs, capture)
        self.token_counts = sorted(self.graphs)  # the rungs captured, ascending

    def rung(self, tokens: int) -> int:
        """The captured token count a step of ``tokens`` rows pads to (0: none fits)."""
        return smallest_rung(self.token_counts, tokens)

    # ------------------------------------------------------------------ pieces

    def _static(self, t: int) -> Segment:
        return Segment({k: (cos[:t], sin[:t]) for k, (cos, sin) in self.rope.items()},
                       self.residual[:t], tuple(buf[:t] for buf in self.qkv))

    def _piece(self, index: int, t: int) -> None:
        """Piece ``index`` over the first ``t`` rows, static buffers in and out."""
        if index == 0:
            seg = self.model.embed(self.input_ids[:t], self.positions[:t], self.max_model_len - 1)
            for kind, (cos, sin) in seg.rope.items():
                self.rope[kind][0][:t].copy_(cos)
                self.rope[kind][1][:t].copy_(sin)
        else:
            seg = self.model.segment(index, self.attn[:t], self._static(t))
        if seg.hidden is not None:
            self.hidden[:t].copy_(seg.hidden)
            return
        self.residual[:t].copy_(seg.residual)
        for buf, x in zip(self.qkv, seg.qkv):
            buf[:t].copy_(x)

    def _capture(self, rungs: Sequence[int], capture: Callable) -> None:
        pieces = len(self.model.layers) + 1
        started = time.perf_counter()
        for index in range(pieces):  # compiles the kernels before any capture
            self._piece(index, rungs[-1])

        def capture_rung(t: int, pool):
            graphs = []
            for index in range(pieces):
                graphs.append(capture(lambda index=index, t=t: self._piece(index, t), pool))
                pool = graphs[-1].pool()
            return graphs, pool

        self.graphs.update(capture_ladder(
            rungs, capture_rung, started, CAPTURE_BUDGET_S,
            "piecewise CUDA graph capture stopped after %.0fs: steps under %d tokens pad up "
            "to the next captured size"))
        logger.info("captured %d x %d piecewise CUDA graphs (%d..%d tokens) in %.1fs",
                    len(self.graphs), pieces, min(self.graphs, default=0),
                    max(self.graphs, default=0), time.perf_counter() - started)

    # ------------------------------------------------------------------ a step

    def run(self, input_ids: list[int], positions: list[int], meta, rung: int,
            pending: Optional[tuple[torch.Tensor, torch.Tensor]] = None) -> torch.Tensor:
        """Hidden states [len(input_ids), hidden] of one step, as ``CausalLM.forward``
        gives them (``meta``: per KV cache group, as it takes them). ``pending``: (rows, tokens) already on the device, written over those
        input rows."""
        n = len(input_ids)
        write_inputs(self.input_ids, self.positions, input_ids, positions, pending)
        if n < rung:
            self.input_ids[n:rung].zero_()
            self.positions[n:rung].zero_()
        graphs = self.graphs[rung]
        graphs[0].replay()
        metas = as_group_metas(meta)
        for i, layer in enumerate(self.model.layers):
            layer.self_attn.attend(*(buf[:n] for buf in self.qkv),
                                   metas[self.model.layer_group[i]], self.kv_caches[i],
                                   out=self.attn[:n])
            graphs[i + 1].replay()
        return self.hidden[:n]
