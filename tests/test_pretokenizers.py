"""Every byte-level GGUF pre-tokenizer PocketLLM knows, against references nobody here wrote.

One byte-level BPE vocabulary is trained here and written into a tiny GGUF per
pre-tokenizer name (vocab + merges + ``tokenizer.ggml.pre``). Each file's
tokenization of a varied text is checked against

* llama.cpp's own tokenizer (``llama-cpp-python``, vocab only), for every name
  it knows -- skipped where the package is not installed;
* transformers' GGUF loader, for the names that loader knows (its own table
  of split regexes, and the names llama.cpp splits with GPT-2's regex, which is
  what transformers does for a name it does not know).

One known difference is exempt from the llama.cpp check: regexes that tell
upper from lower case (tekken, gpt-4o and kin) are approximated by llama.cpp,
which counts every non-ASCII letter as both (" ÜBER" -> " Ü", "BER"; the
model's own regex keeps " ÜBER"). PocketLLM follows the model's regex; those
texts are checked against transformers, which does too.

BOS follows llama.cpp's default for the name (the files say nothing), so the
transformers comparison leaves special tokens out of both sides.
"""

from __future__ import annotations

import json

import pytest
from tokenizers import Tokenizer, models, pre_tokenizers, trainers

import test_gguf_vocab as base
from pocketllm.errors import UnsupportedFeatureError
from pocketllm.tokenizer.gguf_pretokenizers import GPT2, PRE_TOKENIZERS, REFUSED
from pocketllm.tokenizer.gguf_vocab import tokenizer_from_gguf

try:
    import llama_cpp
except ImportError:  # optional: a long native build
    llama_cpp = None

# digits, punctuation, Unicode, whitespace runs, code, contractions, special tokens
TEXTS = [
    "Hello, world! It's 2024-01-31; they'll pay $1,234,567.89 (or 12345678901).",
    "I'M SURE WE'LL WIN; you've done it, hasn't she? O'Neil's 'quote' don't",
    "def f(x):\n\treturn x**2  # square\n\n\n    if a<=b and c!=d: print(f\"{a}\")\r\n",
    "   leading, trailing   \n\n  \t \n",
    "Ünïcödé façade naïve ÜBER Straße ΣΊΣΥΦΟΣ русский язык",
    "你好，世界。日本語のテキスト、한국어 텍스트",
    "emoji 🦙🤖 and ❤️, math ∑x² ≤ ∞, nbsp\u00a0here",
    "<|im_start|>user\nHi there<|im_end|>\n<|endoftext|>",
    "https://example.com/a_b?q=1&r=2#frag <tag attr='v'>",
    "sentinel <sentinel:12> IMGIMGABZ x",
    "",
]
CORPUS = base.CORPUS + [t for t in TEXTS if "<|" not in t] * 2
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


