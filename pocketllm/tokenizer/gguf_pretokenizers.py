"""The pre-tokenizers a byte-level GGUF vocabulary can name, as data.

``tokenizer.ggml.pre`` names how text is cut into words before byte-level BPE.
llama.cpp (``llama-vocab.cpp``) maps each name to a list of regexes applied in
turn: each regex cuts every piece so far into its matches and the text between
them. ``tokenizers`` expresses exactly that as a ``Sequence`` of ``Split``
pre-tokenizers with ``behavior="isolated"``, so every entry below is a list of
regexes, written as the model's own ``tokenizer.json`` writes them (llama.cpp
rewrites some of them for ``std::regex``: ``(?i:...)`` spelled out,
possessive quantifiers made greedy, letter cases approximated).

Per name, beside the regexes, the llama.cpp defaults a file may not spell out:
``ignore_merges`` (a word that is itself a token is taken whole) and
``add_bos`` (BOS is added when the file has no ``tokenizer.ggml.add_bos_token``).

Names llama.cpp knows but splits with code of its own, or that are not
byte-level BPE at all, are in ``REFUSED`` with the reason.
"""

from __future__ import annotations

from dataclasses import dataclass

_CONTRACTIONS = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)"
GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
LLAMA3 = (_CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
          r"|\s*[\r\n]+|\s+(?!\S)|\s+")
QWEN2 = LLAMA3.replace(r"\p{N}{1,3}", r"\p{N}")
QWEN35 = (_CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*"
          r"|\s*[\r\n]+|\s+(?!\S)|\s+")
JAIS2 = LLAMA3.replace(r"|\s+(?!\S)|\s+", "".join(f"|\\s{{{n}}}(?!\\S)" for n in (512, 256, 128, 64, 32, 16, 8, 4))
                       + r"|\s{1,2}(?!\S)|\s{1}")
