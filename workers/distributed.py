"""Tensor-parallel ranks: the process group and the few collectives the model needs.

The supervisor starts one worker per rank with RANK, LOCAL_RANK, WORLD_SIZE,
MASTER_ADDR and MASTER_PORT in the environment. ``init_from_env`` joins them
through torch.distributed: NCCL when the worker runs on CUDA (one device per
rank, LOCAL_RANK), gloo on CPU.

A ``TPGroup`` is what layers hold. At world 1 no process group exists and every
collective returns its input untouched, so a single rank pays nothing.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from datetime import timedelta
from typing import Optional

import torch

from pocketllm.config import EngineArgs
from pocketllm.errors import UnsupportedFeatureError

MIN_COLLECTIVE_TIMEOUT_S = 600  # a collective may wait this long for a rank still loading


class RankFailure(RuntimeError):
    """A rank failed where the others may wait for it in a collective: the group is broken
    and the worker must exit (the supervisor then stops the engine)."""


@dataclass(frozen=True)
class TPGroup:
    """This process's place among the tensor-parallel ranks."""

    rank: int = 0
    world: int = 1

    @property
    def is_first(self) -> bool:
        return self.rank == 0

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum ``x`` over the ranks, in place."""
        if self.world > 1:
            torch.distributed.all_reduce(x)
        return x

    def gather_to_first(self, x: torch.Tensor) -> Optional[list[torch.Tensor]]:
        """Every rank's ``x`` (one shape on all ranks) in rank order, on rank 0; None elsewhere."""
        if self.world == 1:
            return [x]
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.world)] if self.is_first else None
        torch.distributed.gather(x, parts, dst=0)
        return parts

    def broadcast_from_first(self, x: torch.Tensor) -> torch.Tensor:
        """Rank 0's ``x`` on every rank, in place (every rank passes one shape)."""
        if self.world > 1:
            torch.distributed.broadcast(x, src=0)
        return x

    def min_int(self, value: int, device: torch.device) -> int:
        """The smallest ``value`` any rank holds (every rank gets it)."""
        if self.world == 1:
            return value
        t = torch.tensor([value], dtype=torch.int64, device=device)
        torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MIN)
        return int(t.item())


SINGLE = TPGroup()


def wants_cuda(args: EngineArgs) -> bool:
    return args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())


def init_from_env(args: EngineArgs, rank: int, world: int) -> TPGroup:
    """Join the ranks' process group (world > 1); on CUDA also pick this rank's device.

    Must run before the model is built: ``choose_device`` takes the current CUDA device.
    """
    if world == 1:
        return SINGLE
    env = os.environ
    local_rank = int(env.get("LOCAL_RANK", rank))
    cuda = wants_cuda(args) and torch.cuda.is_available()
    if cuda:
        check_gpu_count(int(env.get("LOCAL_WORLD_SIZE", ranks_on_this_host(args))), world)
        torch.cuda.set_device(local_rank)
    addr = env.get("MASTER_ADDR", args.master_addr)
    port = env.get("MASTER_PORT") or str(args.master_port)
    if not cuda and addr.startswith("127.") and sys.platform == "linux" \
            and "GLOO_SOCKET_IFNAME" not in env:
        # gloo otherwise resolves the hostname, which in containers may not be loopback
        os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    timeout = timedelta(seconds=max(args.startup_timeout, MIN_COLLECTIVE_TIMEOUT_S))
    # env:// rather than tcp://: under torchrun the launcher already serves the store on
    # MASTER_PORT (TORCHELASTIC_USE_AGENT_STORE), and env:// joins it instead of binding.
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = addr, port
    torch.distributed.init_process_group(
        "nccl" if cuda else "gloo", init_method="env://", rank=rank,
        world_size=world, timeout=timeout,
        device_id=torch.device("cuda", local_rank) if cuda else None)
    return TPGroup(rank, world)


def check_gpu_count(local_ranks: int, world: int) -> None:
    """Refuse more CUDA ranks on this host than it has GPUs (one GPU a rank). Every rank
    checks before the rendezvous, so none is left waiting for a rank that cannot start."""
    gpus = torch.cuda.device_count()
    if local_ranks > gpus:
        raise UnsupportedFeatureError(
            f"tensor_parallel_size={world} puts {local_ranks} ranks on this host, one GPU "
            f"each, but {gpus} CUDA device(s) are visible: lower tensor_parallel_size, make "
            "more GPUs visible (CUDA_VISIBLE_DEVICES), or run the ranks on the CPU "
            "(device='cpu', over gloo)", "tensor_parallel_size")


def current_group(world: int) -> TPGroup:
    """The group ``init_from_env`` joined (checked against the world size the caller expects)."""
    if world == 1:
        return SINGLE
    dist = torch.distributed
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError(f"tensor_parallel_size={world}: call distributed.init_from_env first")
    if dist.get_world_size() != world:
        raise RuntimeError(f"the process group has {dist.get_world_size()} ranks, "
                           f"tensor_parallel_size is {world}")
    return TPGroup(dist.get_rank(), world)


def ranks_on_this_host(args: EngineArgs) -> int:
    """How many ranks share this host's cores and RAM (the ranks split evenly over nodes)."""
    return max(1, args.tensor_parallel_size // max(1, getattr(args, "nnodes", 1)))


def share_cpu_threads(local_ranks: int) -> None:
    """CPU ranks run side by side on one host: each takes its share of the cores
    (oversubscribed threads would spin against each other), unless the user pinned a count."""
    if local_ranks == 1 or "OMP_NUM_THREADS" in os.environ or "POCKETLLM_NUM_THREADS" in os.environ:
        return
    torch.set_num_threads(max(1, torch.get_num_threads() // local_ranks))


def shutdown() -> None:
    """Leave the process group (no barrier: a peer may already be gone)."""
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
