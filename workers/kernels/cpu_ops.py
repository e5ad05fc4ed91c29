"""The CPU path's fused operations: the float32 work between a decode step's products, in C
(``cpu_quant/ops.c``, the same library as the block kernels).

Each function has the signature of the Triton kernel of the same name (``rmsnorm``,
``rotary``, ``gated_act``), so a layer takes whichever ``fused_kernel`` hands it; and
``CpuAttention`` is the CPU's ``AttentionBackend``: one-token decodes in C, prefill
chunks (and layers with attention sinks, which the C decode lacks) through the torch
reference. Why: a decode step of the embedded model ran ~700
eager torch ops besides its products, at 10-30 us each (docs/cpu_kernels.md).

float32 only (``fused_kernel`` hands these out for float32 models); every shape and
stride is checked here, so the C side never sees a bad pointer.
"""

from __future__ import annotations

from typing import Optional

import torch

from ..layers.attention import AttentionGroup, KVView, TorchAttention
from ..models.config import ACTIVATION_KINDS
from . import cpu_quant
from .cpu_lib import ACT_IDS

# HF activation name -> ops.c's PQ_ACT_* (the forms ``layers/activation.py`` computes)
ACTIVATIONS = {name: ACT_IDS[kind] for name, kind in ACTIVATION_KINDS.items()}


def available() -> bool:
    return cpu_quant.available()


def _rows3(x: torch.Tensor, what: str) -> tuple[int, int, int, int, int]:
    """(A, B, D, sa, sb) of a float32 CPU [A, D] or [A, B, D] tensor with unit last stride."""
    if x.dtype != torch.float32 or x.device.type != "cpu" or x.dim() not in (2, 3):
        raise ValueError(f"{what} must be a 2-D or 3-D float32 CPU tensor, got {x.dtype} "
                         f"{tuple(x.shape)} on {x.device}")
    if x.shape[-1] > 1 and x.stride(-1) != 1:
        raise ValueError(f"{what} must have unit stride along its last dimension")
    if x.dim() == 2:
        return x.shape[0], 1, x.shape[1], x.stride(0), 0
    return x.shape[0], x.shape[1], x.shape[2], x.stride(0), x.stride(1)


def _check(rc: int, what: str) -> None:
    if rc != 0:
        raise ValueError(f"{what}: the library refused the arguments (code {rc})")