# Mistral's tekken and OpenAI's o200k: a word is an optional capitalised run then lower case.
_UPPER, _LOWER = r"[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]", r"[\p{Ll}\p{Lm}\p{Lo}\p{M}]"
TEKKEN = (rf"[^\r\n\p{{L}}\p{{N}}]?{_UPPER}*{_LOWER}+|[^\r\n\p{{L}}\p{{N}}]?{_UPPER}+{_LOWER}*"
          r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
GPT4O = (rf"[^\r\n\p{{L}}\p{{N}}]?{_UPPER}*{_LOWER}+{_CONTRACTIONS}?"
         rf"|[^\r\n\p{{L}}\p{{N}}]?{_UPPER}+{_LOWER}*{_CONTRACTIONS}?"
         r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
BLOOM = " ?[^(\\s|.,!?\u2026\u3002\uff0c\u3001\u0964\u06d4\u060c)]+"
_ASCII_PUNCT = r"[!\"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~]"
DEEPSEEK3_WORDS = (_ASCII_PUNCT + r"[A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+| ?[\p{P}\p{S}]+[\r\n]*"
                   r"|\s*[\r\n]+|\s+(?!\S)|\s+")
_CJK_KANA = "[\u4e00-\u9fa5\u3040-\u309f\u30a0-\u30ff]+"
# digits cut into groups of three from the right: 1234567 -> 1, 234, 567
DIGITS_FROM_RIGHT = r"\p{N}{1,3}(?=(?:\p{N}{3})*(?!\p{N}))"
# (non-ASCII written as escapes: an editor's Unicode normalisation must not change a range)
_DEEPSEEK_LATIN = (
    "\\s?[A-Za-z\u00b5\u00c0-\u00d6\u00d8-\u00f6\u00f8-\u01ba\u01bc-\u01bf\u01c4-\u0293\u0295-\u02af"
    "\u0370-\u0373\u0376\u0377\u037b-\u037d\u037f\u0386\u0388-\u038a\u038c\u038e-\u03a1\u03a3-\u03f5"
    "\u03f7-\u0481\u048a-\u052f\u0531-\u0556\u10a0-\u10c5\u13a0-\u13f5\u13f8-\u13fd\u1c90-\u1cba"
    "\u1cbd-\u1cbf\u1d00-\u1d2b\u1d6b-\u1d77\u1d79-\u1d9a\u1e00-\u1f15\u1f18-\u1f1d\u1f20-\u1f45"
    "\u1f48-\u1f4d\u1f50-\u1f57\u1f59\u1f5b\u1f5d\u1f5f-\u1f7d\u1f80-\u1fb4\u1fb6-\u1fbc\u1fbe"
    "\u1fc2-\u1fc4\u1fc6-\u1fcc\u1fd0-\u1fd3\u1fd6-\u1fdb\u1fe0-\u1fec\u1ff2-\u1ff4\u1ff6-\u1ffc\u2102"
    "\u2107\u210a-\u2113\u2115\u2119-\u211d\u2124\u2126\u2128\u212a-\u212d\u212f-\u2134\u2139"
    "\u213c-\u213f\u2145-\u2149\u214e\u2183\u2184\u2c00-\u2c7b\u2c7e-\u2ce4\u2ceb-\u2cee\u2cf2\u2cf3"
    "\ua640-\ua66d\ua680-\ua69b\ua722-\ua76f\ua771-\ua787\ua78b-\ua78e\uab70-\uabbf\ufb00-\ufb06"
    "\ufb13-\ufb17\uff21-\uff3a\uff41-\uff5a\U00010400-\U0001044f\U000104b0-\U000104d3"
    "\U000104d8-\U000104fb\U00010c80-\U00010cb2\U00010cc0-\U00010cf2\U000118a0-\U000118df"
    "\U0001e900-\U0001e943]+")
_DEEPSEEK_PUNCT = "\\s?[!-/:-~\uff01-\uff0f\uff1a-\uff5e\u2018-\u201f\u3000-\u3002]+"
_CJK_HANGUL = "[\u4e00-\u9fa5\u0800-\u4e00\uac00-\ud7ff]+"
_YOUTU_CJK = ("[\uac00-\ud7a3\u3131-\u318e]+"
              "|[\uff01\u2026\u201c\u201d\u2018\u2019\u2014\uff1a\uff1b\uff0c\u3001-\u303f\ufe30-\ufe4f]+"
              "|[\u3105-\u312f]+|[\u4e00-\u9fa5\u3040-\u309f\u30a0-\u30ff]+")
_AFMOE_ASIAN = ("[\u4e00-\u9fff\u3400-\u4dbf\u8c48-\ufaff\u3040-\u309f\u30a0-\u30ff\uff65-\uff9f"
                "\u2f00-\u2fdf\u0e40-\u0e7f\u0e80-\u0eff\u1780-\u17ff\u1000-\u109f\uaa60-\uaa7f"
                "\ua9e0-\ua9ff\uac00-\ud7af\u1100-\u11ff]+")


@dataclass(frozen=True)
class PreTokenizer:
    splits: tuple[str, ...]        # regexes applied in turn, each isolating its matches
    ignore_merges: bool = False    # a word that is a token is not merged from pieces
    add_bos: bool = False          # BOS by default (the file's add_bos_token wins)


def _pre(*splits: str, ignore_merges: bool = False, add_bos: bool = False) -> PreTokenizer:
    return PreTokenizer(tuple(splits), ignore_merges, add_bos)


_LLAMA3 = _pre(LLAMA3, ignore_merges=True, add_bos=True)
_GPT2 = _pre(GPT2)
_DIGIT_THEN_GPT2 = _pre(r"\p{N}", GPT2)
_QWEN2 = _pre(QWEN2)
_DEEPSEEK3 = _pre(r"\p{N}{1,3}", _CJK_KANA, DEEPSEEK3_WORDS)
_GPT4O = _pre(GPT4O)
_BAILING = _pre(r"'(?i:[sdmt]|ll|ve|re)|[^\r\n\p{L}\p{N}]?+\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]++[\r\n]*"
                r"|\s*[\r\n]|\s+(?!\S)|\s+")

PRE_TOKENIZERS: dict[str, PreTokenizer] = {
    # llama.cpp's fallback for a file that names none (it warns that quality suffers)
    "default": _pre(r"[\p{P}\$\+<=>\^~\|]+", GPT2, r"\p{N}+", r"[0-9][0-9][0-9]"),
    **dict.fromkeys(["llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral",
                     "midm-2.0", "lfm2", "jina-v5-nano"], _LLAMA3),
    "dbrx": _pre(LLAMA3), "smaug-bpe": _pre(LLAMA3),
    "jais-2": _pre(JAIS2),
    "deepseek-llm": _pre(r"[\r\n]", _DEEPSEEK_LATIN, _DEEPSEEK_PUNCT, r"\s+$", _CJK_HANGUL, r"\p{N}+"),
    "deepseek-coder": _pre(r"[\r\n]", r"\s?\p{L}+", r"\s?\p{P}+", _CJK_HANGUL, r"\p{N}"),
    **dict.fromkeys(["deepseek-v3", "hunyuan-dense", "joyai-llm", "hy_v4"], _DEEPSEEK3),
    "spark2_5": _pre(r"\p{N}{1,3}", _CJK_KANA,
                     DEEPSEEK3_WORDS.replace(r"| ?[\p{P}\p{S}]+[\r\n]*|\s*[\r\n]+", r"| ?[\p{P}\p{S}]+|[\r\n]"),
                     r"\p{N}"),
    "youtu": _pre(_YOUTU_CJK,
                  GPT4O.replace(r"\p{N}{1,3}", r"\p{N}"), ignore_merges=True),
    "falcon": _pre(r"[\p{P}\$\+<=>\^~\|`]+", GPT2, r"[0-9][0-9][0-9]"),
    **dict.fromkeys(["starcoder", "refact", "command-r", "smollm", "codeshell", "exaone",
                     "minerva-7b", "mellum2"], _DIGIT_THEN_GPT2),
    **dict.fromkeys(["gpt-2", "phi-2", "jina-es", "jina-de", "gigachat", "jina-v2-es", "jina-v2-de",
                     "a.x-4.0", "mellum", "modern-bert", "exaone4", "mpt", "olmo", "jais", "trillion",
                     "granite-docling", "jina-v1-en", "jina-v2-code", "roberta-bpe"], _GPT2),
    **dict.fromkeys(["qwen2", "deepseek-r1-qwen", "kormo", "f2llmv2", "megrez", "stablelm2",
                     "hunyuan", "solar-open", "grok-2"], _QWEN2),
    "qwen35": _pre(QWEN35),
    **dict.fromkeys(["poro-chat", "bloom", "gpt3-finnish"], _pre(BLOOM)),
    "chatglm-bpe": _pre(LLAMA3),
    **dict.fromkeys(["glm4", "glm5"], _pre(LLAMA3, ignore_merges=True)),
    "viking": _pre(BLOOM, r"\p{N}"),
    "tekken": _pre(TEKKEN, ignore_merges=True, add_bos=True),
    "chameleon": _pre(r"<sentinel:[0-9]+>", r"(IMGIMG)((A|B|C|D|E|F|G|H|I){1,4})Z", r"([\t\n]|    |  )",
                      r"\p{N}", r"[\p{P}!-/:-@\[-`{-~]", GPT2, add_bos=True),
    **dict.fromkeys(["gpt-4o", "llama4", "kanana2", "talkie", "minimax-m2"], _GPT4O),
    "granite-embed-multi-97m": _pre(GPT4O, ignore_merges=True),
    **dict.fromkeys(["tiny_aya", "cohere2moe"], _pre(r"\d{1,3}(?=(?:\d{3})*\b)", GPT4O)),
    "superbpe": _pre(r"\p{N}+", r"(?=(\d{3})+(?!\d))"),
    **dict.fromkeys(["bailingmoe", "bailingmoe2", "llada-moe"], _BAILING),
    "seed-coder": _pre(_CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1}| ?[^\s\p{L}\p{N}\r\n]+"
                       r"|\s*[\r\n]+|\s+(?!\S)|\s+"),
    "ufakzeka": _pre(QWEN2.replace(_CONTRACTIONS + "|", "")),
    "afmoe": _pre(DIGITS_FROM_RIGHT, _AFMOE_ASIAN, DEEPSEEK3_WORDS),
    "laguna": _pre(r"[^\n]+|[\n]+", QWEN2),
    "exaone-moe": _pre(_CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?(?:\p{L}\p{M}*(?: \p{L}\p{M}*)*)+|\p{N}"
                       r"| ?[^\s\p{L}\p{N}]+[\r\n/]?|\s*[\r\n]|\s+(?!\S)|\s+"),
    "minicpm5": _pre(r"\p{N}{1,3}", LLAMA3.replace(r"\p{N}{1,3}", r"\p{N}+"), ignore_merges=True),
}

# Names llama.cpp knows that this byte-level BPE path cannot honour, and why.
REFUSED: dict[str, str] = {
    "kimi-k2": "llama.cpp splits it with code of its own and the file carries no merges",
    "gemma4": "it is SentencePiece-style BPE over raw UTF-8 (tokenizer model 'gemma4'), not byte-level",
    "granite-embed-multi-311m": "it is SentencePiece-style BPE over raw UTF-8, not byte-level",
    "sarvam-moe": "it is SentencePiece-style BPE over raw UTF-8, not byte-level",
    "whitespace": "it is a whitespace-split vocabulary of an embedding model, not byte-level BPE",
}
