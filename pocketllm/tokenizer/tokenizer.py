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
    placeholder: bool = False  # dummy weights without a vocabulary: token i reads "<i>"
    # The longest vocabulary entry in characters, where the loader had the list at hand
    # (a GGUF's; None: ask the tokenizer, 0.2 s for a 262k vocabulary).
    longest_token: Optional[int] = None

    def token_id(self, token: Optional[str]) -> Optional[int]:
        return None if token is None else self.tokenizer.token_to_id(token)


def load_tokenizer(info: ModelInfo, decode_only: bool = False) -> LoadedTokenizer:
    """``decode_only``: a GGUF vocabulary may leave out what only encoding needs (the
    detokenizer's; see ``tokenizer_from_gguf``)."""
    path = info.tokenizer_path
    if path is None:
        if info.format == "dummy":
            return LoadedTokenizer(placeholder_tokenizer(info.vocab_size), {}, placeholder=True)
        raise CheckpointError(f"{info.path!r} has no tokenizer.json; PocketLLM reads the "
                              "fast-tokenizer format (save it with a recent transformers), or "
                              "pass --tokenizer")
    if path.endswith(".gguf"):
        from ..gguf_meta import read_gguf_metadata
        from .gguf_vocab import tokenizer_from_gguf

        tok = tokenizer_from_gguf(path, decode_only=decode_only)
        meta = read_gguf_metadata(path)
        specials = {}
        for name, key in (("bos_token", "tokenizer.ggml.bos_token_id"),
                          ("eos_token", "tokenizer.ggml.eos_token_id")):
            if meta.get(key) is not None:
                specials[name] = tok.id_to_token(int(meta[key]))
        return LoadedTokenizer(tok, specials,
                               longest_token=max(map(len, meta["tokenizer.ggml.tokens"])))
    from tokenizers import Tokenizer

    try:
        tok = Tokenizer.from_file(path)
    except Exception as e:
        raise CheckpointError(f"cannot load {path!r}: {e}") from None
    specials = {}
    for name in ("bos_token", "eos_token", "pad_token", "unk_token"):
        value = info.tokenizer_config.get(name)
        if isinstance(value, dict):
            value = value.get("content")
        if isinstance(value, str):
            specials[name] = value
    return LoadedTokenizer(tok, specials)


def placeholder_tokenizer(vocab_size: int) -> "tokenizers.Tokenizer":  # noqa: F821
    """For random weights from a bare config.json (benchmarks): every id decodes to the
    visible ``<id>`` and text prompts are refused by the tokenizer stage, so nothing
    pretends the output is language."""
    from tokenizers import Tokenizer, decoders
    from tokenizers.models import WordLevel

    tok = Tokenizer(WordLevel({f"<{i}>": i for i in range(vocab_size)}, unk_token="<0>"))
    tok.decoder = decoders.Fuse()
    return tok