def _norm(x: torch.Tensor, residual: Optional[torch.Tensor], weight: torch.Tensor, eps: float
          ) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    a, b, d, sa, sb = _rows3(x, "x")
    if weight.dtype != torch.float32 or weight.shape != (d,) or not weight.is_contiguous():
        raise ValueError(f"weight must be contiguous float32 [{d}], got {weight.dtype} {tuple(weight.shape)}")
    out = torch.empty(x.shape, dtype=torch.float32)
    res_out, res_ptr, ra, rb = None, None, 0, 0
    if residual is not None:
        if residual.shape != x.shape:
            raise ValueError(f"residual {tuple(residual.shape)} must match x {tuple(x.shape)}")
        _, _, _, ra, rb = _rows3(residual, "residual")
        res_out, res_ptr = torch.empty(x.shape, dtype=torch.float32), residual.data_ptr()
    if out.numel():
        _check(cpu_quant._lib().pq_rms_norm(
            x.data_ptr(), a, b, d, sa, sb, res_ptr, ra, rb, weight.data_ptr(), eps,
            out.data_ptr(), None if res_out is None else res_out.data_ptr()), "rms_norm")
    return out, res_out


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``x / rms(x) * weight`` over the last dimension (a new contiguous tensor)."""
    return _norm(x, None, weight, eps)[0]


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(rms_norm(x + residual), x + residual)``."""
    return _norm(x, residual, weight, eps)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, what: str) -> None:
    a, b, d, sa, sb = _rows3(x, what)
    for t in (cos, sin):
        if (t.dtype != torch.float32 or t.shape[0] != a or t.numel() != a * (d // 2)
                or t.stride(-1) != 1 or (a > 1 and t.stride(0) < d // 2)):
            raise ValueError(f"cos/sin must be float32 [{a}, (1,) {d // 2}], got {t.dtype} {tuple(t.shape)}")
    lc = cos.stride(0) if a > 1 else d // 2
    if a > 1 and sin.stride(0) != lc:
        raise ValueError("cos and sin must share their row stride")
    if x.numel():
        _check(cpu_quant._lib().pq_rotary(x.data_ptr(), a, b, d, sa, sb, cos.data_ptr(),
                                          sin.data_ptr(), lc), "rotary")


def apply_rotary_qk(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                    norms: Optional[tuple[torch.Tensor, torch.Tensor, float]] = None
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotary on q [T, H, D] and k [T, Hkv, D] in place; cos/sin [T, 1, D/2]. ``norms`` =
    (q weight, k weight, eps): each head RMS-normed first (into new tensors), as the
    Triton kernel of the same name does."""
    if norms is not None:
        q, k = rms_norm(q, norms[0], norms[2]), rms_norm(k, norms[1], norms[2])
    _rotate(q, cos, sin, "q")
    _rotate(k, cos, sin, "k")
    return q, k


def act_and_mul(gate_up: torch.Tensor, hidden_act: str = "silu") -> torch.Tensor:
    """``act(gate) * up`` of ``gate_up = [gate | up]`` [T, 2I] -> [T, I]."""
    if hidden_act not in ACTIVATIONS:
        raise ValueError(f"activation {hidden_act!r} has no CPU kernel; known: {sorted(ACTIVATIONS)}")
    t, _, width, st, _ = _rows3(gate_up, "gate_up")
    if gate_up.dim() != 2 or width % 2:
        raise ValueError(f"gate_up must be [T, 2I], got {tuple(gate_up.shape)}")
    out = torch.empty(t, width // 2, dtype=torch.float32)
    if out.numel():
        _check(cpu_quant._lib().pq_act_and_mul(ACTIVATIONS[hidden_act], gate_up.data_ptr(), t,
                                               width // 2, st if t > 1 else width,
                                               out.data_ptr()), "act_and_mul")
    return out


class CpuAttention(TorchAttention):
    """The reference backend, with each step's one-token decodes attended in C."""

    def attend_group(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                     k_cache: torch.Tensor, v_cache: torch.Tensor, group: AttentionGroup,
                     view: KVView, scale: float, softcap: Optional[float],
                     sinks: Optional[torch.Tensor] = None) -> torch.Tensor:
        if (group.q_len != 1 or view.lengths is None or q.dtype != torch.float32
                or k_cache.dtype != torch.float32 or sinks is not None):  # no sinks in C
            return super().attend_group(q, k, v, k_cache, v_cache, group, view, scale, softcap,
                                        sinks)
        heads, dim = q.shape[1], q.shape[2]
        qg = q[group.rows] if isinstance(group.rows, slice) else q.index_select(0, group.rows)
        _, _, _, sqb, sqh = _rows3(qg, "q")
        gather, lengths = view.gather, view.lengths
        if (not k_cache.is_contiguous() or not v_cache.is_contiguous()
                or k_cache.shape != v_cache.shape or k_cache.shape[2] != dim
                or gather.dtype != torch.int64 or not gather.is_contiguous()
                or lengths.dtype != torch.int64 or lengths.shape != (group.batch,)
                or gather.shape[0] != group.batch):
            raise ValueError("CpuAttention: the decode metadata does not match the cache")
        out = torch.empty(group.batch, heads, dim, dtype=torch.float32)
        _check(cpu_quant._lib().pq_decode_attention(
            qg.data_ptr(), group.batch, heads, dim, sqb, sqh, k_cache.data_ptr(),
            v_cache.data_ptr(), k_cache.shape[1], gather.data_ptr(), gather.shape[1],
            lengths.data_ptr(), scale, softcap or 0.0, out.data_ptr(), 0), "decode_attention")
        return out
