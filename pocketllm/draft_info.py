"""The draft model of ``speculative_method="draft"``, resolved in the control plane (where
models are fetched: no worker downloads) before the stages start, and checked against
the target's vocabulary."""

from __future__ import annotations

from typing import Optional

from .config import EngineArgs
from .errors import UnsupportedFeatureError
from .model_info import ModelInfo, load_model_info
from .tokenizer.tokenizer import load_tokenizer


def draft_model_info(args: EngineArgs, info: ModelInfo) -> ModelInfo:
    """Resolved with the target's load format and context length, and refused unless its
    vocabulary is the target's token for token: its drafts are token ids."""
    draft_args = args.without_speculation(
        model=args.speculative_model, tokenizer=None, revision=None, chat_template=None,
        quantization=None, max_model_len=info.max_model_len)
    draft = load_model_info(draft_args)
    why = _vocabulary_differs(info, draft)
    if why:
        raise UnsupportedFeatureError(f"the draft model {args.speculative_model!r} cannot draft "
                                      f"for this model: {why}", "speculative_model")
    return draft


def _vocabulary_differs(target: ModelInfo, draft: ModelInfo) -> Optional[str]:
    if draft.vocab_size != target.vocab_size:
        return f"its vocabulary has {draft.vocab_size} ids, the model's {target.vocab_size}"
    a, b = (load_tokenizer(i, decode_only=True).tokenizer.get_vocab(with_added_tokens=True)
            for i in (target, draft))
    if a != b:
        moved = sorted(set(a.items()) ^ set(b.items()))[:3]
        return f"its tokenizer maps tokens to other ids (e.g. {moved})"
    return None


def with_draft(args: EngineArgs, info: ModelInfo) -> ModelInfo:
    """``info`` with its draft model's (``ModelInfo.draft``) where speculation asks for one."""
    if args.speculative_model is not None and info.draft is None:
        info.draft = draft_model_info(args, info).to_dict()
    return info
