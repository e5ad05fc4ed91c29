"""Gated DeltaNet (GDN) linear attention, the recurrent layers of Qwen3.5 and Qwen3-Next
(issue 35): the torch forms for one sequence, with its state passed in and returned.

Per value head, the state S is a [k_dim, v_dim] float32 matrix. A token with decay
g <= 0 (log space), write strength beta in (0, 1), key k, value v and query q (q and k
L2-normalised, q also scaled by k_dim^-1/2) does

    S <- exp(g) S;  u = beta (v - S^T k);  S <- S + k u^T;  out = S^T q

(the delta rule: only what S does not already predict of v is written). Query/key heads
are shared by groups of consecutive value heads.

``recurrent`` runs that token by token (decode). ``chunked`` (prefill) does a chunk of C
tokens with matrix products. Within a chunk, with cumulative decays G_t = g_1 + ... + g_t
and the state S0 it starts from, the written values U satisfy

    u_t = beta_t (v_t - exp(G_t) S0^T k_t - sum_{s<t} exp(G_t - G_s) (k_t . k_s) u_s),

a unit lower-triangular system (I + A) U = beta V - beta exp(G) K S0 that one triangular
solve answers; then out_t = exp(G_t) S0^T q_t + sum_{s<=t} exp(G_t - G_s) (q_t . k_s) u_s
and the state leaving the chunk is exp(G_C) S0 + sum_s exp(G_C - G_s) k_s u_s^T. Both
forms compute the same function (to float32 rounding); a prompt split across calls at any
token equals one call, since the state carries everything between them.

The short causal convolution before it (a depthwise conv of ``kernel`` taps over the
mixed q/k/v channels, SiLU after) keeps the last ``kernel - 1`` inputs as its state.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..device import to_device

L2_EPS = 1e-6  # the reference's eps inside the rsqrt of q's and k's squared norms


def l2_normalise(x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + L2_EPS)


def decay_and_beta(a: torch.Tensor, b: torch.Tensor, a_log: torch.Tensor,
                   dt_bias: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The per-token, per-value-head decay g = -exp(A_log) softplus(a + dt_bias) and
    write strength beta = sigmoid(b), float32 ([T, v_heads] each)."""
    g = -a_log.float().exp() * F.softplus(a.float() + dt_bias.float())
    return g, b.float().sigmoid()


def _prepare(q: torch.Tensor, k: torch.Tensor, v_heads: int
             ) -> tuple[torch.Tensor, torch.Tensor]:
    """q, k [T, k_heads, k_dim] -> float32 [v_heads, T, k_dim], normalised, q scaled."""
    group = v_heads // q.shape[1]
    q = l2_normalise(q.float()) * q.shape[-1] ** -0.5
    k = l2_normalise(k.float())
    if group > 1:
        q, k = q.repeat_interleave(group, dim=1), k.repeat_interleave(group, dim=1)
    return q.transpose(0, 1), k.transpose(0, 1)


def recurrent(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
              beta: torch.Tensor, state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """q, k [T, k_heads, k_dim], v [T, v_heads, v_dim], g/beta [T, v_heads], state
    [v_heads, k_dim, v_dim] float32 -> (out [T, v_heads, v_dim] float32, new state)."""
    qh, kh = _prepare(q, k, v.shape[1])
    vh, g, beta = v.float().transpose(0, 1), g.float().t(), beta.float().t()
    s = state.float().clone()
    out = torch.empty_like(vh)
    for t in range(vh.shape[1]):
        s = s * g[:, t].exp()[:, None, None]
        kt = kh[:, t]
        u = beta[:, t, None] * (vh[:, t] - torch.einsum("hkv,hk->hv", s, kt))
        s = s + kt[:, :, None] * u[:, None, :]
        out[:, t] = torch.einsum("hkv,hk->hv", s, qh[:, t])
    return out.transpose(0, 1), s


def chunked(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
            beta: torch.Tensor, state: torch.Tensor, chunk: int = 64
            ) -> tuple[torch.Tensor, torch.Tensor]:
    """``recurrent``'s function, ``chunk`` tokens per matrix step (see the module doc)."""
    qh, kh = _prepare(q, k, v.shape[1])
    vh, g, beta = v.float().transpose(0, 1), g.float().t(), beta.float().t()
    s = state.float().clone()
    out = torch.empty_like(vh)
    for c0 in range(0, vh.shape[1], chunk):
        qc, kc, vc = qh[:, c0:c0 + chunk], kh[:, c0:c0 + chunk], vh[:, c0:c0 + chunk]
        cum = g[:, c0:c0 + chunk].cumsum(-1)  # G_t, [H, C]
        bc = beta[:, c0:c0 + chunk, None]
        n = cum.shape[1]
        # exp(G_t - G_s) for s <= t, 0 above the diagonal (masked before exp: no overflow)
        causal = torch.ones(n, n, dtype=torch.bool, device=cum.device).tril()
        rel = (cum[:, :, None] - cum[:, None, :]).masked_fill(~causal, float("-inf")).exp()
        a = (bc * (kc @ kc.transpose(1, 2)) * rel).tril(-1)
        system = a + torch.eye(n, dtype=a.dtype, device=a.device)
        rhs = bc * (vc - cum.exp()[:, :, None] * (kc @ s))
        u = torch.linalg.solve_triangular(system, rhs, upper=False, unitriangular=True)
        out[:, c0:c0 + chunk] = (cum.exp()[:, :, None] * (qc @ s)
                                 + ((qc @ kc.transpose(1, 2)) * rel) @ u)
        last = cum[:, -1:]
        s = (last.exp()[:, :, None] * s
             + (kc * (last - cum).exp()[:, :, None]).transpose(1, 2) @ u)
    return out.transpose(0, 1), s


class Segments:
    """Several sequences' rows laid end to end: sequence i holds rows
    ``starts[i]:starts[i + 1]``. The index tensors the varlen forms gather by are built
    once, on first use, and shared by every layer of the step (``memo``); on a GPU they are
    copied without waiting for the stream (``device.to_device``), since a plain copy in a
    layer would stall the host until the GPU caught up, once per layer."""

    def __init__(self, starts: list[int], device: torch.device):
        self.starts, self.device = starts, device
        self._memo: dict = {}

    def __len__(self) -> int:
        return len(self.starts) - 1

    def spans(self):
        return zip(self.starts, self.starts[1:])

    def memo(self, key, build):
        """``build()``'s result, computed once per ``key``."""
        if key not in self._memo:
            self._memo[key] = build()
        return self._memo[key]

    def conv_gathers(self, keep: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``causal_conv_varlen``'s rows of cat([states' rows, x]): each segment's ``keep``
        state rows then its tokens' (the padded input); the outputs' rows in it (the window
        ending at token r starts ``keep`` before); the new states' rows."""
        def build():
            n = len(self)
            order, outputs, lasts, at = [], [], [], 0
            for i, (a, b) in enumerate(self.spans()):
                order += list(range(i * keep, (i + 1) * keep)) + [n * keep + r for r in range(a, b)]
                outputs += range(at, at + b - a)
                lasts += range(at + b - a, at + b - a + keep)
                at += b - a + keep
            return tuple(to_device(rows, self.device, torch.long)
                         for rows in (order, outputs, lasts))
        return self.memo(("conv", keep), build)


