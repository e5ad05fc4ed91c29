"""A HuggingFace ``tokenizers.Tokenizer`` built from a GGUF file's vocabulary metadata.

A GGUF carries no tokenizer.json, only llama.cpp's description of one:
``tokenizer.ggml.model`` is ``"llama"`` (SentencePiece-style BPE over
``▁``-escaped text with byte fallback, e.g. Llama 2, Gemma) or ``"gpt2"``
(byte-level BPE with explicit merges, e.g. Llama 3, Qwen). The tokenizer built
here follows transformers' GGUF conversion, which tests use as the reference:

* SentencePiece files list no merges; they are recovered from the vocabulary
  (every split of a token into two tokens is a merge), ranked by the token's
  score, or for Gemma by its position in the file (Gemma's scores do not
  follow its merge order). Only the merges that can fire are kept
  (``_firing_merges``): the same encodings from half the merges.
* Control tokens (type 3) become special added tokens: matched whole in text,
  skipped by ``decode(skip_special_tokens=True)``. User-defined tokens (type 4)
  become plain added tokens, also matched whole.
* A byte-level file is cut into words first by the pre-tokenizer its
  ``tokenizer.ggml.pre`` names, from the table in ``gguf_pretokenizers.py``
  (a SentencePiece file's name is ignored, as llama.cpp does).
* BOS (and EOS) is added by the post-processor as ``tokenizer.ggml.add_bos_token``
  (``add_eos_token``) says.
"""

from __future__ import annotations

import gc
from array import array
from collections.abc import Iterator, Sequence
from itertools import compress, count
from typing import Optional, Union

from tokenizers import (AddedToken, Regex, Tokenizer, decoders, models, normalizers,
                        pre_tokenizers, processors)

from ..errors import CheckpointError, UnsupportedFeatureError
from ..gguf_meta import LazyStrings, read_gguf_header
from ..protocol.byte_level import BYTE_TO_CHAR
from .gguf_pretokenizers import PRE_TOKENIZERS, REFUSED, PreTokenizer
from .merges_cache import cached_vocabulary, vocab_key

# llama.cpp token types
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6

_SPACE = "\u2581"  # SentencePiece's escaped space
_POSITION_RANKED_ARCHS = {"gemma", "gemma2", "gemma3"}

def tokenizer_from_gguf(path: str, decode_only: bool = False
                        ) -> Union[Tokenizer, DecodeOnlyTokenizer]:
    """``decode_only``: what decoding reads only (the detokenizer's): a
    ``DecodeOnlyTokenizer``, without the model and its merges (recovering a SentencePiece
    vocabulary's merges takes ~1 s for 262k tokens)."""
    # With the collector paused: the build makes ~1.3M strings, tuples and lists, none in a
    # cycle, and collections that walk them cost ~0.1 s of the tokenizer stage's start.
    enabled = gc.isenabled()
    gc.disable()
    try:
        return _tokenizer_from_gguf(path, decode_only)
    finally:
        if enabled:
            gc.enable()


def _tokenizer_from_gguf(path: str, decode_only: bool) -> Tokenizer:
    meta = read_gguf_header(path).metadata
    kind = meta.get("tokenizer.ggml.model")
    field = meta.get("tokenizer.ggml.tokens")
    if not field:
        raise CheckpointError(f"{path!r} carries no tokenizer vocabulary (tokenizer.ggml.tokens)")
    types = meta.get("tokenizer.ggml.token_type") or [NORMAL] * len(field)
    if len(types) != len(field):
        raise CheckpointError(f"{path!r}: {len(types)} token types for {len(field)} tokens")
    if kind == "llama":
        tokens, merges = _sentencepiece_vocab(meta, field, decode_only)
        decoder = _sentencepiece_decoder(meta)
    elif kind == "gpt2":
        pre = pre_tokenizer(meta, path)
        tokens, merges = _byte_level_vocab(meta, field, path, decode_only)
        decoder = decoders.ByteLevel()
    else:
        raise UnsupportedFeatureError(
            f"{path!r}: GGUF tokenizer model {kind!r} is not supported (PocketLLM reads 'llama' and 'gpt2')")
    added = _added_tokens(meta, tokens, types, byte_level=kind == "gpt2")
    # (A vocabulary that repeats a string keeps the model: its maps give the string one id.)
    if decode_only and len(set(tokens)) == len(tokens):
        return DecodeOnlyTokenizer(tokens, added, decoder)
    if kind == "llama":
        tok, default_add_bos = _sentencepiece_bpe(meta, tokens, merges), True
    else:
        tok, default_add_bos = _byte_level_bpe(tokens, merges, pre), pre.add_bos
    tok.decoder = decoder
    tok.add_special_tokens([t for t in added.values() if t.special])
    tok.add_tokens([t for t in added.values() if not t.special])
    _set_post_processor(tok, meta, tokens, default_add_bos=default_add_bos)
    return tok


