"""Tokenizer process: GenerateRequest in, TokenizedRequest to the scheduler (or RequestError out)."""

from ..process import StageContext, run_stage
from ..proto import endpoints
from .loop import TokenizerLoop
from .stage import TokenizerStage


def main(ctx: StageContext) -> None:
    inbox = ctx.pull(endpoints.tokenizer(ctx.run_dir))
    to_scheduler = ctx.push(endpoints.scheduler(ctx.run_dir))
    to_frontend = ctx.push(endpoints.frontend(ctx.run_dir))
    stage = TokenizerStage(ctx.info, tool_call_parser=ctx.args.tool_call_parser,
                           max_output_tokens=ctx.args.max_output_tokens,
                           structured_output_timeout_s=ctx.args.structured_output_timeout_s)
    ctx.ready(info={"vocab_size": stage.tokenizer.get_vocab_size(),
                    "chat_template": stage.chat.available})
    TokenizerLoop(stage, inbox, to_scheduler, to_frontend).run()


if __name__ == "__main__":
    run_stage("tokenizer", main)
