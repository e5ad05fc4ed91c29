"""Which kernel runs: the one place that decides from the device, the mode and the rows.

Default mode, tuned for speed:
- a one-row product (batch-1 decode) is a fused Triton gemv on CUDA (with the norm
  before it, the activation before the down projection, the rotary after q/k/v);
  rows of two or more take cuBLAS (``F.linear``), as does the CPU;
- attention is ``TritonAttention`` on CUDA: a decode's keys are split so that a small
  batch still fills the GPU (``decode_partition``), and a lone long fresh prompt runs
  SDPA's flash kernel (``fresh_prefill_on_sdpa``), both thresholds tuned on an H200 by
  ``kernels/bench.py --tune``; the torch reference on CPU;
- the sampler cuts top-k/top-p at the widest row's width, probing the nucleus;
- routed experts (MoE layers) run the Triton grouped GEMM on CUDA, one launch for every
  expert (``kernels/fused_moe.py``, gpt-oss's biases and clamped SwiGLU included), or
  per-pair gemvs for a step of a few tokens (``kernels/moe_gemv.py``); the torch
  reference on CPU (``moe_experts``);
- multi-head latent attention's paged decode (DeepSeek) is ``kernels/mla_decode.py`` on
  CUDA where the latent widths fit its tiles, else the torch
  reference of ``layers/mla.py`` (``mla_decode``);
- a GGUF checkpoint's blocks are dequantized at load on every device: the torch worker
  has no block kernels. A CPU serving a GGUF takes the torch-free worker instead
  (``workers/lite``), which computes on the blocks; this worker serves one only where
  that one refuses (tensor parallelism, a dtype other than float32, ...).
Each of these choices depends on what else shares a step, so on CUDA the rounding
of a request's logits does too.

Batch-invariant mode (``EngineArgs.batch_invariant``, CUDA with Triton only): every
choice is fixed per row. All products, one row or many, run the matmul of
``kernels/bi_matmul.py``, whose launch shape depends on the weight alone; every
attention row, decode or prefill, runs the prefill kernel with one fixed tile,
whose key tiles start at absolute positions, so a row computes the same whether
its keys came from its own chunk or the cache (chunking, prefix hits, preemption);
the sampler needs nothing: its rules never look at another row
(``sampler/rules.py``). RMSNorm, rotary, the activations and the KV writes are per
row already. Tensor parallelism is refused in this mode: an all-reduce's order
follows the message size.

Layers take their policy when they are built (``policy_for``), so a process may
build a batch-invariant model beside a default one (the tests do).
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import importlib
import logging
from dataclasses import dataclass
from typing import Callable, Iterator, Optional

import torch
import torch.nn.functional as F

from . import kernels

_building_batch_invariant = False
_warned: set[str] = set()


def _warn_once(message: str) -> None:
    if message not in _warned:
        _warned.add(message)
        logging.getLogger("pocketllm.worker").warning(message)


_rows_as_alone: contextvars.ContextVar[bool] = contextvars.ContextVar("rows_as_alone",
                                                                    default=False)


@contextlib.contextmanager
def rows_as_alone():
    """Inside, products of up to ``gemv_max_rows`` rows run as the gemv, which computes each
    row with the bits it gets alone (kernels/gemv.py; a router's too, and the experts as
    per-pair gemvs; MLA's absorbed heads row by row): a speculative verification step's
    rows then equal their decode steps' (verify_graphs.py). Outside, only one-row products
    do: at five rows the gemv takes 1.2-1.5x cuBLAS's time (docs/benchmarks.md, session
    35), so a plain batch of decodes keeps the GEMM."""
    token = _rows_as_alone.set(True)
    try:
        yield
    finally:
        _rows_as_alone.reset(token)


def rows_alone() -> bool:
    """Whether products run inside ``rows_as_alone``."""
    return _rows_as_alone.get()


@dataclass(frozen=True)
class KernelPolicy:
    triton: bool = False  # the Triton kernels of workers/kernels (CUDA with Triton)
    batch_invariant: bool = False
    decode_min_partition: int = 64  # fewest keys per decode split (each sequence's own)
    decode_programs_per_sm: int = 8  # a small batch is split until about this many per SM
    sdpa_min_rows: tuple[int, int] = (512, 512)  # by head_dim up to 128 / 256
    # Steps of at most this many tokens run their experts as gemvs (kernels/moe_gemv.py):
    # below it a token's experts are rarely shared, so grouping buys no reuse.
    moe_gemv_max_tokens: int = 4
    # Inside ``rows_as_alone``, products of at most this many rows run as the gemv
    gemv_max_rows: int = 8

    def decode_partition(self, num_seqs: int, kv_heads: int, span: int, sms: int,
                         block_n: int) -> int:
        """Keys per split of a decode launch (one program per sequence, KV head and split):
        the whole span when the batch already fills the ``sms`` multiprocessors, else
        enough splits for about ``decode_programs_per_sm`` programs on each, each of at
        least ``decode_min_partition`` keys, rounded up to the kernel's ``block_n``."""
        programs = num_seqs * kv_heads
        if programs >= sms or span <= self.decode_min_partition:
            return max(span, 1)
        splits = min(-(-self.decode_programs_per_sm * sms // programs),
                     -(-span // self.decode_min_partition))
        return -(-(-(-span // splits)) // block_n) * block_n

    def fresh_prefill_on_sdpa(self, rows: int, head_dim: int) -> bool:
        """Whether a lone prompt from position 0, with no window or soft-cap in the way,
        runs SDPA's flash kernel rather than the paged prefill kernel."""
        return rows >= self.sdpa_min_rows[0 if head_dim <= 128 else 1]

    def kernel(self, module: str, name: str):
        """A Triton function the layer runs in place of its torch ops, None on the torch path."""
        if not self.triton:
            return None
        return getattr(importlib.import_module(f"{kernels.__name__}.{module}"), name)

    def one_row(self, x: torch.Tensor) -> bool:
        """Whether a product of x runs as the one-row gemv (with whatever it fuses)."""
        return self.triton and not self.batch_invariant and x.shape[0] == 1

    def gemv_rows(self, x: torch.Tensor) -> bool:
        """Whether a product of x runs as the gemv: one row, or up to ``gemv_max_rows``
        inside ``rows_as_alone``."""
        rows = x.shape[0]
        return (self.triton and not self.batch_invariant
                and (rows == 1 or (rows_alone() and 1 <= rows <= self.gemv_max_rows)))

    def product(self, x: torch.Tensor, weight: torch.Tensor,
                bias: Optional[torch.Tensor] = None) -> torch.Tensor:
        """``F.linear(x, weight, bias)`` of a plain weight that no layer fuses anything
        into (a router): the gemv where ``gemv_rows``, else ``linear``."""
        if self.gemv_rows(x):
            return self.kernel("gemv", "gemv")(x, weight, bias)
        return self.linear(x, weight, bias)

    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None,
               out_dtype: Optional[torch.dtype] = None) -> torch.Tensor:
        """A product of two or more rows (any rows in batch-invariant mode)."""
        if self.batch_invariant:
            from .kernels.bi_matmul import linear

            return linear(x, weight, bias, out_dtype)
        y = F.linear(x, weight, bias)
        return y if out_dtype is None or y.dtype == out_dtype else y.to(out_dtype)

    def keeps_blocks(self) -> bool:
        """Whether a GGUF file's blocks may stay blocks (``linear_method``)."""
        return self.triton and not self.batch_invariant

    def linear_method(self, stored: list[Optional[int]]):
        """How a linear layer holds its weight (``layers/linear_method.py``), from the GGML
        block types of the checkpoint tensors it stacks (None: a float tensor): on the GPU
        path, blocks that the block kernels read (``kernels/gguf_gemv.BLOCKS``) stay
        blocks, unless in batch-invariant mode (its one matmul takes float weights); else
        the dense float weight, a block type without a GPU kernel said once by name. ``FP8``
        parts (the runner names them only where ``fp8_refusal`` is None) keep e4m3 rows."""
        from .layers.linear_method import DENSE, FP8, FP8_ROWS, GGUF_BLOCKS

        if not self.keeps_blocks() or not stored or None in stored:
            return DENSE
        if FP8 in stored:
            return FP8_ROWS if set(stored) == {FP8} else DENSE
        from .kernels.gguf_gemv import BLOCKS
        from .loader.gguf_quants import type_name

        missing = sorted({type_name(t) for t in stored if t not in BLOCKS})
        if missing:
            _warn_once(f"GGUF {', '.join(missing)} blocks have no GPU kernel taken yet: their "
                       "layers are dequantized to the model dtype at load")
            return DENSE
        return GGUF_BLOCKS

    def fp8_refusal(self, device: torch.device) -> Optional[str]:
        """Why weights cannot stay FP8 here (None: they can): FP8 tensor cores (compute
        capability 8.9: Ada, Hopper and later) and the GPU path's kernels."""
        if not self.keeps_blocks():
            return ("FP8 weights need the GPU path's kernels (a CUDA device, not in "
                    "batch-invariant mode)")
        major, minor = torch.cuda.get_device_capability(device)
        if (major, minor) < (8, 9):
            return (f"FP8 weights need FP8 tensor cores (compute capability 8.9 or later); "
                    f"this GPU has {major}.{minor}")
        return None

    def kv_cache_dtype(self, requested: str, device: torch.device, model_dtype: torch.dtype,
                       latent: bool) -> torch.dtype:
        """The K/V pools' element type for ``--kv-cache-dtype`` (``config.KV_CACHE_DTYPES``):
        "fp8" is e4m3 with a scale per position and head (``kernels/kv_fp8.py``), read by
        the Triton attention kernels; refused (``UnsupportedFeatureError``) with the reason
        where they cannot read it."""
        if requested == "auto":
            return model_dtype
        why = None
        if not self.triton:
            why = "the GPU path's Triton attention kernels (a CUDA device)"
        elif latent:
            why = "a K/V cache: MLA's latent cache (DeepSeek) has no FP8 form yet"
        elif torch.cuda.get_device_capability(device) < (8, 9):
            major, minor = torch.cuda.get_device_capability(device)
            why = (f"e4m3 conversions (compute capability 8.9 or later; this GPU has "
                   f"{major}.{minor})")
        if why:
            from pocketllm.errors import UnsupportedFeatureError

            raise UnsupportedFeatureError(f"kv_cache_dtype=fp8 needs {why}", "kv_cache_dtype")
        return torch.float8_e4m3fn

    def moe_experts(self):
        """The experts' computation of ``layers/moe.FusedMoE`` (its signature is
        ``torch_experts``'): on the GPU path the Triton grouped GEMM of
        ``kernels/fused_moe.py`` (tokens sorted by expert into block-aligned groups, one
        launch for gate/up and the activation, one for down; its tile fixed in
        batch-invariant mode) or, for steps of at most ``moe_gemv_max_tokens`` tokens,
        the per-pair gemvs of ``kernels/moe_gemv.py`` (no sort, the per-token sum in the
        down launch); else the torch reference, one product per expert hit. All take
        gpt-oss's expert biases and clamped SwiGLU."""
        if not self.triton:
            from .layers.moe import torch_experts

            return torch_experts
        from .kernels.fused_moe import fused_experts, fused_experts_fixed_tile
        from .kernels.moe_gemv import gemv_experts

        if self.batch_invariant:
            return fused_experts_fixed_tile
        return ExpertsByTokens(self.moe_gemv_max_tokens, gemv_experts, fused_experts,
                               self.gemv_max_rows)

    def mla_decode(self, rank: int, rope: int):
        """The decode attention over a paged MLA latent cache of rows ``rank + rope`` wide
        (the signature of ``layers/mla.mla_decode_attention``): on the GPU path the Triton
        kernel of ``kernels/mla_decode.py`` where the widths fit its tiles (DeepSeek's
        512 + 64 do), its keys split per launch by ``mla_partition``; else the torch
        reference (which also runs on CUDA tensors)."""
        if self.triton:
            from .kernels import mla_decode

            if mla_decode.fits_widths(rank, rope):
                return functools.partial(_mla_kernel_decode, self, mla_decode)
        from .layers.mla import mla_decode_attention

        return mla_decode_attention

    def attention_backend(self):
        if not self.triton:
            from .layers.attention import TorchAttention

            return TorchAttention()
        from .kernels.attention_backend import TritonAttention

        return TritonAttention(self)


@dataclass(frozen=True)
class ExpertsByTokens:
    """The experts' computation by the step's token count (``KernelPolicy.moe_experts``)."""

    max_gemv_tokens: int
    gemv: Callable
    grouped: Callable
    alone_tokens: int = 0  # inside ``rows_as_alone``, the gemvs up to this many tokens

    def __call__(self, x: torch.Tensor, *args) -> torch.Tensor:
        # the gemvs compute each (token, expert) pair alone: a token's bits whatever the step
        limit = max(self.max_gemv_tokens, self.alone_tokens if rows_alone() else 0)
        return (self.gemv if x.shape[0] <= limit else self.grouped)(x, *args)


def _mla_kernel_decode(policy: KernelPolicy, kernel, q_latent: torch.Tensor,
                       q_rope: torch.Tensor, cache: torch.Tensor, block_tables: torch.Tensor,
                       seq_lens: torch.Tensor, q_rows: torch.Tensor, max_seq_len: int,
                       block_size: int, scale: float,
                       out: Optional[torch.Tensor] = None, num_seqs: int = 0) -> torch.Tensor:
    """The Triton MLA decode with the keys per split this policy picks for the launch:
    sized for ``num_seqs`` sequences (0: one a row), so a verification's rows run as
    decodes split their keys as their decode steps did (``PagedSeqs.num_seqs``)."""
    partition = kernel.mla_partition(policy, num_seqs or block_tables.shape[0],
                                     q_latent.shape[1],
                                     max_seq_len, q_latent.shape[2], q_rope.shape[2],
                                     cache.element_size(), cache.device)
    return kernel.mla_decode_attention(q_latent, q_rope, cache, block_tables, seq_lens, q_rows,
                                       max_seq_len, block_size, scale, out,
                                       partition=partition)



def policy_for(device: torch.device) -> KernelPolicy:
    """The policy of layers built now on ``device`` (see ``building``)."""
    return KernelPolicy(triton=kernels.kernels_usable(device),
                        batch_invariant=_building_batch_invariant)


@contextlib.contextmanager
def building(batch_invariant: bool) -> Iterator[None]:
    """Layers built inside take this mode (the runner wraps its model's construction)."""
    global _building_batch_invariant
    before, _building_batch_invariant = _building_batch_invariant, batch_invariant
    try:
        yield
    finally:
        _building_batch_invariant = before


def check_batch_invariant(device: torch.device, world_size: int) -> None:
    """Refuse, before any weight is read, a batch-invariant engine this code cannot keep."""
    from pocketllm.errors import UnsupportedFeatureError

    if not kernels.kernels_usable(device):
        raise UnsupportedFeatureError(
            f"batch_invariant needs the CUDA path with Triton; this worker runs on {device} "
            "(the torch path's library products choose their kernels by shape)",
            "batch_invariant")
    if world_size > 1:
        raise UnsupportedFeatureError(
            "batch_invariant with tensor parallelism is not supported: an all-reduce's "
            "summation order follows the message size, so rows would round differently",
            "batch_invariant")