def pre_tokenizer(meta: dict, path: str) -> PreTokenizer:
    """The table entry for the file's ``tokenizer.ggml.pre`` (llama.cpp's 'default' when absent)."""
    name = meta.get("tokenizer.ggml.pre") or "default"
    if name in PRE_TOKENIZERS:
        return PRE_TOKENIZERS[name]
    why = REFUSED.get(name, "llama.cpp does not know it either")
    raise UnsupportedFeatureError(
        f"{path!r}: GGUF pre-tokenizer {name!r} is not supported: {why} "
        f"(PocketLLM knows {len(PRE_TOKENIZERS)}, listed in docs/architecture.md)")


# ------------------------------------------------------------------ SentencePiece-style


def _sentencepiece_vocab(meta: dict, field: Sequence[str], decode_only: bool
                         ) -> tuple[list[str], list[tuple[str, str]]]:
    """(the tokens as the model holds them, the merges; none when ``decode_only``).
    ``field``: the GGUF's token array; its strings and the merges come from the cache when
    it holds them (merges_cache.py)."""
    arch = meta.get("general.architecture")
    scores = meta.get("tokenizer.ggml.scores")
    if arch in _POSITION_RANKED_ARCHS:
        ranking = b"position"
    elif scores is not None and len(scores) == len(field):
        # float64 ranks as bytes: the cache's key, and the merges' order when it misses
        ranking = array("d", (-float(s) for s in scores)).tobytes()
    elif decode_only:
        ranking = b"unranked"
    else:
        raise CheckpointError("a 'llama' GGUF tokenizer needs one score per token to rank merges")

    def recover(original: list[str]) -> list[tuple[str, str]]:
        ranks = array("d", range(len(original)) if ranking == b"position" else ranking)
        return _firing_merges(_respaced(original), ranks)

    original, merges = cached_vocabulary(vocab_key(field, ranking), lambda: list(field),
                                         None if decode_only else recover)
    if isinstance(field, LazyStrings):
        field.fill(original)  # the header's other readers (special tokens, longest) decode none
    return _respaced(original), merges


def _adds_space_prefix(meta: dict) -> bool:
    return meta.get("tokenizer.ggml.add_space_prefix",
                    meta.get("general.architecture") not in _POSITION_RANKED_ARCHS)


def _sentencepiece_bpe(meta: dict, tokens: list[str], merges: list[tuple[str, str]]) -> Tokenizer:
    unk_id = meta.get("tokenizer.ggml.unknown_token_id")
    bpe = models.BPE(vocab=_vocab(tokens), merges=merges,
                     unk_token=tokens[unk_id] if unk_id is not None else None,
                     fuse_unk=True, byte_fallback=True)
    tok = Tokenizer(bpe)
    if _adds_space_prefix(meta):
        # "▁" before the first word only, as SentencePiece's add_dummy_prefix; dropped on decode
        tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement=_SPACE, prepend_scheme="first",
                                                     split=False)
    else:
        tok.normalizer = normalizers.Replace(" ", _SPACE)
    return tok


def _sentencepiece_decoder(meta: dict) -> decoders.Decoder:
    tail = [decoders.Strip(content=" ", left=1, right=0)] if _adds_space_prefix(meta) else []
    return decoders.Sequence([decoders.Replace(_SPACE, " "), decoders.ByteFallback(),
                              decoders.Fuse(), *tail])


def _respaced(tokens: list[str]) -> list[str]:
    # Gemma stores runs of spaces as real spaces; the text they must match is ▁-escaped.
    return [_SPACE * len(t) if " " in t and not t.strip() else t for t in tokens]


def _vocab(tokens: list[str]) -> dict[str, int]:
    return dict(zip(tokens, range(len(tokens))))


