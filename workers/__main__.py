"""Worker process (one per tensor-parallel rank): ``python -m pocketllm.workers RUN_DIR RANK``."""

import sys

from pocketllm.process import StageContext, run_stage
from pocketllm.proto import codec, endpoints
from pocketllm.proto.messages import Shutdown, WorkerReady


def main(ctx: StageContext) -> None:
    rank = int(sys.argv[2])
    inbox = ctx.pull(endpoints.worker(ctx.run_dir, rank))
    to_scheduler = ctx.push(endpoints.scheduler(ctx.run_dir))
    from .runner import ModelRunner  # torch is imported here, in the worker only

    runner = ModelRunner(ctx.info, ctx.args, rank=rank,
                         world_size=ctx.args.tensor_parallel_size, show_progress=rank == 0)
    to_scheduler.send(codec.encode(WorkerReady(rank=rank, capabilities=runner.capabilities())))
    ctx.ready(info={"rank": rank})
    decoder = codec.decoder_for("worker")
    while True:
        plan = decoder.decode(inbox.recv())
        if isinstance(plan, Shutdown):
            return
        result = runner.execute(plan)
        if rank == 0:
            to_scheduler.send(codec.encode(result))


if __name__ == "__main__":
    run_stage(f"worker{sys.argv[2]}", main)
