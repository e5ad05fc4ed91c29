"""Routed experts (Qwen3-MoE's, Qwen3.5-MoE's) for the torch-free worker: a layer's router
and its experts' block parts, bound once for both of its paths, and Qwen3.5-MoE's shared
expert (its output scaled by sigmoid(h . w) and added to the routed sum).

* **The decode stack** (``pq_decoder_stack``, fewer than ``stack_rows`` rows) runs them
  in C: ``desc`` is the layer's ``pq_layer_experts`` (router float32 [count, hidden],
  expert e's [gate | up] the parts ``gate_up[2e], gate_up[2e + 1]``, its down
  ``down[e]``), and ``layer.c`` routes each row and multiplies each (token, expert) pair
  as a run of its own, 64 pairs a call: any number of rows, a prompt's included.
* **A long step** (``prefill.py``) calls ``__call__``: the same rule, with the pairs
  sorted by expert into a run per expert hit, so an expert's weights are read once for
  all its rows.

Both compute what ``layer.c``'s ``experts_mlp`` computes, to float rounding: softmax over
the router's float32 logits, the ``top_k`` largest logits kept in descending order (ties:
the lower expert), their probabilities divided by their sum when ``renormalize``; each
pair's ``down(act(gate) * up)``; each token's k rows scaled by their weights and summed
in the order chosen.
"""

from __future__ import annotations

import ctypes
from typing import Optional

import numpy as np

from pocketllm.errors import CheckpointError, UnsupportedFeatureError

from ..kernels import cpu_lib
from ..kernels.cpu_lib import Experts, Part
from ..models.config import ACTIVATION_KINDS

MAX_PARTS = 128  # PQ_MAX_PARTS (cpu_quant.h): the most parts one library call takes
# The families whose experts the library computes, and their routing: layer.c's rule only.
ROUTING = {"qwen3_moe": "softmax_topk", "qwen3_5_moe": "softmax_topk", "qwen3_next": "softmax_topk"}
_PART = ctypes.sizeof(Part)


def experts_refusal(family: str, cfg) -> Optional[str]:
    """Why this MoE config's experts cannot run in the library (None: they can)."""
    m = cfg.moe
    if ROUTING.get(family) != "softmax_topk":
        return f"the {family} family's expert routing"
    if m.router_bias or m.expert_bias:
        return "expert or router biases"
    if m.swiglu_limit is not None or m.hidden_act not in ACTIVATION_KINDS:
        return f"expert activation {m.hidden_act!r}" + (" (clamped)" if m.swiglu_limit else "")
    if cfg.hidden_size % 32:  # layer.c's router dots run 16 lanes; the blocks 32 elements
        return f"hidden size {cfg.hidden_size} (not a multiple of 32)"
    return None