def _firing_merges(tokens: list[str], ranks: Sequence[float]) -> list[tuple[str, str]]:
    """The merges that can ever fire, best first.

    transformers' conversion takes every split (left, right) of a token into two tokens
    as a merge (515k for Gemma 3's 262k tokens), ordered by the whole token's rank, then
    longer left piece first, then longer right piece first, then token order. Most never
    fire: BPE builds a symbol inside a text exactly as it would from that symbol's own text
    (no merge reaches across its edges before it is whole, and those inside happen in the
    same order), so the one merge that ever makes token t is the last merge of BPE run on
    t's text alone. Running BPE over each token's text (~2 s of CPU for Gemma 3's
    vocabulary, once: merges_cache.py keeps the result) finds them: 236k, which
    ``tokenizers`` builds its model from in 0.29 s instead of 0.45 s, and which encode
    every text as the full set does (tests compare the two).
    """
    # A merge's place in that order, as one integer: the whole token's rank, the left
    # piece's length, the token's length, its id, then the position in the text (BPE's
    # tie-break). A vocabulary that repeats a string ranks its merges by the last repeat
    # in that order, as the full set's last entry for them wins.
    n, width = len(tokens), max(map(len, tokens), default=0) + 1
    dense = {r: i for i, r in enumerate(sorted(set(ranks)))}
    places = [((dense[r] * width * width + width - 1 - len(t)) * n + i) * width
              for i, (t, r) in enumerate(zip(tokens, ranks))]
    place = dict(zip(tokens, places))
    if len(place) < n:
        for t, here in zip(tokens, places):
            place[t] = max(place[t], here)
    get, never = place.get, 1 << 80
    span = width * n * width  # the left piece's length, above the token's length and id

    def key(left: str, right: str, pos: int) -> int:
        found = get(left + right)
        return never if found is None else found + (width - 1 - len(left)) * span + pos

    fired = []
    for t in tokens:
        if len(t) < 2 or not all(map(place.__contains__, t)):
            continue  # a character outside the vocabulary is never part of a built symbol
        symbols = list(t)
        keys = [key(symbols[i], symbols[i + 1], i) for i in range(len(t) - 1)]
        while len(symbols) > 2:  # BPE on t's text, but for its last merge
            best = min(keys)
            if best == never:
                break
            i = keys.index(best)
            symbols[i:i + 2] = [symbols[i] + symbols[i + 1]]
            del keys[i]  # positions only break ties, so the later ones may keep their old
            if i > 0:
                keys[i - 1] = key(symbols[i - 1], symbols[i], i - 1)
            if i < len(symbols) - 1:
                keys[i] = key(symbols[i], symbols[i + 1], i)
        if len(symbols) == 2 and keys[0] != never:
            fired.append((keys[0], symbols[0], symbols[1]))
    fired.sort()
    return [(a, b) for _key, a, b in fired]


# ------------------------------------------------------------------ byte-level BPE


def _byte_level_vocab(meta: dict, field: Sequence[str], path: str, decode_only: bool
                      ) -> tuple[list[str], list[tuple[str, str]]]:
    merges = meta.get("tokenizer.ggml.merges")
    if not merges:
        raise CheckpointError(f"{path!r}: a 'gpt2' GGUF tokenizer needs tokenizer.ggml.merges")
    alphabet = BYTE_TO_CHAR
    spelled = set(alphabet.values())
    # A token written outside the byte alphabet (rare) is respelled byte by byte.
    tokens = [t if set(t) <= spelled else "".join(alphabet[b] for b in t.encode("utf-8"))
              for t in field]
    return tokens, [] if decode_only else [tuple(m.split(" ", 1)) for m in merges]


def _byte_level_bpe(tokens: list[str], merges: list[tuple[str, str]], pre: PreTokenizer
                    ) -> Tokenizer:
    bpe = models.BPE(vocab=_vocab(tokens), merges=merges,
                     continuing_subword_prefix="", end_of_word_suffix="", fuse_unk=False,
                     ignore_merges=pre.ignore_merges)
    tok = Tokenizer(bpe)
    # llama.cpp's regexes run in turn, each cutting every piece so far: Split, isolated.
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        *(pre_tokenizers.Split(Regex(split), behavior="isolated") for split in pre.splits),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    return tok


