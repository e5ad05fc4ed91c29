"""Tools for a chat template that cannot show them (the default Gemma's, and any other
without a `tools` variable): the tools go into a system message in a fixed format, and the
history's calls and results become plain text in the same syntax.

The format (docs/api.md "Tool calls", "Templates without tools"):

    You can call the functions listed below, one JSON object per line (name,
    description, parameters as a JSON schema).
    <functions>
    {"name": "get_weather", "description": "...", "parameters": {...}}
    </functions>
    To call a function, write:
    <tool_call>
    {"name": "FUNCTION_NAME", "arguments": {...}}
    </tool_call>

then one line saying what the request's tool_choice demands. It is appended (after a
blank line) to the first system message, or becomes the first message. An assistant turn's
`tool_calls` are written after its content in the call syntax; each run of `role: "tool"`
messages becomes one user turn of `<tool_response>\nRESULT\n</tool_response>` blocks.
"""

from __future__ import annotations

import json
import re
from typing import Any, Optional

# The call syntax forced calls use when the template teaches none (and no --tool-call-parser).
FORCED_SYNTAX = "hermes"

_TOOLS_VARIABLE = re.compile(r"\btools\b")

_EXAMPLES = {
    "hermes": '<tool_call>\n{"name": "FUNCTION_NAME", "arguments": {ARGUMENTS AS A JSON '
              'OBJECT}}\n</tool_call>',
    "qwen3_xml": "<tool_call>\n<function=FUNCTION_NAME>\n<parameter=ARGUMENT_NAME>\nVALUE\n"
                 "</parameter>\n</function>\n</tool_call>",
}


def template_shows_tools(source: Optional[str]) -> bool:
    """Whether the template reads the `tools` variable (otherwise it would drop them)."""
    return source is not None and bool(_TOOLS_VARIABLE.search(source))


def tools_system_text(tools: list, syntax: str, choice: Any, parallel: bool) -> str:
    lines = ["You can call the functions listed below, one JSON object per line (name, "
             "description, parameters as a JSON schema).", "<functions>"]
    for tool in tools:
        fn = tool["function"]
        entry = {"name": fn["name"]}
        if fn.get("description"):
            entry["description"] = fn["description"]
        entry["parameters"] = fn.get("parameters") or {"type": "object"}
        lines.append(json.dumps(entry, ensure_ascii=False))
    lines += ["</functions>", "To call a function, write:", _EXAMPLES[syntax]]
    if isinstance(choice, dict):
        lines.append(f"Now call the function {choice['function']['name']}, and write nothing "
                     "else.")
    elif choice == "required":
        lines.append("Now call one of the functions" + (" (or several, one block each)"
                                                       if parallel else "") +
                     ", and write nothing else.")
    else:
        lines.append("Call a function only when it helps; otherwise answer in plain text.")
    return "\n".join(lines)


def call_text(syntax: str, name: str, arguments: dict) -> str:
    """One call as the model would write it in `syntax`."""
    if syntax == "hermes":
        body = json.dumps({"name": name, "arguments": arguments}, ensure_ascii=False)
        return f"<tool_call>\n{body}\n</tool_call>"
    params = "".join(
        f"<parameter={k}>\n{v if isinstance(v, str) else json.dumps(v, ensure_ascii=False)}\n"
        "</parameter>\n" for k, v in arguments.items())
    return f"<tool_call>\n<function={name}>\n{params}</function>\n</tool_call>"


def with_tools_in_text(messages: list[dict], syntax: str, tools: Optional[list] = None,
                       choice: Any = "auto", parallel: bool = True) -> list[dict]:
    """The messages rewritten for a template without tools (a new list; the normalized
    messages are the stage's private copy, so entries may be replaced, never mutated)."""
    out: list[dict] = []
    for msg in messages:
        if msg["role"] == "assistant" and msg.get("tool_calls"):
            calls = [call_text(syntax, c["function"]["name"], c["function"]["arguments"])
                     for c in msg["tool_calls"]]
            text = "\n".join(([msg["content"]] if msg["content"] else []) + calls)
            out.append({"role": "assistant", "content": text})
        elif msg["role"] == "tool":
            block = f"<tool_response>\n{msg['content']}\n</tool_response>"
            if out and out[-1].get("_tool_results"):
                out[-1] = {**out[-1], "content": out[-1]["content"] + "\n" + block}
            else:
                out.append({"role": "user", "content": block, "_tool_results": True})
        else:
            out.append(msg)
    out = [{k: v for k, v in m.items() if k != "_tool_results"} for m in out]
    if tools:
        text = tools_system_text(tools, syntax, choice, parallel)
        if out and out[0]["role"] == "system":
            out[0] = {**out[0], "content": (out[0]["content"] + "\n\n" + text).lstrip()}
        else:
            out.insert(0, {"role": "system", "content": text})
    return out
