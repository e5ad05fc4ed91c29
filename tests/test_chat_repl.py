"""`pocketllm chat`: a conversation over a pipe, the history kept, /exit and end of input."""

from __future__ import annotations

import io
import os
import subprocess
import sys

from pocketllm import EngineArgs, SamplingParams
from pocketllm.chat_repl import run_chat

GREEDY = SamplingParams(max_tokens=6, temperature=0)


def test_repl_keeps_the_conversation_and_stops_at_exit(tiny_llama, llm_tiny):
    out = io.StringIO()
    rc = run_chat(EngineArgs(model=tiny_llama, max_num_batched_tokens=64, seed=0), GREEDY,
                  "Be brief.", stdin=io.StringIO("Hello\n\nAnd then?\n/exit\nnot sent\n"),
                  stdout=out)
    assert rc == 0
    system = [{"role": "system", "content": "Be brief."}]
    [one] = llm_tiny.chat([*system, {"role": "user", "content": "Hello"}], GREEDY)
    [two] = llm_tiny.chat([*system, {"role": "user", "content": "Hello"},
                           {"role": "assistant", "content": one.text},
                           {"role": "user", "content": "And then?"}], GREEDY)
    # two answers (the second saw the first), the blank line skipped, nothing after /exit
    assert out.getvalue() == one.text + "\n" + two.text + "\n"


def test_chat_command_over_a_pipe_ends_at_end_of_input(tiny_llama, llm_tiny):
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    proc = subprocess.run(
        [sys.executable, "-m", "pocketllm", "chat", "--model", tiny_llama, "--max-tokens", "4",
         "--max-num-batched-tokens", "64"],
        input="Hi\n", capture_output=True, text=True, timeout=300, cwd=root)
    assert proc.returncode == 0, proc.stderr[-2000:]
    [answer] = llm_tiny.chat([{"role": "user", "content": "Hi"}],
                             SamplingParams(max_tokens=4, temperature=0))
    assert proc.stdout == answer.text + "\n"  # no prompt on a pipe, one answer
