"""Detokenizer process: TokenBatch in, RequestOutput deltas to the frontend."""

from ..process import StageContext, run_stage
from ..proto import codec, endpoints
from ..proto.messages import Abort, Ping, Pong, Shutdown
from ..tokenizer.tokenizer import load_tokenizer
from .detokenizer import Detokenizer


def main(ctx: StageContext) -> None:
    inbox = ctx.pull(endpoints.detokenizer(ctx.run_dir))
    to_frontend = ctx.push(endpoints.frontend(ctx.run_dir))
    to_scheduler = ctx.push(endpoints.scheduler(ctx.run_dir))
    detok = Detokenizer(load_tokenizer(ctx.info).tokenizer)
    decoder = codec.decoder_for("detokenizer")
    ctx.ready()
    while True:
        msg = decoder.decode(inbox.recv())
        if isinstance(msg, Shutdown):
            return
        if isinstance(msg, Ping):  # the frontend's heartbeat: this loop is not stuck
            to_frontend.send(codec.encode(Pong("detokenizer", msg.seq)))
            continue
        outputs, stopped = detok.process(msg)
        if stopped:  # a stop string matched: the scheduler stops computing them
            to_scheduler.send(codec.encode(Abort(request_ids=stopped, reason="stop")))
        for out in outputs:
            to_frontend.send(codec.encode(out))


if __name__ == "__main__":
    run_stage("detokenizer", main)
