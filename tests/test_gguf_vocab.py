"""Tokenizers built from GGUF vocabularies, against transformers' GGUF tokenizer.

The embedded Gemma file covers the SentencePiece-style ("llama") vocabulary;
tiny GGUF files written here from freshly trained tokenizers cover the
byte-level ("gpt2") one of Llama 3 / Qwen, and a score-ranked SentencePiece one.
"""

from __future__ import annotations

import json
import os
import random
import re
import subprocess
import sys
import textwrap

import gguf
import pytest
from tokenizers import Tokenizer, models, pre_tokenizers, trainers

from pocketllm.errors import CheckpointError, UnsupportedFeatureError
from pocketllm.tokenizer.gguf_vocab import _firing_merges, _respaced, tokenizer_from_gguf

TEXTS = [
    "Hello, world!",
    "The quick brown fox jumps over the lazy dog.",
    "  two leading spaces",
    "trailing spaces   ",
    "multiple     spaces   inside",
    " ",
    "",
    "line1\nline2\n\nline3\n\n\n\nend\n",
    "\ttabs\tand\r\nCRLF\r\n",
    "def square(x):\n    return x ** 2  # comment\n\nprint(square(12345678901))\n",
    "I ❤️ 🦙 and 🤖!",
    "你好，世界。日本語のテキスト、한국어 텍스트",
    "Ünïcödé façade naïve résumé, Ελληνικά, русский, עברית, العربية",
    "private use \ue000 and \U0010fffd and a NUL \x00 byte",
    "<start_of_turn>user\nHi<end_of_turn>\n<start_of_turn>model\n",
    "<bos>inline bos and <eos> eos",
    "<start_of_turn broken tag <end_of_turn",
    "<unused0>[multimodal]<pad><mask>",
    "https://example.com/path?q=1&r=2#frag",
    "  \n  \n",
]


def _compare(ours: Tokenizer, ref, texts=TEXTS) -> None:
    for text in texts:
        want = ref(text)["input_ids"]
        got = ours.encode(text).ids
        assert got == want, f"ids differ for {text!r}"
        for skip in (False, True):
            assert ours.decode(got, skip_special_tokens=skip) == \
                ref.decode(want, skip_special_tokens=skip), f"decode differs for {text!r} (skip={skip})"


# transformers' GGUF tokenizer loader is a reference only where it agrees with llama.cpp.
# Checked against transformers 5.17 to 5.24 on the written files below: before 5.18 its
# byte-level decoder drops a space ("  two" decodes to " two"); before 5.23 it adds no BOS
# where the file's add_bos_token, or a SentencePiece vocabulary's default, asks for one
# (llama.cpp and PocketLLM add it). A comparison that meets a fix skips on older versions.
HF_FIXED = {(5, 18): "decodes byte-level ids dropping a leading space",
            (5, 23): "adds no BOS where the file asks for one"}
HF_DECODES = (5, 18)
HF_ADDS_BOS = (5, 23)


def _hf_tokenizer(path: str, needs: tuple[int, int] | None = None):
    """transformers' tokenizer for a GGUF file; skip where its version has a known fault
    (``needs``: the version that fixed the fault the comparison would meet)."""
    transformers = pytest.importorskip("transformers")
    version = transformers.__version__
    if needs is not None and tuple(int(x) for x in re.findall(r"\d+", version)[:2]) < needs:
        pytest.skip(f"transformers {version}: its GGUF tokenizer {HF_FIXED[needs]} (fixed in "
                    f"{needs[0]}.{needs[1]}), so it is no reference for this comparison")
    return transformers.AutoTokenizer.from_pretrained(os.path.dirname(path),
                                                      gguf_file=os.path.basename(path))


# ------------------------------------------------------------------ the embedded Gemma file


@pytest.fixture(scope="module")
def gemma_path(default_model_path):
    return default_model_path


@pytest.fixture(scope="module")
def gemma(gemma_path, tmp_path_factory):
    tok = tokenizer_from_gguf(gemma_path)
    saved = str(tmp_path_factory.mktemp("tok") / "tokenizer.json")
    tok.save(saved)
    return tok, saved


@pytest.fixture(scope="module")
def gemma_ref(gemma_path):
    return _hf_tokenizer(gemma_path, HF_ADDS_BOS)  # the file's add_bos_token is true


