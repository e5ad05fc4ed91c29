"""Mixture-of-experts: routing, and the experts' computation over the routed tokens.

The seam every MoE family shares (Qwen3-MoE, DeepSeek-V2/V3 and gpt-oss):

* a **routing function** turns router logits [T, E] into ``(weights [T, k] float32,
  ids [T, k])``. ``softmax_topk`` is Qwen's (optionally renormalised over the k
  chosen), ``topk_softmax`` gpt-oss's (the k largest logits, softmax over those k);
  ``SigmoidGroupedTopK`` is DeepSeek-V3's (grouped, with a loaded correction
  bias: a module, so its parameter loads with the layer) and
  ``SoftmaxGroupLimitedTopK`` DeepSeek-V2's;
* ``FusedMoE`` holds every expert's gate/up and down matrices stacked
  (``w13`` [E, 2*I_local, H], ``w2`` [E, H, I_local]; a GGUF's blocks dequantized at
  load) and computes
  ``sum_j weight_j * down_e(act(gate_e(x)) * up_e(x))`` over each token's k experts
  (with ``MoeSpec.expert_bias``, each product adds its expert's bias; with
  ``swiglu_limit``, gpt-oss's clamped SwiGLU replaces ``act(gate) * up``).
  Which kernel does that is the kernel policy's call (``KernelPolicy.moe_experts``):
  ``torch_experts`` below (the CPU path and the reference) or the Triton grouped GEMM
  of ``kernels/fused_moe.py`` on CUDA.

Tensor parallelism splits each expert's intermediate dimension across ranks, as the
dense MLP splits its own (column-parallel gate/up, row-parallel down), so one
all-reduce follows the down projection; ``reduce=False`` leaves it to the caller (a
family with shared experts sums both first and reduces once). Every rank holds every
expert: expert parallelism (a slice of the experts per rank, tokens exchanged
all-to-all) would narrow ``experts`` below and is not built.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Optional

import torch
import torch.nn.functional as F
from torch import nn

from ..distributed import SINGLE, TPGroup
from ..kernel_policy import policy_for
from .activation import ClampedSwiGLU, GatedAct, gated, get_activation
from .linear import Shard, even_shard
from ..models.config import MoeSpec

if TYPE_CHECKING:
    from .norm import RMSNorm

Routing = Callable[[torch.Tensor, int], tuple[torch.Tensor, torch.Tensor]]


@dataclass(frozen=True)
class SoftmaxTopK:
    """Softmax over all experts in float32, keep the k largest; ``renormalize`` (HF
    ``norm_topk_prob``): divide those k by their sum. (The GPU path runs it as one Triton
    launch, ``kernels.fused_moe.softmax_topk``.)"""

    renormalize: bool

    def __call__(self, logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
        weights, ids = torch.topk(probs, k, dim=-1)
        if self.renormalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights, ids


def softmax_topk(renormalize: bool) -> Routing:
    return SoftmaxTopK(renormalize)


def topk_softmax(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """gpt-oss's routing: the k largest logits, softmax over those k (in float32)."""
    top, ids = torch.topk(logits, k, dim=-1)
    return torch.softmax(top, dim=-1, dtype=torch.float32), ids
def _group_mask(scores: torch.Tensor, groups: int, keep: int, group_score: str) -> torch.Tensor:
    """[T, E] True where the expert's group is among the ``keep`` best of ``groups``
    (contiguous groups of E / groups experts), a group scored by its best expert ("max")
    or the sum of its two best ("top2")."""
    per_group = scores.view(scores.shape[0], groups, -1)
    if group_score == "max":
        score = per_group.max(dim=-1).values
    else:
        score = per_group.topk(2, dim=-1).values.sum(dim=-1)
    chosen = torch.topk(score, keep, dim=-1, sorted=False).indices
    mask = torch.zeros_like(score, dtype=torch.bool).scatter_(1, chosen, True)
    return mask.unsqueeze(-1).expand_as(per_group).reshape_as(scores)


