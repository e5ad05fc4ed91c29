"""A long step's layers (``LiteModel.stack_rows`` rows or more): the same products as the
decode stack (``pq_linear``, one library call per projection), with attention as numpy
matrix products per sequence instead of a gather per row, and the library's norms,
rotary and activation between them, in ``layer.c``'s order. An MoE layer's experts take
their rows sorted by expert (``experts.py``).

The stack's attention reads each row's keys through its own gather row: cheap for a few
rows, but a long prompt's rows would each gather and dot their keys one by one, where a
matrix product per sequence reads them once. numpy's BLAS runs on one thread here
(``LiteRunner`` limits it): the library's OpenMP threads hold the cores, and two thread
pools spinning against each other on two cores cost a 24-row prompt 10x
(docs/cpu_kernels.md).
"""

from __future__ import annotations

import ctypes
import os
from concurrent.futures import ThreadPoolExecutor
from typing import Optional

import numpy as np

from ..kernels import cpu_lib

QUERY_BLOCK = 128  # query rows whose scores are held at once (memory: rows x keys x heads)


def _p(a: Optional[np.ndarray]) -> Optional[int]:
    return None if a is None else a.ctypes.data


class FloatLayers:
    """The float path over a ``LiteModel``'s bound layers (its descriptions and parts)."""

    def __init__(self, model):
        self.m = model
        self.lib = model.lib
        self._pool: Optional[ThreadPoolExecutor] = None

    def _blocks_in_parallel(self, fn, blocks: list, threads: int) -> None:
        """fn(block) for each block, on ``threads`` Python threads: numpy's BLAS is held to
        one thread, and its products and ufuncs release the GIL, so query blocks on
        threads of our own use every core (they sleep on a queue between steps)."""
        threads = threads or os.cpu_count() or 1
        if threads == 1 or len(blocks) == 1:
            for b in blocks:
                fn(b)
            return
        if self._pool is None or self._pool._max_workers != threads:
            self._pool = ThreadPoolExecutor(threads, thread_name_prefix="attention")
        list(self._pool.map(fn, blocks))

    def run(self, x: np.ndarray, views: dict, layer_views: list, ropes: dict, threads: int
            ) -> np.ndarray:
        """Rows x [M, E] (embedded) through every layer; the last layer's output plus its
        residual. ``views``: the step's ``StepViews`` by key; ``ropes``: (cos, sin) by kind."""
        cfg, res = self.m.cfg, None
        for i in range(cfg.num_layers):
            cos, sin = ropes[cfg.layer_rope[i]]
            x, res = self._layer(i, x, res, views[layer_views[i]], cos, sin, threads)
        return x + res

    def _norm(self, x: np.ndarray, w: np.ndarray, res: Optional[np.ndarray] = None
              ) -> tuple[np.ndarray, Optional[np.ndarray]]:
        """norm(x + res) and x + res (rows of the model's width)."""
        m, e = x.shape
        out = np.empty_like(x)
        res_out = None if res is None else np.empty_like(x)
        rc = self.lib.pq_rms_norm(x.ctypes.data, m, 1, e, e, 0, _p(res), e, 0, w.ctypes.data,
                                  self.m.cfg.rms_norm_eps, out.ctypes.data, _p(res_out))
        cpu_lib.raise_for(rc, None, "rms_norm")
        return out, res_out

    def _linear(self, bound, x: np.ndarray, threads: int) -> np.ndarray:
        """x @ W.T over every part in one library call (from ``pq_gemm_rows`` rows its
        many-row product: each weight row decoded once, exact integer sums)."""
        m, k = x.shape
        out = np.empty((m, bound.width), dtype=np.float32)
        rc = self.lib.pq_linear(ctypes.addressof(bound.parts), len(bound.arrays), k,
                                x.ctypes.data, m, k, out.ctypes.data, bound.width, threads)
        cpu_lib.raise_for(rc, None, "block product")
        return out if bound.bias is None else out + bound.bias

    def _layer(self, i: int, x: np.ndarray, res: Optional[np.ndarray], view, cos, sin,
               threads: int) -> tuple[np.ndarray, np.ndarray]:
        cfg, d = self.m.cfg, self.m.descs[i]
        (norms, qn, kn), (qkv_w, o_w, *mlp) = self.m.norms[i], self.m.bound[i]
        post_attn, ff, post_ff = self.m.mlp_norm_names
        m, H, Hkv, D = x.shape[0], d.heads, d.kv_heads, d.head_dim
        if res is None:
            h, _ = self._norm(x, norms["input_layernorm"])
            res1 = x.copy()
        else:
            h, res1 = self._norm(x, norms["input_layernorm"], res)
        qkv = self._linear(qkv_w, h, threads)
        q, k = qkv[:, :H * D], qkv[:, H * D:(H + Hkv) * D]
        v = qkv[:, (H + Hkv) * D:].reshape(m, Hkv, D)
        if qn is not None:  # per head, into contiguous rows
            q, k = self._head_norm(q, H, qn), self._head_norm(k, Hkv, kn)
        else:
            q, k = np.ascontiguousarray(q), np.ascontiguousarray(k)
        for t, heads in ((q, H), (k, Hkv)):
            rc = self.lib.pq_rotary(t.ctypes.data, m, heads, D, heads * D, D, cos.ctypes.data,
                                    sin.ctypes.data, cos.shape[1])
            cpu_lib.raise_for(rc, None, "rotary")
        k_cache, v_cache = self.m._caches[i]
        k_cache[view.slots] = k.reshape(m, Hkv, D)
        v_cache[view.slots] = v
        attn = self._attend(q.reshape(m, H, D), k_cache, v_cache, view, d.scale,
                            cfg.attn_softcap, H, Hkv, threads)
        o = self._linear(o_w, attn.reshape(m, H * D), threads)
        if post_attn:
            o, _ = self._norm(o, norms[post_attn])
        h, res_out = self._norm(o, norms[ff], res1)
        if self.m.experts[i] is not None:  # routed experts in place of the MLP (experts.py)
            return self.m.experts[i](h, threads), res_out
        gu_w, down_w = mlp
        gu = self._linear(gu_w, h, threads)
        inter = gu.shape[1] // 2
        act = np.empty((m, inter), dtype=np.float32)
        rc = self.lib.pq_act_and_mul(d.act, gu.ctypes.data, m, inter, 2 * inter, act.ctypes.data)
        cpu_lib.raise_for(rc, None, "act_and_mul")
        out = self._linear(down_w, act, threads)
        if post_ff:
            out, _ = self._norm(out, norms[post_ff])
        return out, res_out

    def _head_norm(self, t: np.ndarray, heads: int, w: np.ndarray) -> np.ndarray:
        m, D = t.shape[0], self.m.cfg.head_dim
        out = np.empty((m, heads * D), dtype=np.float32)
        rc = self.lib.pq_rms_norm(t.ctypes.data, m, heads, D, t.strides[0] // 4, D, None, 0, 0,
                                  w.ctypes.data, self.m.cfg.rms_norm_eps, out.ctypes.data, None)
        cpu_lib.raise_for(rc, None, "rms_norm")
        return out

    def _attend(self, q: np.ndarray, k_cache: np.ndarray, v_cache: np.ndarray, view,
                scale: float, softcap: Optional[float], H: int, Hkv: int, threads: int
                ) -> np.ndarray:
        """Each sequence's rows over its keys: ``view.seqs`` gives (first row, end row, key
        slots, key positions) per sequence, ``view.positions`` each row's position. A block
        of queries multiplies only the run of keys some row of it sees (causal, and inside
        the window): half the products of a fresh prompt's square."""
        out = np.empty_like(q)
        G, D = H // Hkv, q.shape[2]
        for r0, r1, slots, key_pos in view.seqs:
            keys = k_cache[slots].transpose(1, 2, 0)  # [Hkv, D, L]
            values = v_cache[slots].transpose(1, 0, 2)  # [Hkv, L, D]

            def block(b0: int) -> None:
                b1 = min(r1, b0 + QUERY_BLOCK)
                n = b1 - b0
                pos = view.positions[b0:b1]
                # key_pos ascends: the keys any row here sees are one run of it
                lo = 0 if not view.window else int(np.searchsorted(key_pos, pos.min() - view.window + 1))
                hi = int(np.searchsorted(key_pos, pos.max(), side="right"))
                kp = key_pos[lo:hi]
                qh = q[b0:b1].reshape(n, Hkv, G, D).transpose(1, 2, 0, 3).reshape(Hkv, G * n, D)
                s = np.matmul(qh, keys[:, :, lo:hi])  # [Hkv, G * n, keys], in place from here
                s *= np.float32(scale)
                if softcap:
                    np.tanh(s / np.float32(softcap), out=s)
                    s *= np.float32(softcap)
                ok = kp[None, :] <= pos[:, None]
                if view.window:
                    ok &= kp[None, :] > pos[:, None] - view.window
                bias = np.where(ok, np.float32(0.0), np.float32(-np.inf))  # [n, keys]
                s.reshape(Hkv, G, n, -1)[...] += bias
                s -= s.max(axis=-1, keepdims=True)
                np.exp(s, out=s)
                s /= s.sum(axis=-1, keepdims=True)
                o = np.matmul(s, values[:, lo:hi])  # [Hkv, G * n, D]
                out[b0:b1] = o.reshape(Hkv, G, n, D).transpose(2, 0, 1, 3).reshape(n, H, D)

            self._blocks_in_parallel(block, list(range(r0, r1, QUERY_BLOCK)), threads)
        return out