def test_build_is_fast_and_torch_free(gemma_path):
    code = textwrap.dedent(f"""
        import sys, time
        from pocketllm.tokenizer.gguf_vocab import _firing_merges, _respaced, tokenizer_from_gguf
        start = time.perf_counter()
        tok = tokenizer_from_gguf({gemma_path!r})
        print(time.perf_counter() - start)
        assert tok.get_vocab_size() == 262144
        assert "torch" not in sys.modules, "the tokenizer stage must not import torch"
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    seconds = float(out.stdout.split()[-1])
    assert seconds < 8, f"building the 262k-token tokenizer took {seconds:.1f}s"  # ~1.3s when idle


def test_stages_start_without_numpy(gemma_path, tmp_path):
    """numpy's import is ~0.1 s of CPU in each stage's start on two cores: neither the
    detokenizer's vocabulary nor the tokenizer's needs it, whether the merges come from the
    cache or are recovered."""
    code = textwrap.dedent(f"""
        import sys
        from pocketllm.config import EngineArgs
        from pocketllm.detokenizer.detokenizer import Detokenizer
        from pocketllm.model_info import load_model_info
        from pocketllm.tokenizer.stage import TokenizerStage
        from pocketllm.tokenizer.tokenizer import load_tokenizer
        info = load_model_info(EngineArgs(model={gemma_path!r}))
        Detokenizer(load_tokenizer(info, decode_only=True).tokenizer)
        print("detokenizer", "numpy" in sys.modules)
        TokenizerStage(info)
        print("tokenizer", "numpy" in sys.modules)
    """)
    env = {**os.environ, "POCKETLLM_CACHE_DIR": str(tmp_path)}
    runs = []
    for _ in range(2):
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                             timeout=120, env=env)
        assert out.returncode == 0, out.stderr
        runs.append(out.stdout.split())
    assert runs == [["detokenizer", "False", "tokenizer", "False"]] * 2  # recovered, read back
    assert len(list((tmp_path / "vocab").iterdir())) == 1


def _every_split(tokens: list[str], ranks) -> list[tuple[str, str]]:
    """Every split of a token into two tokens, in the conversion's order (the whole token's
    rank, longer left piece first, longer right piece first, token order)."""
    ids = {t: i for i, t in enumerate(tokens)}
    found = [(ranks[i], -k, k - len(t), i, t[:k], t[k:]) for t, i in ids.items()
             for k in range(1, len(t)) if t[:k] in ids and t[k:] in ids]
    return [(a, b) for *_, a, b in sorted(found)]


def _assert_firing_merges_encode_alike(tokens: list[str], ranks) -> tuple[int, int]:
    """The merges that can fire build a BPE that encodes as the one built from every split:
    on each token's own text, and on texts of joined tokens and pieces of tokens."""
    every, firing = _every_split(tokens, ranks), _firing_merges(tokens, ranks)
    assert set(firing) <= set(every)
    vocab = {t: i for i, t in enumerate(tokens)}

    def bpe(merges):
        return Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=True, byte_fallback=True))
    rng = random.Random(0)
    texts = [t for t in tokens if t] + ["".join(rng.choice(tokens)[rng.randint(0, 2):]
                                                for _ in range(rng.randint(1, 12)))
                                        for _ in range(4000)]
    texts += ["\u2581" + t.replace(" ", "\u2581") for t in TEXTS + CORPUS]
    full, pruned = bpe(every).encode_batch(texts), bpe(firing).encode_batch(texts)
    assert [e.ids for e in pruned] == [e.ids for e in full]
    return len(firing), len(every)


def test_gemma_firing_merges_encode_as_every_split(gemma_path):
    from pocketllm.gguf_meta import read_gguf_header
    tokens = _respaced(list(read_gguf_header(gemma_path).metadata["tokenizer.ggml.tokens"]))
    firing, every = _assert_firing_merges_encode_alike(tokens, list(range(len(tokens))))
    assert firing < 0.5 * every  # 236,335 of 514,906


def test_score_ranked_firing_merges_encode_as_every_split(spm_vocab):
    tokens, _types, scores = spm_vocab  # tied scores: the byte tokens'
    _assert_firing_merges_encode_alike(tokens, [-s for s in scores])


def test_gemma_special_tokens(gemma):
    tok, _ = gemma
    ids = tok.encode("<start_of_turn>user\nHi<end_of_turn>\n").ids
    assert ids[0] == 2  # <bos> from add_bos_token
    start, end = tok.token_to_id("<start_of_turn>"), tok.token_to_id("<end_of_turn>")
    assert ids[1] == start and end in ids
    assert tok.decode(ids, skip_special_tokens=True) == "user\nHi\n"
    assert tok.decode(ids, skip_special_tokens=False) == "<bos><start_of_turn>user\nHi<end_of_turn>\n"
    assert tok.encode("Hi", add_special_tokens=False).ids == [tok.token_to_id("Hi")]
    # byte fallback for a character outside the vocabulary
    pieces = tok.encode("\U0010fffd", add_special_tokens=False).tokens
    assert pieces == ["<0xF4>", "<0x8F>", "<0xBF>", "<0xBD>"]
    assert tok.decode(tok.encode("a\U0010fffdb").ids, skip_special_tokens=True) == "a\U0010fffdb"


