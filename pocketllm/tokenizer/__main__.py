"""Tokenizer process: GenerateRequest in, TokenizedRequest to the scheduler (or RequestError out)."""

from ..process import StageContext, run_stage
from ..proto import codec, endpoints
from ..proto.messages import ErrorKind, Ping, Pong, RequestError, Shutdown
from .stage import TokenizerStage


def main(ctx: StageContext) -> None:
    inbox = ctx.pull(endpoints.tokenizer(ctx.run_dir))
    to_scheduler = ctx.push(endpoints.scheduler(ctx.run_dir))
    to_frontend = ctx.push(endpoints.frontend(ctx.run_dir))
    stage = TokenizerStage(ctx.info, tool_call_parser=ctx.args.tool_call_parser)
    decoder = codec.decoder_for("tokenizer")
    ctx.ready(info={"vocab_size": stage.tokenizer.get_vocab_size(),
                    "chat_template": stage.chat.available})
    while True:
        msg = decoder.decode(inbox.recv())
        if isinstance(msg, Shutdown):
            return
        if isinstance(msg, Ping):  # the frontend's heartbeat: this loop is not stuck
            to_frontend.send(codec.encode(Pong("tokenizer", msg.seq)))
            continue
        out = stage.handle(msg)
        try:
            data = codec.encode(out)
        except Exception as e:  # noqa: BLE001 - e.g. a value that cannot travel: fail the request
            why = f"{type(e).__name__}: {e}".encode("utf-8", "replace").decode("utf-8")
            out = RequestError(msg.request_id, f"the tokenized request could not be sent on "
                               f"({why})", kind=ErrorKind.invalid_request)
            data = codec.encode(out)
        (to_frontend if isinstance(out, RequestError) else to_scheduler).send(data)


if __name__ == "__main__":
    run_stage("tokenizer", main)