# ------------------------------------------------------------------ special tokens


def _added_tokens(meta: dict, tokens: list[str], types: list[int], byte_level: bool
                  ) -> dict[int, AddedToken]:
    """Id -> added token: the control tokens (special), then the user-defined ones."""
    spelled = set(BYTE_TO_CHAR.values()) if byte_level else None
    special_ids = set(_ids_of(types, CONTROL))
    # the named special tokens are special even where a file forgets to mark them CONTROL
    for key in ("bos", "eos", "unknown", "padding", "eot"):
        token_id = meta.get(f"tokenizer.ggml.{key}_token_id")
        if token_id is not None and 0 <= token_id < len(tokens):
            special_ids.add(int(token_id))
    added = {i: AddedToken(tokens[i], special=True, normalized=False)
             for i in sorted(special_ids) if spelled is None or set(tokens[i]) <= spelled}
    # USER_DEFINED tokens (e.g. "\n\n", "<think>") are matched whole in text, like llama.cpp does.
    original = meta["tokenizer.ggml.tokens"]
    # (one respelled to "▁▁" can't match raw text as written)
    for i in _ids_of(types, USER_DEFINED):
        if tokens[i] == original[i] and i not in added:
            added[i] = AddedToken(tokens[i], special=False, normalized=False)
    return added


def _ids_of(types: list[int], kind: int) -> Iterator[int]:
    """The ids of the tokens of type ``kind``, in order (a loop in C: 262k types)."""
    return compress(count(), map(kind.__eq__, types))


class DecodeOnlyTokenizer:
    """What decoding reads of the ``Tokenizer`` built here, without its model: the
    detokenizer's (``decode_only``). The model's 262k-entry vocabulary costs ~0.2 s of CPU
    to build, and decoding reads none of it: ``decode`` turns ids into their tokens here and
    runs the same decoder over them, as ``Tokenizer.decode`` does (ids outside the
    vocabulary are dropped, and special tokens by their text when skipped). Tests check
    that it decodes every id, and runs of ids, as the full tokenizer does."""

    def __init__(self, tokens: list[str], added: dict[int, AddedToken], decoder):
        self._tokens = tokens
        self._added = added
        self._special = {t.content for t in added.values() if t.special}
        self._ids: Optional[dict[str, int]] = None  # built on first use
        self.decoder = decoder

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        tokens, n = self._tokens, len(self._tokens)
        pieces = [tokens[i] for i in ids if 0 <= i < n]
        if skip_special_tokens:
            special = self._special
            pieces = [t for t in pieces if t not in special]
        return self.decoder.decode(pieces)

    def decode_batch(self, batch: Sequence[Sequence[int]], skip_special_tokens: bool = True
                     ) -> list[str]:
        return [self.decode(ids, skip_special_tokens) for ids in batch]

    def id_to_token(self, token_id: int) -> Optional[str]:
        return self._tokens[token_id] if 0 <= token_id < len(self._tokens) else None

    def token_to_id(self, token: str) -> Optional[int]:
        if self._ids is None:
            self._ids = _vocab(self._tokens)
        return self._ids.get(token)

    def get_added_tokens_decoder(self) -> dict[int, AddedToken]:
        return dict(self._added)

    def get_vocab_size(self, with_added_tokens: bool = True) -> int:
        return len(self._tokens)


def _set_post_processor(tok: Tokenizer, meta: dict, tokens: list[str], default_add_bos: bool) -> None:
    pieces, specials = [], []
    for key, default, where in (("bos", default_add_bos, 0), ("eos", False, 1)):
        token_id = meta.get(f"tokenizer.ggml.{key}_token_id")
        if meta.get(f"tokenizer.ggml.add_{key}_token", default) and token_id is not None:
            pieces.append((where, tokens[token_id]))
            specials.append((tokens[token_id], int(token_id)))
    if not pieces:
        return
    before = [t for where, t in pieces if where == 0]
    after = [t for where, t in pieces if where == 1]
    single = " ".join([*(f"{t}:0" for t in before), "$A:0", *(f"{t}:0" for t in after)])
    pair = " ".join([single, *(f"{t}:1" for t in before), "$B:1", *(f"{t}:1" for t in after)])
    tok.post_processor = processors.TemplateProcessing(single=single, pair=pair,
                                                       special_tokens=specials)