@pytest.fixture(scope="module")
def vocab():
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.train_from_iterator(CORPUS, trainers.BpeTrainer(
        vocab_size=1200, special_tokens=SPECIALS, show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    model = json.loads(tok.to_str())["model"]
    tokens = [t for t, _ in sorted(model["vocab"].items(), key=lambda kv: kv[1])]
    types = [3 if t in SPECIALS else 1 for t in tokens]
    return tokens, types, [f"{a} {b}" for a, b in model["merges"]]


def _gguf(vocab, pre, tmp_path) -> str:
    tokens, types, merges = vocab
    return base._write_vocab_gguf(str(tmp_path / "v.gguf"), tokens, types, model="gpt2", pre=pre,
                                  merges=merges, bos=0, eos=0)


def _transformers_knows(name: str) -> bool:
    """Whether transformers' GGUF loader splits text for ``name`` as the model does: the
    names in its table of split regexes (transformers 5.18 on), and the names whose split is
    GPT-2's, which is what it does for every other name (and, before 5.18, for every name)."""
    try:
        import transformers  # noqa: F401
    except ImportError:
        return False
    try:
        from transformers.integrations.gguf.gguf_tokenizer_mapping import GGUF_PRE_TOKENIZER_SPLITS
    except ImportError:  # transformers < 5.18: no table
        GGUF_PRE_TOKENIZER_SPLITS = {}
    return name in GGUF_PRE_TOKENIZER_SPLITS or PRE_TOKENIZERS[name].splits == (GPT2,)


@pytest.mark.parametrize("name", sorted(PRE_TOKENIZERS))
def test_pre_tokenizer(vocab, name, tmp_path):
    path = _gguf(vocab, name, tmp_path)
    ours = tokenizer_from_gguf(path)
    checked = []
    for text in TEXTS:  # byte-level BPE loses nothing
        assert ours.decode(ours.encode(text).ids, skip_special_tokens=False).removeprefix(
            "<|endoftext|>") == text
    if llama_cpp is not None:
        ref = llama_cpp.Llama(model_path=path, vocab_only=True, verbose=False)
        cased = any(r"\p{Lu}" in split for split in PRE_TOKENIZERS[name].splits)
        for text in TEXTS:
            if cased and any(c.isupper() and not c.isascii() for c in text):
                continue  # llama.cpp's approximation of letter case, see the module docstring
            want = ref.tokenize(text.encode("utf-8"), add_bos=True, special=True)
            assert ours.encode(text).ids == want, f"{name}: llama.cpp differs on {text!r}"
        checked.append("llama.cpp")
    if _transformers_knows(name):
        ref = base._hf_tokenizer(path)
        for text in TEXTS:
            assert ours.encode(text, add_special_tokens=False).ids == \
                ref(text, add_special_tokens=False)["input_ids"], \
                f"{name}: transformers differs on {text!r}"
        checked.append("transformers")
    if not checked:
        pytest.skip(f"{name}: llama-cpp-python is not installed, and transformers is not "
                    "either or has no split regex for this name (its table came in 5.18)")



def test_missing_name_is_llama_cpp_default(vocab, tmp_path):
    """No tokenizer.ggml.pre: llama.cpp's 'default' (punctuation runs, GPT-2, digit triples)."""
    tokens, types, merges = vocab
    bare = base._write_vocab_gguf(str(tmp_path / "bare.gguf"), tokens, types, model="gpt2",
                                  merges=merges, bos=0, eos=0)
    named = _gguf(vocab, "default", tmp_path)
    for text in TEXTS:
        assert tokenizer_from_gguf(bare).encode(text).ids == tokenizer_from_gguf(named).encode(text).ids
    if llama_cpp is not None:
        ref = llama_cpp.Llama(model_path=bare, vocab_only=True, verbose=False)
        text = TEXTS[0]
        assert tokenizer_from_gguf(bare).encode(text).ids == \
            ref.tokenize(text.encode("utf-8"), add_bos=True, special=True)


@pytest.mark.parametrize("name", [*sorted(REFUSED), "gpt2", "no-such-pre-tokenizer"])
def test_unsupported_names_are_refused_by_name(vocab, name, tmp_path):
    with pytest.raises(UnsupportedFeatureError, match=f"pre-tokenizer '{name}' is not supported"):
        tokenizer_from_gguf(_gguf(vocab, name, tmp_path))


def test_sentencepiece_vocabularies_ignore_the_name(tmp_path):
    """The pre-tokenizer applies to byte-level ('gpt2') files only; llama.cpp ignores it for 'llama'."""
    tokens = ["<unk>", "<s>", "</s>", *(f"<0x{b:02X}>" for b in range(256)), "▁", "a", "b", "▁a", "ab"]
    types = [2, 3, 3] + [6] * 256 + [1] * 5
    scores = [0.0] * 259 + [-1.0, -2.0, -3.0, -4.0, -5.0]
    ids = []
    for pre in (None, "kimi-k2", "smollm"):
        path = base._write_vocab_gguf(str(tmp_path / f"{pre}.gguf"), tokens, types, model="llama",
                                      scores=scores, bos=1, eos=2, pre=pre)
        ids.append(tokenizer_from_gguf(path).encode("ab a 12").ids)
    assert ids[0] == ids[1] == ids[2]


@pytest.mark.parametrize("name", ["llama-bpe", "dbrx"])
def test_ignore_merges(name, tmp_path):
    """llama3-family files take a word that is itself a token whole, as llama.cpp does; dbrx
    shares the regex but merges as usual."""
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    tokens = ["<|endoftext|>", *sorted(alphabet), "ab", "abc"]
    path = base._write_vocab_gguf(str(tmp_path / "v.gguf"), tokens, [3] + [1] * (len(tokens) - 1),
                                  model="gpt2", pre=name, merges=["a b"], bos=0, eos=0,
                                  add_bos=False)
    pieces = tokenizer_from_gguf(path).encode("abc").tokens
    assert pieces == (["abc"] if name == "llama-bpe" else ["ab", "c"])
    if llama_cpp is not None:
        ref = llama_cpp.Llama(model_path=path, vocab_only=True, verbose=False)
        assert tokenizer_from_gguf(path).encode("abc").ids == ref.tokenize(b"abc", add_bos=False)
