"""Detokenizer process: TokenBatch in, RequestOutput deltas to the frontend."""

import logging

from ..process import StageContext, run_stage
from ..proto import codec, endpoints
from ..proto.messages import (ErrorDetail, ErrorKind, Ping, Pong, RequestOutput, Shutdown,
                              StopMatched)
from ..tokenizer.tokenizer import load_tokenizer
from .detokenizer import Detokenizer

log = logging.getLogger("pocketllm.detokenizer")


def encode_output(out: RequestOutput) -> tuple[bytes, bool]:
    """The output's bytes; one that cannot be encoded becomes its request's final error
    (True: the request failed here, so the scheduler must stop it)."""
    try:
        return codec.encode(out), False
    except Exception as e:  # noqa: BLE001 - one request's output, never the loop
        log.exception("request %s: its output could not be encoded", out.request_id)
        return codec.encode(RequestOutput(
            request_id=out.request_id, text="", token_ids=[], finished=True,
            finish_reason="error", error=ErrorDetail(
                ErrorKind.internal, f"the detokenizer could not send this request's output "
                f"({type(e).__name__})"))), not out.finished


def main(ctx: StageContext) -> None:
    inbox = ctx.pull(endpoints.detokenizer(ctx.run_dir))
    to_frontend = ctx.push(endpoints.frontend(ctx.run_dir))
    to_scheduler = ctx.push(endpoints.scheduler(ctx.run_dir))
    detok = Detokenizer(load_tokenizer(ctx.info, decode_only=True).tokenizer)
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
        sent = []
        for out in outputs:
            data, failed = encode_output(out)
            if failed:  # it ends here: forget it, and let the scheduler stop computing it
                detok.forget(out.request_id)
                stopped.append(out.request_id)
            sent.append(data)
        if stopped:  # a stop string matched (or the request failed here): stop computing it
            to_scheduler.send(codec.encode(StopMatched(request_ids=stopped)))
        for data in sent:
            to_frontend.send(data)


if __name__ == "__main__":
    run_stage("detokenizer", main)
