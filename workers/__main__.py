"""Worker process (one per tensor-parallel rank): ``python -m pocketllm.workers RUN_DIR RANK``."""

import gc
import logging
import os
import sys

from pocketllm.process import StageContext, run_stage
from pocketllm.proto import codec, endpoints
from pocketllm.proto.messages import Ping, Pong, Shutdown, WorkerReady

logger = logging.getLogger("pocketllm.worker")


def main(ctx: StageContext) -> None:
    rank = int(sys.argv[2])
    args = ctx.args
    world = args.tensor_parallel_size
    if rank < world // args.nnodes:  # on rank 0's host: local sockets
        inbox = ctx.pull(endpoints.worker(ctx.run_dir, rank))
        recv, send = inbox.recv, ctx.push(endpoints.scheduler(ctx.run_dir)).send
        # The frontend's heartbeats arrive between plans; answered between steps.
        to_frontend = ctx.push(endpoints.frontend(ctx.run_dir))
    else:  # another host: the authenticated TCP link to rank 0's scheduler
        from pocketllm.remote import SchedulerLink, plan_endpoint, read_secret

        link = SchedulerLink(ctx.zmq, plan_endpoint(args.master_addr, args.master_port),
                             read_secret(args.tensor_parallel_secret_file), rank)
        recv, send = link.recv, link.send
    runner, _why = lite_runner(ctx.info, args, world)  # a CPU GGUF model: no torch at all
    fatal: tuple = ()  # what stops this rank (a tensor-parallel step out of step)
    if runner is None:
        distributed, runner = torch_runner(ctx, rank, world)
        fatal = (distributed.RankFailure,)
    try:
        send(codec.encode(WorkerReady(rank=rank, capabilities=runner.capabilities())))
        ctx.ready(info={"rank": rank, "tensor_parallel_size": world})
        decoder = codec.decoder_for("worker")
        launched = None  # a step queued on the device whose tokens are not sent yet
        while True:
            plan = decoder.decode(recv())
            if isinstance(plan, Shutdown):
                return
            if isinstance(plan, Ping):  # only local ranks get them (remote: no such socket)
                to_frontend.send(codec.encode(Pong(f"worker{rank}", plan.seq)))
                continue
            try:  # every rank runs the same plan (collectives inside)
                step = runner.launch(plan)
                if launched is not None:  # the previous step promised this one: overlap
                    send_result(rank, send, runner.finish(launched))
                    launched = None
                if plan.next_follows and not runner.computes_at_launch:
                    launched = step  # launch the next plan before reading these tokens
                else:
                    send_result(rank, send, runner.finish(step))
            except fatal:
                logger.exception("tensor-parallel step %s failed; stopping this rank", plan.step_id)
                os._exit(1)  # no process-group teardown: a peer is gone or out of step
    finally:
        if fatal:
            distributed.shutdown()


def lite_runner(info, args, world: int):
    """(the torch-free runner where it can serve the model (workers/lite), None), else
    (None, why not)."""
    from .lite.model import worker_refusal

    why = worker_refusal(info, args, world)
    if why is None:
        from pocketllm.errors import UnsupportedFeatureError

        from .lite.runner import LiteRunner

        try:
            return LiteRunner(info, args), None
        except UnsupportedFeatureError as e:  # e.g. a tensor type with no kernel
            why = str(e)
    logger.info("the torch worker serves this model (the torch-free one does not: %s)", why)
    return None, why


def torch_runner(ctx: StageContext, rank: int, world: int):
    """(the ``distributed`` module, a ``ModelRunner``), torch imported here."""
    # torch is imported here, in the worker only, with the collector paused: the import
    # makes ~250k objects that live as long as the process, and collections among them
    # cost ~0.2 s of CPU before ready. Frozen, no later collection walks them either; the
    # import's own reference cycles (~7k objects, under 1 MB) are never freed.
    gc.disable()
    try:
        from . import distributed
        from .models.base import check_tensor_parallel
        from .models.registry import arch_config
        from .runner import ModelRunner
    finally:
        gc.freeze()
        gc.enable()

    # Every rank refuses a model whose heads do not split before the rendezvous,
    # so none is left waiting for the others.
    check_tensor_parallel(arch_config(ctx.info), world)
    distributed.init_from_env(ctx.args, rank, world)
    return distributed, ModelRunner(ctx.info, ctx.args, rank=rank, world_size=world,
                                    show_progress=rank == 0)


def send_result(rank: int, send, result) -> None:
    if rank == 0:  # only rank 0 holds the logits and samples
        send(codec.encode(result))


if __name__ == "__main__":
    run_stage(f"worker{sys.argv[2]}", main)
