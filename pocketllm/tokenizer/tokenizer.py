"""Loading a checkpoint's tokenizer (tokenizer.json or a GGUF vocabulary) without torch."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from ..errors import CheckpointError
from ..model_info import ModelInfo


@dataclass
class LoadedTokenizer:
    tokenizer: "tokenizers.Tokenizer"  # noqa: F821
    special_tokens: dict[str, str]  # bos_token / eos_token as chat templates expect them

    def token_id(self, token: Optional[str]) -> Optional[int]:
        return None if token is None else self.tokenizer.token_to_id(token)


def load_tokenizer(info: ModelInfo) -> LoadedTokenizer:
    if info.format == "gguf":
        from .gguf_vocab import tokenizer_from_gguf

        tok = tokenizer_from_gguf(info.tokenizer_path)
        specials = {}
        for name, key in (("bos_token", "tokenizer.ggml.bos_token_id"),
                          ("eos_token", "tokenizer.ggml.eos_token_id")):
            tid = info.tokenizer_config.get(key)
            if tid is not None:
                specials[name] = tok.id_to_token(int(tid))
        return LoadedTokenizer(tok, specials)
    if not info.tokenizer_path:
        raise CheckpointError(f"{info.path!r} has no tokenizer.json; PocketLLM reads the "
                              "fast-tokenizer format (save it with a recent transformers)")
    from tokenizers import Tokenizer

    try:
        tok = Tokenizer.from_file(info.tokenizer_path)
    except Exception as e:
        raise CheckpointError(f"cannot load {info.tokenizer_path!r}: {e}") from None
    specials = {}
    for name in ("bos_token", "eos_token", "pad_token", "unk_token"):
        value = info.tokenizer_config.get(name)
        if isinstance(value, dict):
            value = value.get("content")
        if isinstance(value, str):
            specials[name] = value
    return LoadedTokenizer(tok, specials)
