"""The Gated DeltaNet forms on CUDA: flash-linear-attention's Triton kernels (``fla-core``,
the kernels vLLM and SGLang carry), called with the torch forms' signatures
(``layers/gated_delta.chunked_varlen`` and ``decode_step``), so ``layers/linear_attention.py``
swaps one for the other. Both normalise q and k in the kernel (``use_qk_l2norm_in_kernel``,
the same eps) and scale q by k_dim^-1/2; the states stay float32.
"""

from __future__ import annotations

import torch
from fla.ops.gated_delta_rule import chunk_gated_delta_rule, fused_recurrent_gated_delta_rule


def chunked_varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                   beta: torch.Tensor, states: torch.Tensor, starts: list[int]
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """Several sequences' chunks laid end to end (``layers/gated_delta.chunked_varlen``'s
    signature), one kernel call per sequence: the form measured on the GPU so far (the
    kernels' own variable-length launch, ``cu_seqlens``, is the next step: it has not run
    on a GPU here yet)."""
    out = torch.empty(q.shape[0], v.shape[1], v.shape[2], dtype=v.dtype, device=v.device)
    finals = torch.empty_like(states, dtype=torch.float32)
    for i, (a, b) in enumerate(zip(starts, starts[1:])):
        o, final = chunk_gated_delta_rule(
            q[None, a:b].contiguous(), k[None, a:b].contiguous(), v[None, a:b].contiguous(),
            g=g[None, a:b].float(), beta=beta[None, a:b].to(v.dtype),
            initial_state=states[i:i + 1].float(), output_final_state=True,
            use_qk_l2norm_in_kernel=True)
        out[a:b], finals[i] = o[0], final[0]
    return out, finals


def decode_step(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                beta: torch.Tensor, state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One token of each of B sequences: q, k [B, k_heads, k_dim], v [B, v_heads, v_dim],
    g/beta [B, v_heads], state [B, v_heads, k_dim, v_dim] -> (out [B, v_heads, v_dim],
    new states)."""
    q, k, v = (x.contiguous() for x in (q, k, v))
    out, final = fused_recurrent_gated_delta_rule(
        q[:, None], k[:, None], v[:, None], g=g.float()[:, None], beta=beta.to(v.dtype)[:, None],
        initial_state=state.float(), output_final_state=True, use_qk_l2norm_in_kernel=True)
    return out[:, 0], final