def test_saved_tokenizer_json_round_trips(gemma):
    tok, saved = gemma
    again = Tokenizer.from_file(saved)
    for text in TEXTS:
        assert again.encode(text).ids == tok.encode(text).ids


def _assert_decodes_alike(full: Tokenizer, lean: Tokenizer, texts) -> None:
    n = full.get_vocab_size()
    assert lean.get_vocab_size() == n
    every = [[i] for i in range(n)]
    runs = every + [full.encode(t).ids for t in texts] + [list(range(i, i + 9)) for i in range(0, n, 97)]
    for skip in (False, True):
        assert lean.decode_batch(runs, skip_special_tokens=skip) == \
            full.decode_batch(runs, skip_special_tokens=skip)
    assert [lean.id_to_token(i) for i in range(n)] == [full.id_to_token(i) for i in range(n)]
    assert lean.get_added_tokens_decoder().keys() == full.get_added_tokens_decoder().keys()


def test_decode_only_decodes_alike(gemma, gemma_path):
    """The detokenizer's tokenizer leaves the merges out: every id, and runs of ids,
    decode as with the full one (Gemma's SentencePiece file; a byte-level one below)."""
    _assert_decodes_alike(gemma[0], tokenizer_from_gguf(gemma_path, decode_only=True),
                          TEXTS + ["<start_of_turn>user\nHi<end_of_turn>\n"])


def test_decode_only_decodes_byte_level_alike(byte_level_vocab, tmp_path):
    tokens, types, merges = byte_level_vocab
    path = _write_vocab_gguf(str(tmp_path / "bl.gguf"), tokens, types, model="gpt2",
                             pre="llama-bpe", merges=merges, bos=0, eos=2)
    _assert_decodes_alike(tokenizer_from_gguf(path), tokenizer_from_gguf(path, decode_only=True),
                          TEXTS + ["<|begin_of_text|>x<|eot_id|><think>"])


@pytest.mark.slow
def test_gemma_matches_transformers(gemma, gemma_ref):
    _compare(gemma[0], gemma_ref)


# ------------------------------------------------------------------ tiny written vocabularies

CORPUS = [
    "The quick brown fox jumps over the lazy dog. " * 3,
    "def square(x):\n    return x ** 2\n\nprint(square(12))\n",
    "Hello, world! Hello there, how are you doing today?\n",
    "  indented   text with    spaces and\ttabs\n\n",
    "numbers 1234567890 and 3.14159, dates 2024-01-31.",
    "Ünïcödé façade naïve résumé",
]


def _write_vocab_gguf(path: str, tokens, types, *, model: str, scores=None, merges=None,
                      pre=None, bos=None, eos=None, add_bos=None, add_eos=None,
                      add_space_prefix=None) -> str:
    w = gguf.GGUFWriter(path, "llama")
    # enough of a llama config for transformers to pick a tokenizer class
    w.add_context_length(128)
    w.add_embedding_length(64)
    w.add_block_count(1)
    w.add_feed_forward_length(128)
    w.add_head_count(4)
    w.add_head_count_kv(4)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_tokenizer_model(model)
    if pre is not None:
        w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    w.add_token_types(types)
    if scores is not None:
        w.add_token_scores(scores)
    if merges is not None:
        w.add_token_merges(merges)
    if bos is not None:
        w.add_bos_token_id(bos)
    if eos is not None:
        w.add_eos_token_id(eos)
    if add_bos is not None:
        w.add_add_bos_token(add_bos)
    if add_eos is not None:
        w.add_add_eos_token(add_eos)
    if add_space_prefix is not None:
        w.add_add_space_prefix(add_space_prefix)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def _trained(tokenizer: Tokenizer, trainer) -> tuple[list[str], list[tuple[str, str]]]:
    tokenizer.train_from_iterator(CORPUS, trainer)
    model = json.loads(tokenizer.to_str())["model"]
    vocab = sorted(model["vocab"].items(), key=lambda kv: kv[1])
    return [t for t, _ in vocab], [tuple(m) for m in model["merges"]]


