"""`pocketllm chat`: an interactive conversation, each answer streamed as it is generated.

One line is one user message; the conversation (system message, turns, answers) is kept
and sent whole each turn, as a chat client would. `/exit`, `/quit` or end of input (Ctrl-D,
or the end of a piped stdin) quits; `/reset` starts over. A request the engine refuses
(the conversation outgrew max_model_len, say) prints its error and the session goes on.
"""

from __future__ import annotations

import sys
from typing import Optional, TextIO

from .config import EngineArgs
from .errors import InvalidRequestError, UnsupportedFeatureError
from .sampling import SamplingParams

EXIT_COMMANDS = ("/exit", "/quit")


def run_chat(args: EngineArgs, params: SamplingParams, system: Optional[str] = None,
             stdin: TextIO = sys.stdin, stdout: TextIO = sys.stdout) -> int:
    from . import LLM

    interactive = stdin.isatty()
    start = [{"role": "system", "content": system}] if system else []
    messages = list(start)
    with LLM(args) as llm:
        if interactive:
            print("Chatting with the model; /exit or Ctrl-D quits, /reset starts over.",
                  file=sys.stderr)
        while True:
            if interactive:
                stdout.write(">>> ")
                stdout.flush()
            line = stdin.readline()
            if not line:  # end of input
                if interactive:
                    stdout.write("\n")
                return 0
            text = line.strip()
            if text in EXIT_COMMANDS:
                return 0
            if text == "/reset":
                messages = list(start)
                continue
            if not text:
                continue
            messages.append({"role": "user", "content": text})
            try:
                answer = _stream_answer(llm, messages, params, stdout)
            except (InvalidRequestError, UnsupportedFeatureError) as e:
                messages.pop()
                print(f"pocketllm: error: {e}", file=sys.stderr)
                continue
            messages.append({"role": "assistant", "content": answer})


def _stream_answer(llm, messages: list[dict], params: SamplingParams, stdout: TextIO) -> str:
    parts = []
    for event in llm.chat_stream(messages, params):
        if event.text:
            parts.append(event.text)
            stdout.write(event.text)
            stdout.flush()
    stdout.write("\n")
    stdout.flush()
    return "".join(parts)