class RoutedExperts:
    """One MoE layer: ``router`` (float32 [count, hidden]); ``gate_up``/``down``: per
    expert, ``model._Bound`` of [gate, up] and of [down] (block parts, no bias)."""

    def __init__(self, lib, router: np.ndarray, gate_up: list, down: list, top_k: int,
                 renormalize: bool, act: int, name: str, shared: Optional[tuple] = None):
        """``shared``: a shared expert's (bound [gate, up], bound [down], gate float32
        [hidden]), or None."""
        count, hidden = len(down), down[0].width  # down: inter -> hidden
        if router.shape != (count, hidden):
            raise UnsupportedFeatureError(f"{name}: a router of shape {router.shape} for "
                                          f"{count} experts of {hidden} inputs")
        if any(b.bias is not None for b in gate_up + down):
            raise UnsupportedFeatureError(f"{name}: expert biases")
        inter = gate_up[0].width // 2  # layer.c: up's columns start at inter
        if any(b.width != 2 * inter or b.parts[1].col != inter for b in gate_up) or any(
                b.width != hidden for b in down):
            raise CheckpointError(f"{name}: experts of unequal shapes")
        self.lib, self.top_k, self.renormalize, self.act = lib, top_k, renormalize, act
        self.router = np.ascontiguousarray(router, dtype=np.float32)
        self.hidden, self.inter = hidden, inter
        self._bound = gate_up + down  # the parts' arrays live as long as this
        self.gate_up = (Part * (2 * count))(*[p for b in gate_up for p in b.parts])
        self.down = (Part * count)(*[b.parts[0] for b in down])
        self.desc = Experts(count, top_k, int(renormalize), self.router.ctypes.data,
                            ctypes.addressof(self.gate_up), ctypes.addressof(self.down))
        self.shared = shared
        if shared is not None:
            s_gate_up, s_down, s_gate = shared
            if s_gate.shape != (hidden,) or s_down.width != hidden:
                raise CheckpointError(f"{name}: a shared expert of another width")
            self._bound += [s_gate_up, s_down]
            self.desc.shared_inter, self.desc.shared_gate = s_gate_up.width // 2, s_gate.ctypes.data
            self.desc.shared_gate_up, self.desc.shared_down = s_gate_up.linear, s_down.linear

    def read_bytes(self) -> int:
        """What a one-token step reads: the router and k experts' parts."""
        count = len(self.down)
        per_expert = sum(a.nbytes for a in self._bound[0].arrays + self._bound[count].arrays)
        shared = sum(a.nbytes for b in self._bound[2 * count:] for a in b.arrays)
        return self.router.nbytes + self.top_k * per_expert + shared

    def route(self, h: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """h [T, hidden] -> (weights float32 [T, k], expert ids int64 [T, k])."""
        logits = h @ self.router.T
        ids = np.argsort(-logits, axis=1, kind="stable")[:, :self.top_k]  # ties: lower expert
        e = np.exp(logits - logits.max(axis=1, keepdims=True))
        w = np.take_along_axis(e, ids, axis=1) / e.sum(axis=1, keepdims=True)
        if self.renormalize:
            w /= w.sum(axis=1, keepdims=True)
        return w.astype(np.float32), ids.astype(np.int64)

    def __call__(self, h: np.ndarray, threads: int) -> np.ndarray:
        """The normed rows h [T, hidden] (contiguous float32) through the experts."""
        T, k, E, I = h.shape[0], self.top_k, self.hidden, self.inter
        w, ids = self.route(h)
        flat = ids.reshape(-1)
        order = np.argsort(flat, kind="stable")  # the pairs by expert, token order within
        counts = np.bincount(flat, minlength=len(self.down))
        starts = np.concatenate([[0], np.cumsum(counts)[:-1]])
        runs = [(e, int(starts[e]), int(c)) for e, c in enumerate(counts) if c]
        rows = np.ascontiguousarray(h[order // k])
        gu = self._product(self.gate_up, 2, runs, rows, E, 2 * I, threads)
        act = np.empty((len(rows), I), dtype=np.float32)
        rc = self.lib.pq_act_and_mul(self.act, gu.ctypes.data, len(rows), I, 2 * I,
                                     act.ctypes.data)
        cpu_lib.raise_for(rc, None, "experts' act_and_mul")
        y = np.empty_like(rows)
        y[order] = self._product(self.down, 1, runs, act, I, E, threads)  # (token, choice) order
        y = y.reshape(T, k, E)
        out = y[:, 0] * w[:, :1]
        for j in range(1, k):  # each token's k rows, in the order chosen
            out += y[:, j] * w[:, j:j + 1]
        if self.shared is not None:
            out += self._shared(h, threads)
        return out

    def _shared(self, h: np.ndarray, threads: int) -> np.ndarray:
        """sigmoid(h . gate) * down(act(gate_proj h) * up_proj h), the shared expert."""
        gate_up, down, gate = self.shared
        T, I = len(h), gate_up.width // 2
        gu = np.empty((T, 2 * I), dtype=np.float32)
        rc = self.lib.pq_linear(ctypes.addressof(gate_up.parts), 2, self.hidden, h.ctypes.data,
                                T, self.hidden, gu.ctypes.data, 2 * I, threads)
        cpu_lib.raise_for(rc, None, "shared expert's gate/up")
        act = np.empty((T, I), dtype=np.float32)
        rc = self.lib.pq_act_and_mul(self.act, gu.ctypes.data, T, I, 2 * I, act.ctypes.data)
        cpu_lib.raise_for(rc, None, "shared expert's act_and_mul")
        y = np.empty((T, self.hidden), dtype=np.float32)
        rc = self.lib.pq_linear(ctypes.addressof(down.parts), 1, I, act.ctypes.data, T, I,
                                y.ctypes.data, self.hidden, threads)
        cpu_lib.raise_for(rc, None, "shared expert's down")
        return y / (1.0 + np.exp(-(h @ gate)))[:, None]

    def _product(self, parts, per_run: int, runs: list, x: np.ndarray, K: int, N: int,
                 threads: int) -> np.ndarray:
        """Each run (expert, first row, rows) of x [P, K] times its expert's ``per_run``
        parts into y [P, N]. A run of ``pq_gemm_rows()`` rows or more takes ``pq_linear``
        (the many-row product: the expert's weights decoded once); the shorter ones go
        together through ``pq_linear_rows``, a part per run and projection, at most
        ``MAX_PARTS`` a call, each call over the span of rows its runs cover."""
        y = np.empty((len(x), N), dtype=np.float32)
        long_rows = self.lib.pq_gemm_rows(0)
        short = []
        for e, first, count in runs:
            if count < long_rows:
                short.append((e, first, count))
                continue
            rc = self.lib.pq_linear(ctypes.addressof(parts) + per_run * e * _PART, per_run, K,
                                    x.ctypes.data + first * K * 4, count, K,
                                    y.ctypes.data + first * N * 4, N, threads)
            cpu_lib.raise_for(rc, None, "expert product")
        step = MAX_PARTS // per_run
        for i in range(0, len(short), step):
            chunk = short[i:i + step]
            lo, hi = chunk[0][1], chunk[-1][1] + chunk[-1][2]
            call = (Part * (per_run * len(chunk)))(
                *[parts[per_run * e + j] for e, _, _ in chunk for j in range(per_run)])
            ranges = np.array([(first - lo, count) for _, first, count in chunk
                               for _ in range(per_run)], dtype=np.int64)
            rc = self.lib.pq_linear_rows(call, ranges.ctypes.data, len(call), K,
                                         x.ctypes.data + lo * K * 4, hi - lo, K,
                                         y.ctypes.data + lo * N * 4, N, threads)
            cpu_lib.raise_for(rc, None, "expert products")
        return y