class SigmoidGroupedTopK(nn.Module):
    """DeepSeek-V3's routing: sigmoid scores; the correction bias (a loaded parameter,
    ``mlp.gate.e_score_correction_bias``) is added only to choose the experts: keep the
    ``topk_group`` best of ``n_group`` groups (a group's score: the sum of its two best
    biased scores), then the k best biased experts among them. Their weights are the
    unbiased scores, divided by their sum when ``norm_topk_prob``, times
    ``routed_scaling_factor``. All in float32, as transformers' DeepseekV3TopkRouter."""

    def __init__(self, num_experts: int, n_group: int, topk_group: int, renormalize: bool,
                 scaling: float, device: torch.device):
        super().__init__()
        self.n_group, self.topk_group = n_group, topk_group
        self.renormalize, self.scaling = renormalize, scaling
        self.bias = nn.Parameter(torch.zeros(num_experts, device=device), requires_grad=False)

    def forward(self, logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        scores = logits.float().sigmoid()
        biased = scores + self.bias
        if self.n_group > 1:
            keep = _group_mask(biased, self.n_group, self.topk_group, "top2")
            biased = biased.masked_fill(~keep, float("-inf"))
        ids = torch.topk(biased, k, dim=-1, sorted=False).indices
        weights = scores.gather(1, ids)
        if self.renormalize:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return weights * self.scaling, ids


@dataclass(frozen=True)
class SoftmaxGroupLimitedTopK:
    """DeepSeek-V2's routing: softmax over all experts in float32; ``group_limited``
    (``topk_method="group_limited_greedy"``) first keeps the ``topk_group`` best of
    ``n_group`` groups by their best expert, zeroing the others; then the k largest,
    times ``routed_scaling_factor`` (never renormalised, as transformers'
    DeepseekV2TopkRouter)."""

    group_limited: bool
    n_group: int
    topk_group: int
    scaling: float

    def __call__(self, logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        scores = torch.softmax(logits, dim=-1, dtype=torch.float32)
        if self.group_limited:
            keep = _group_mask(scores, self.n_group, self.topk_group, "max")
            scores = scores.masked_fill(~keep, 0.0)
        weights, ids = torch.topk(scores, k, dim=-1, sorted=False)
        return weights * self.scaling, ids


def torch_experts(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                  weights: torch.Tensor, ids: torch.Tensor, hidden_act: GatedAct,
                  b13: Optional[torch.Tensor] = None, b2: Optional[torch.Tensor] = None
                  ) -> torch.Tensor:
    """The reference: rows sorted by expert, one pair of products per expert that received
    any (no per-token loop), each row scaled by its routing weight, summed per token.

    x [T, H]; w13 [E, 2I, H]; w2 [E, H, I]; weights [T, k] float32; ids [T, k] -> [T, H].
    ``hidden_act``: an HF activation name (act(gate) * up) or a function of [gate | up]
    (``ClampedSwiGLU``); ``b13`` [E, 2I], ``b2`` [E, H]: the experts' biases, if any."""
    tokens, k = ids.shape
    act = gated(hidden_act)
    flat = ids.reshape(-1)
    order = torch.argsort(flat, stable=True)  # stable: a token's rows keep expert order
    counts = torch.bincount(flat, minlength=w13.shape[0]).tolist()
    token_of = order // k
    rows = torch.empty(tokens * k, w2.shape[1], dtype=x.dtype, device=x.device)
    picked = x[token_of]
    start = 0
    for expert, count in enumerate(counts):
        if count == 0:
            continue
        part = slice(start, start + count)
        h = act(F.linear(picked[part], w13[expert], None if b13 is None else b13[expert]))
        rows[part] = F.linear(h, w2[expert], None if b2 is None else b2[expert])
        start += count
    # Scaled in the model dtype and added in expert order, as transformers does.
    rows *= weights.reshape(-1)[order].to(x.dtype).unsqueeze(-1)
    return torch.zeros(tokens, w2.shape[1], dtype=x.dtype, device=x.device).index_add_(
        0, token_of, rows)


def _fused_route(kernel, renormalize: bool, logits: torch.Tensor, k: int, scaling: float = 1.0):
    weights, ids = kernel(logits, k, renormalize)
    return (weights if scaling == 1.0 else weights * scaling), ids


class FusedMoE(nn.Module):
    """Routed experts of one layer: a replicated router and the stacked expert weights,
    each expert's intermediate columns split across ranks."""

    def __init__(self, hidden_size: int, spec: MoeSpec, routing: Routing,
                 device: torch.device, dtype: torch.dtype, tp: TPGroup = SINGLE,
                 router_dtype: Optional[torch.dtype] = None):
        """``router_dtype``: the router's (DeepSeek keeps it in float32, as transformers
        does); the model dtype by default. A ``routing`` that is a module (DeepSeek-V3's,
        holding its loaded bias) becomes a submodule."""
        super().__init__()
        if spec.top_k > spec.num_experts or spec.top_k < 1:
            raise ValueError(f"num_experts_per_tok={spec.top_k} must be in "
                             f"[1, num_experts={spec.num_experts}]")
        get_activation(spec.hidden_act)  # refuses an unknown activation now
        self.spec, self.routing, self.tp = spec, routing, tp
        self.inter: Shard = even_shard(spec.intermediate_size, tp)
        local = self.inter.size
        e = spec.num_experts

        def param(*shape):  # filled by a loader
            return nn.Parameter(torch.empty(*shape, device=device, dtype=dtype),
                                requires_grad=False)

        self.gate = nn.Parameter(torch.empty(e, hidden_size, device=device,
                                             dtype=router_dtype or dtype),
                                 requires_grad=False)  # the router, HF ``mlp.gate.weight``
        self.gate_bias = (nn.Parameter(torch.empty(e, device=device, dtype=self.gate.dtype),
                                       requires_grad=False) if spec.router_bias else None)
        self.policy = policy_for(device)
        self.w13 = param(e, 2 * local, hidden_size)
        self.w2 = param(e, hidden_size, local)
        # Expert biases: b13 split with the columns; b2 is added once, by rank 0 (the other
        # ranks' partial sums leave it out), so the all-reduce counts it once.
        self.b13 = param(e, 2 * local) if spec.expert_bias else None
        self.b2 = param(e, hidden_size) if spec.expert_bias else None
        self.act: GatedAct = (ClampedSwiGLU(spec.swiglu_alpha, spec.swiglu_limit)
                              if spec.swiglu_limit is not None else spec.hidden_act)
        self.compute = self.policy.moe_experts()
        self.norm_gemv = self.policy.kernel("gemv", "norm_gemv")  # the router's, at one row
        fused = self.policy.kernel("fused_moe", "softmax_topk")
        if fused is not None and isinstance(routing, SoftmaxTopK):  # one launch, not four
            self.routing = functools.partial(_fused_route, fused, routing.renormalize)
        elif fused is not None and routing is topk_softmax:
            # softmax over the k largest logits = softmax over all, k largest, renormalised
            self.routing = functools.partial(_fused_route, fused, True)
        elif (fused is not None and isinstance(routing, SoftmaxGroupLimitedTopK)
              and not routing.group_limited):  # DeepSeek-V2's greedy: softmax top-k, scaled
            self.routing = functools.partial(_fused_route, fused, False, scaling=routing.scaling)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.routing(self.policy.product(x.to(self.gate.dtype), self.gate,
                                                self.gate_bias), self.spec.top_k)

    def forward(self, x: torch.Tensor, reduce: bool = True) -> torch.Tensor:
        return self._experts(x, *self.route(x), reduce)

    def normed(self, norm: "RMSNorm", x: torch.Tensor, residual: torch.Tensor
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(self(norm(x + residual)), x + residual)``. On a one-row GPU step the add and
        norm run inside the router's gemv, which also leaves the normed row for the
        experts: one launch fewer (and a verification's rows, ``rows_as_alone``, the same
        bits as their decode steps)."""
        if self.policy.gemv_rows(x) and self.gate.dtype == x.dtype:
            h = torch.empty_like(x)
            logits, residual = self.norm_gemv(x, residual, norm.weight, norm.eps, self.gate,
                                              self.gate_bias, normed_out=h)
            return self._experts(h, *self.routing(logits, self.spec.top_k)), residual
        h, residual = norm.add(x, residual)
        return self(h), residual

    def _experts(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
                 reduce: bool = True) -> torch.Tensor:
        biases = () if self.b13 is None else (self.b13, self.b2 if self.tp.rank == 0 else None)
        out = self.compute(x, self.w13, self.w2, weights, ids, self.act, *biases)
        return self.tp.all_reduce(out) if reduce else out

    def unread_bytes(self) -> int:
        """Bytes of expert weights a one-token step does not read (the E - k experts it
        did not pick): what the decode roofline leaves out."""
        per_expert = sum(p[0].numel() * p.element_size()
                         for p in (self.w13, self.w2, self.b13, self.b2) if p is not None)
        return (self.spec.num_experts - self.spec.top_k) * per_expert

    def weight_targets(self, prefix: str) -> dict:
        """HF names (``{prefix}gate.weight``, ``{prefix}experts.{e}.{gate,up,down}_proj.weight``,
        and ``.bias`` of each where the spec has them) -> their places in the stacked
        tensors: one checkpoint tensor at a time, so a loader never holds more than one
        expert's matrix. (gpt-oss stores its experts stacked: ``models/gpt_oss.py``.)"""
        from ..models.weight_targets import WeightTarget

        local, part = self.inter.size, None if self.inter.whole else self.inter
        down = None if self.inter.whole else Shard(1, self.inter.start, self.inter.stop,
                                                   self.inter.full)
        t = {f"{prefix}gate.weight": WeightTarget(self.gate)}
        if self.gate_bias is not None:
            t[f"{prefix}gate.bias"] = WeightTarget(self.gate_bias)
        for e in range(self.spec.num_experts):
            p = f"{prefix}experts.{e}."
            t[f"{p}gate_proj.weight"] = WeightTarget(self.w13[e], slice(0, local), shard=part)
            t[f"{p}up_proj.weight"] = WeightTarget(self.w13[e], slice(local, 2 * local),
                                                   shard=part)
            t[f"{p}down_proj.weight"] = WeightTarget(self.w2[e], shard=down)
            if self.b13 is not None:
                t[f"{p}gate_proj.bias"] = WeightTarget(self.b13[e], slice(0, local), shard=part)
                t[f"{p}up_proj.bias"] = WeightTarget(self.b13[e], slice(local, 2 * local),
                                                     shard=part)
                t[f"{p}down_proj.bias"] = WeightTarget(self.b2[e])
        return t

    def extra_repr(self) -> str:
        s = self.spec
        return (f"experts={s.num_experts}, top_k={s.top_k}, intermediate={self.inter.size}"
                f"/{s.intermediate_size}, act={self.act}, bias={s.expert_bias}")
