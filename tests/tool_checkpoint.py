"""A tiny random checkpoint whose chat template teaches Hermes-style tool calls (Qwen3's shape).

The template renders `tools` into a system turn, assistant `tool_calls` (arguments as
an object, as Qwen templates expect) and `role: "tool"` results; `<tool_call>` and
`</tool_call>` are made non-special tokens, as in Qwen's tokenizer, so they survive
`skip_special_tokens` and reach the parser as text. With ``special_tags`` they stay
special (as some checkpoints and GGUF conversions mark them): the detokenizer must then
show them to the parser itself.
"""

from __future__ import annotations

import json
import os

from tiny_checkpoints import make_tiny_checkpoint

HERMES_TEMPLATE = (
    "{{ bos_token }}"
    "{%- if tools %}<|system|>{% if messages[0]['role'] == 'system' %}"
    "{{ messages[0]['content'] }}\n\n{% endif %}"  # short: the tiny model reads 512 tokens
    "<tools>{% for tool in tools %}\n{{ tool | tojson }}{% endfor %}\n</tools>\n"
    "Call as <tool_call>\n{\"name\": <name>, \"arguments\": <args>}\n</tool_call><|end|>"
    "{%- elif messages[0]['role'] == 'system' %}<|system|>{{ messages[0]['content'] }}<|end|>"
    "{%- endif %}"
    "{%- for m in messages %}"
    "{%- if m['role'] == 'system' and loop.first %}"
    "{%- elif m['role'] == 'assistant' %}<|assistant|>{{ m['content'] }}"
    "{%- for tc in m['tool_calls'] or [] %}{% if not loop.first or m['content'] %}\n{% endif %}"
    "<tool_call>\n{\"name\": \"{{ tc['function']['name'] }}\", \"arguments\": "
    "{{ tc['function']['arguments'] | tojson }}}\n</tool_call>{% endfor %}<|end|>"
    "{%- elif m['role'] == 'tool' %}<|user|><tool_response>\n{{ m['content'] }}\n"
    "</tool_response><|end|>"
    "{%- else %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>{% endif %}"
    "{%- endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}")

# Qwen3-Coder's shape: arguments iterated as an object, one <parameter=...> each.
XML_TEMPLATE = HERMES_TEMPLATE.replace(
    "Call as <tool_call>\n{\"name\": <name>, \"arguments\": <args>}\n</tool_call>",
    "Call as <tool_call>\n<function=NAME>\n<parameter=ARG>\nVALUE\n</parameter>\n</function>"
    "\n</tool_call>").replace(
    "<tool_call>\n{\"name\": \"{{ tc['function']['name'] }}\", \"arguments\": "
    "{{ tc['function']['arguments'] | tojson }}}\n</tool_call>",
    "<tool_call>\n<function={{ tc['function']['name'] }}>\n"
    "{% for k, v in tc['function']['arguments'].items() %}<parameter={{ k }}>\n{{ v }}\n"
    "</parameter>\n{% endfor %}</function>\n</tool_call>")
assert XML_TEMPLATE != HERMES_TEMPLATE and "tojson }}}" not in XML_TEMPLATE


def make_tool_checkpoint(path: str, family: str = "llama",
                         template: str = HERMES_TEMPLATE, special_tags: bool = False) -> str:
    make_tiny_checkpoint(family, path)
    cfg_path = os.path.join(path, "tokenizer_config.json")
    with open(cfg_path) as f:
        cfg = json.load(f)
    cfg["chat_template"] = template
    with open(cfg_path, "w") as f:
        json.dump(cfg, f)
    tok_path = os.path.join(path, "tokenizer.json")
    with open(tok_path) as f:
        tok = json.load(f)
    for added in tok["added_tokens"]:
        if added["content"] in ("<tool_call>", "</tool_call>"):
            added["special"] = special_tags
    with open(tok_path, "w") as f:
        json.dump(tok, f)
    return path