@pytest.fixture(scope="module")
def byte_level_vocab():
    """A Llama 3-style vocabulary: byte-level BPE with control and user-defined tokens."""
    specials = ["<|begin_of_text|>", "<|end_of_text|>", "<|eot_id|>"]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokens, merges = _trained(tok, trainers.BpeTrainer(
        vocab_size=600, special_tokens=specials, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False))
    tokens = tokens + ["<think>"]
    types = [3 if t in specials else 4 if t == "<think>" else 1 for t in tokens]
    return tokens, types, [f"{a} {b}" for a, b in merges]


# every other name, and a file naming none, is in test_pretokenizers.py
@pytest.mark.parametrize("pre", ["llama-bpe", "qwen2", "gpt-2"])
def test_byte_level_matches_transformers(byte_level_vocab, pre, tmp_path):
    tokens, types, merges = byte_level_vocab
    path = _write_vocab_gguf(str(tmp_path / f"{pre}.gguf"), tokens, types, model="gpt2", pre=pre,
                             merges=merges, bos=0, eos=2, add_bos=(pre == "llama-bpe"))
    ours = tokenizer_from_gguf(path)
    texts = TEXTS + ["<|begin_of_text|>x<|eot_id|>", "<think>hmm</think> ok", "it's 12345 they'll"]
    _compare(ours, _hf_tokenizer(path, HF_ADDS_BOS if pre == "llama-bpe" else HF_DECODES), texts)
    ids = ours.encode("<|eot_id|><think>").ids
    assert ids[-2:] == [2, len(tokens) - 1]
    assert (ids[0] == 0) == (pre == "llama-bpe")  # BOS only where add_bos_token says so


@pytest.fixture(scope="module")
def spm_vocab():
    """A Llama 2-style vocabulary: ▁-escaped BPE pieces ranked by score, <0xNN> byte tokens."""
    specials = ["<unk>", "<s>", "</s>"]
    tok = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="first")
    trained, _ = _trained(tok, trainers.BpeTrainer(vocab_size=400, special_tokens=specials,
                                                   show_progress=False))
    byte_tokens = [f"<0x{b:02X}>" for b in range(256)]
    tokens = specials + byte_tokens + [t for t in trained if t not in specials]
    types = [2, 3, 3] + [6] * 256 + [1] * (len(tokens) - 259)
    scores = [0.0] * 259 + [-float(i) for i in range(len(tokens) - 259)]
    return tokens, types, scores


def test_sentencepiece_scores_match_transformers(spm_vocab, tmp_path):
    tokens, types, scores = spm_vocab
    path = _write_vocab_gguf(str(tmp_path / "spm.gguf"), tokens, types, model="llama",
                             scores=scores, bos=1, eos=2)
    ours = tokenizer_from_gguf(path)
    _compare(ours, _hf_tokenizer(path, HF_ADDS_BOS), TEXTS + ["<s>a</s> b"])
    assert ours.encode("quick").tokens[:2] == ["<s>", "▁quick"]  # BOS by default, dummy prefix


def test_sentencepiece_flags(spm_vocab, tmp_path):
    tokens, types, scores = spm_vocab
    path = _write_vocab_gguf(str(tmp_path / "flags.gguf"), tokens, types, model="llama",
                             scores=scores, bos=1, eos=2, add_bos=False, add_eos=True,
                             add_space_prefix=False)
    tok = tokenizer_from_gguf(path)
    enc = tok.encode("quick fox")
    assert enc.tokens[0] != "<s>" and not enc.tokens[0].startswith("▁")
    assert enc.ids[-1] == 2
    assert tok.decode(enc.ids, skip_special_tokens=True) == "quick fox"


def test_unsupported_vocabularies(spm_vocab, byte_level_vocab, tmp_path):
    tokens, types, scores = spm_vocab
    bert = _write_vocab_gguf(str(tmp_path / "bert.gguf"), tokens, types, model="bert", scores=scores)
    with pytest.raises(UnsupportedFeatureError, match="'bert'"):
        tokenizer_from_gguf(bert)
    tokens, types, merges = byte_level_vocab
    odd = _write_vocab_gguf(str(tmp_path / "odd.gguf"), tokens, types, model="gpt2",
                            pre="some-new-regex", merges=merges)
    with pytest.raises(UnsupportedFeatureError, match="some-new-regex"):
        tokenizer_from_gguf(odd)
    no_merges = _write_vocab_gguf(str(tmp_path / "nomerges.gguf"), tokens, types, model="gpt2",
                                  pre="qwen2")
    with pytest.raises(CheckpointError, match="merges"):
        tokenizer_from_gguf(no_merges)