def chunked_varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                   beta: torch.Tensor, states: torch.Tensor, seg: Segments
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """``chunked`` over several sequences' rows laid end to end (``seg``), sequence i
    starting from ``states[i]`` -> (out [T, v_heads, v_dim] float32, the final states
    [N, ...])."""
    out = torch.empty(q.shape[0], v.shape[1], v.shape[2], dtype=torch.float32, device=v.device)
    finals = torch.empty_like(states, dtype=torch.float32)
    for i, (a, b) in enumerate(seg.spans()):
        out[a:b], finals[i] = chunked(q[a:b], k[a:b], v[a:b], g[a:b], beta[a:b], states[i])
    return out, finals


def causal_conv_varlen(x: torch.Tensor, weight: torch.Tensor, states: torch.Tensor,
                       seg: Segments) -> tuple[torch.Tensor, torch.Tensor]:
    """``causal_conv`` over several sequences' rows laid end to end (``seg``; ``states``
    [N, channels, kernel - 1]) in one convolution: each sequence's rows follow its own
    state, so no output window crosses into another sequence -> (out [T, channels], the
    new states)."""
    keep = weight.shape[1] - 1
    order, outputs, lasts = seg.conv_gathers(keep)
    old = states.to(x.dtype).transpose(1, 2).reshape(len(seg) * keep, -1)  # oldest first
    padded = torch.cat([old, x]).index_select(0, order)
    y = F.conv1d(padded.t()[None].to(weight.dtype), weight[:, None, :], groups=weight.shape[0])[0]
    out = F.silu(y.t().index_select(0, outputs)).to(x.dtype)
    new = padded.index_select(0, lasts).view(len(seg), keep, -1).transpose(1, 2)
    return out, new


def causal_conv(x: torch.Tensor, weight: torch.Tensor, state: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, channels], weight [channels, kernel], state [channels, kernel - 1] (the
    previous inputs, oldest first; zeros at a sequence's start) -> (SiLU of the depthwise
    causal convolution [T, channels], the new state)."""
    taps = weight.shape[1]
    seq = torch.cat([state.to(x.dtype), x.t()], dim=1)  # [channels, taps - 1 + T]
    y = F.conv1d(seq[None].to(weight.dtype), weight[:, None, :], groups=weight.shape[0])[0]
    return F.silu(y).t().to(x.dtype), seq[:, seq.shape[1] - (taps - 1):].clone()


def gated_rms_norm(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor,
                   eps: float) -> torch.Tensor:
    """RMSNorm over the last dim (float32), times ``weight``, times SiLU(gate): the norm
    on each value head's output before the out projection."""
    xf = x.float()
    normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return ((weight * normed.to(x.dtype)).float() * F.silu(gate.float())).to(x.dtype)


def decode_step(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                beta: torch.Tensor, state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One token of each of B sequences: q, k [B, k_heads, k_dim], v [B, v_heads, v_dim],
    g/beta [B, v_heads], state [B, v_heads, k_dim, v_dim] float32 -> (out [B, v_heads,
    v_dim] float32, new states): ``recurrent``'s update, batched over the sequences."""
    qh, kh = (x.transpose(0, 1) for x in _prepare(q, k, v.shape[1]))  # [B, H, k_dim]
    s = state.float() * g.float().exp()[:, :, None, None]
    u = beta.float()[:, :, None] * (v.float() - torch.einsum("bhkv,bhk->bhv", s, kh))
    s = s + kh[:, :, :, None] * u[:, :, None, :]
    return torch.einsum("bhkv,bhk->bhv", s, qh), s


def conv_step(x: torch.Tensor, weight: torch.Tensor, state: torch.Tensor
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """``causal_conv`` for one token of each of B sequences: x [B, channels], state
    [B, channels, kernel - 1] -> (out [B, channels], new states)."""
    seq = torch.cat([state.to(x.dtype), x[:, :, None]], dim=2)  # [B, channels, kernel]
    y = (seq.to(weight.dtype) * weight).sum(-1)
    return F.silu(y).to(x.dtype), seq[:, :, 1:]
