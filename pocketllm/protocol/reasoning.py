"""Whether a chat answer carries a thinking block, and how the detokenizer finds it.

A template "teaches" a thinking block when its source writes ``<think>`` and the
tokenizer has ``<think>`` and ``</think>`` as single tokens (Qwen3, DeepSeek-R1
and QwQ templates). The block then starts and ends on those token ids, never on
text, so a tag-like string inside the reasoning or the answer cannot move it.

``drop_thinking`` (a PocketLLM chat extension) means: the model still thinks
(the prompt is the same), but the response carries none of the block, neither
``reasoning_content`` nor its log probabilities; ``content`` is the answer only.
Sent as true to a checkpoint whose template has no block, it is refused.
"""

from __future__ import annotations

from typing import Optional

from ..errors import UnsupportedFeatureError
from ..proto.messages import OutputSplit

REASONING_START, REASONING_END = "<think>", "</think>"


def reasoning_split(template_source: Optional[str], loaded, prompt_ids: list[int],
                    drop_thinking: bool) -> Optional[OutputSplit]:
    """The reasoning part of the request's OutputSplit, or None when the template has no block.

    ``in_reasoning``: the rendered prompt already opened the block (Qwen3's
    thinking generation prompt ends in ``<think>\\n``), i.e. the last start tag
    of the prompt comes after its last end tag and only whitespace follows it.
    """
    start = loaded.token_id(REASONING_START)
    end = loaded.token_id(REASONING_END)
    if not template_source or REASONING_START not in template_source or start is None \
            or end is None:
        if drop_thinking:
            raise UnsupportedFeatureError(
                "drop_thinking needs a thinking block, and this checkpoint's chat template has "
                "none (no <think>/</think> tokens); send the request without drop_thinking",
                "drop_thinking")
        return None
    last_start = _last_index(prompt_ids, start)
    in_reasoning = last_start > _last_index(prompt_ids, end) and not loaded.tokenizer.decode(
        prompt_ids[last_start + 1:], skip_special_tokens=False).strip()
    return OutputSplit(reasoning_start_id=start, reasoning_end_id=end, in_reasoning=in_reasoning,
                       drop_reasoning=bool(drop_thinking))


def _last_index(ids: list[int], token: int) -> int:
    for i in range(len(ids) - 1, -1, -1):
        if ids[i] == token:
            return i
    return -1
