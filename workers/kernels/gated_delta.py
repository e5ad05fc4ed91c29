"""The Gated DeltaNet forms on CUDA: flash-linear-attention's Triton kernels (``fla-core``,
the kernels vLLM and SGLang carry), called with the torch forms' signatures
(``layers/gated_delta.chunked_varlen`` and ``decode_step``), so ``layers/linear_attention.py``
swaps one for the other. Both normalise q and k in the kernel (``use_qk_l2norm_in_kernel``,
the same eps) and scale q by k_dim^-1/2; the states stay float32.
"""

from __future__ import annotations

import torch
from fla.ops.gated_delta_rule import chunk_gated_delta_rule, fused_recurrent_gated_delta_rule
from fla.ops.utils.index import prepare_chunk_indices

from ..device import to_device
from ..layers.gated_delta import Segments

CHUNK = 64  # chunk_gated_delta_rule's default chunk size, which its chunk map must match


def chunked_varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                   beta: torch.Tensor, states: torch.Tensor, seg: Segments
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """Several sequences' chunks laid end to end (``layers/gated_delta.chunked_varlen``'s
    signature) in one variable-length call. Its sequence bounds (``cu_seqlens``) and chunk
    map (``chunk_indices``) are built on the host once a step (``seg.memo``) and copied
    without waiting: left to the kernels, the map is read back from the GPU, a stall per
    layer."""
    cu_seqlens, chunk_indices = seg.memo("fla", lambda: _bounds(seg))
    out, finals = chunk_gated_delta_rule(
        q[None].contiguous(), k[None].contiguous(), v[None].contiguous(), g=g[None].float(),
        beta=beta[None].to(v.dtype), initial_state=states.float(), output_final_state=True,
        use_qk_l2norm_in_kernel=True, cu_seqlens=cu_seqlens, chunk_indices=chunk_indices)
    return out[0], finals


def _bounds(seg: Segments) -> tuple[torch.Tensor, torch.Tensor]:
    host = torch.tensor(seg.starts, dtype=torch.long)
    chunks = prepare_chunk_indices(host, CHUNK, cu_seqlens_cpu=host)
    return to_device(host, seg.device), to_device(chunks, seg.device)


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
