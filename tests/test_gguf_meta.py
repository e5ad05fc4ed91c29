"""The GGUF header reader (pocketllm/gguf_meta.py): a long string array is decoded only
when read, and reads the same values as decoding it at once."""

from __future__ import annotations

import hashlib

import gguf
import numpy as np
import pytest

from pocketllm import gguf_meta
from pocketllm.errors import CheckpointError
from pocketllm.gguf_meta import LazyStrings, read_gguf_header

N_TOKENS = 3000  # above gguf_meta._LAZY_MIN


@pytest.fixture(autouse=True)
def fresh_cache():
    read_gguf_header.cache_clear()  # another test's (or the eager read's) header is not reused
    yield
    read_gguf_header.cache_clear()


@pytest.fixture
def decodes(monkeypatch):
    """How many string arrays of ``_LAZY_MIN`` strings or more were decoded so far."""
    calls = []
    decode = gguf_meta._decode_strings

    def counted(data, pos, count):
        if count >= gguf_meta._LAZY_MIN:
            calls.append(count)
        return decode(data, pos, count)

    monkeypatch.setattr(gguf_meta, "_decode_strings", counted)
    return calls


def _eager_header(path: str, monkeypatch) -> gguf_meta.GGUFHeader:
    """The header as read before the lazy arrays: every string array decoded at once."""
    with monkeypatch.context() as m:
        m.setattr(gguf_meta, "_LAZY_MIN", 1 << 62)
        read_gguf_header.cache_clear()
        header = read_gguf_header(path)
        read_gguf_header.cache_clear()
    assert not any(isinstance(v, LazyStrings) for v in header.metadata.values())
    return header


@pytest.fixture
def synthetic(tmp_path) -> str:
    path = str(tmp_path / "vocab.gguf")
    tokens = [f"tok{i}" for i in range(N_TOKENS)]
    tokens[1:5] = ["", "▁▁", "日本語", "\n"]
    tokens[7] = b"\xe2\x82"  # a piece of a character: decoded with U+FFFD, as before
    w = gguf.GGUFWriter(path, "llama")
    w.add_array("general.tags", ["a", "b"])  # a short string array stays a list
    w.add_token_list(tokens)
    w.add_token_merges([f"t o{i}" for i in range(N_TOKENS)])
    w.add_token_types([1] * N_TOKENS)
    w.add_bos_token_id(2)  # fields after the long arrays: found only if they were walked right
    w.add_string("tokenizer.chat_template", "{{ messages }}")
    w.add_tensor("a.weight", np.arange(12, dtype=np.float32).reshape(3, 4))
    w.add_tensor("b.weight", np.ones(5, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_long_string_arrays_decode_on_first_read(synthetic, decodes):
    meta = read_gguf_header(synthetic).metadata
    tokens, merges = meta["tokenizer.ggml.tokens"], meta["tokenizer.ggml.merges"]
    assert isinstance(tokens, LazyStrings) and isinstance(merges, LazyStrings)
    assert meta["general.tags"] == ["a", "b"] and isinstance(meta["general.tags"], list)
    assert len(tokens) == N_TOKENS and len(merges) == N_TOKENS and bool(tokens)
    assert decodes == []
    assert tokens[3] == "日本語" and tokens[-1] == f"tok{N_TOKENS - 1}"
    assert decodes == [N_TOKENS]  # this array only, once
    assert list(tokens)[:3] == ["tok0", "", "▁▁"] and "\n" in tokens
    assert decodes == [N_TOKENS]
    assert read_gguf_header(synthetic).metadata["tokenizer.ggml.tokens"] is tokens  # cached


def test_synthetic_values_match_gguf_reader_and_the_eager_read(synthetic, monkeypatch):
    header = read_gguf_header(synthetic)
    ref = gguf.GGUFReader(synthetic)
    for key in ("tokenizer.ggml.tokens", "tokenizer.ggml.merges", "general.tags"):
        field = ref.fields[key]
        want = [bytes(field.parts[i]).decode("utf-8", errors="replace") for i in field.data]
        assert header.metadata[key] == want, key
    assert header.metadata["tokenizer.ggml.tokens"][7] == "\ufffd"
    assert header.metadata["tokenizer.ggml.bos_token_id"] == 2
    assert header.metadata["tokenizer.chat_template"] == "{{ messages }}"
    assert {n: t.offset for n, t in header.tensors.items()} == \
           {t.name: int(t.data_offset) for t in ref.tensors}
    eager = _eager_header(synthetic, monkeypatch)
    assert header.metadata == eager.metadata and header.tensors == eager.tensors


def test_embedded_model_tokens_read_lazily_and_alike(default_model_path, monkeypatch, decodes):
    from pocketllm.config import EngineArgs
    from pocketllm.model_info import load_model_info

    info = load_model_info(EngineArgs(model=default_model_path))  # the frontend's read
    assert info.vocab_size == 262144
    tokens = read_gguf_header(default_model_path).metadata["tokenizer.ggml.tokens"]
    assert isinstance(tokens, LazyStrings) and decodes == []  # the frontend decodes none
    eager = _eager_header(default_model_path, monkeypatch)
    header = read_gguf_header(default_model_path)
    assert header.metadata == eager.metadata and header.tensors == eager.tensors
    assert tokens[:4] == ["<pad>", "<eos>", "<bos>", "<unk>"]
    assert tokens[105:108] == ["<start_of_turn>", "<end_of_turn>", "\n"]
    # taken from the eager reader (main at 12c2f5b) on this file (sha256 a5fd3b62...6818)
    assert hashlib.sha256("\x00".join(tokens).encode()).hexdigest() == \
           "127134498cd23351bb66343ed90d206c1bba6724970abd5e6300f113b34a1cc2"


def test_string_array_past_the_end_is_refused_at_read(synthetic, tmp_path):
    data = open(synthetic, "rb").read()
    start = data.index(b"tokenizer.ggml.tokens") + len("tokenizer.ggml.tokens") + 4 + 4 + 8
    end = data.index(b"tokenizer.ggml.merges") - 8  # the next key's length
    for cut in (start + 100, start + 8 * N_TOKENS, end - 1):  # inside the tokens
        path = str(tmp_path / f"cut{cut}.gguf")
        with open(path, "wb") as f:
            f.write(data[:cut])
        with pytest.raises(CheckpointError, match="cannot read GGUF file"):
            read_gguf_header(path)


def test_model_info_leaves_out_an_unknown_long_string_array(tmp_path):
    """engine.json carries the tokenizer.ggml.* settings as JSON: a long string array that no
    stage reads stays out (a LazyStrings is no JSON value)."""
    import json

    from pocketllm.config import EngineArgs
    from pocketllm.model_info import load_model_info

    path = str(tmp_path / "llama.gguf")
    w = gguf.GGUFWriter(path, "llama")
    for add, value in ((w.add_context_length, 128), (w.add_embedding_length, 64),
                       (w.add_block_count, 1), (w.add_feed_forward_length, 128),
                       (w.add_head_count, 4), (w.add_head_count_kv, 4)):
        add(value)
    w.add_tokenizer_model("llama")
    w.add_token_list([f"t{i}" for i in range(N_TOKENS)])
    w.add_array("tokenizer.ggml.unknown_strings", [f"s{i}" for i in range(N_TOKENS)])
    w.add_array("tokenizer.ggml.short_strings", ["x", "y"])
    w.add_eos_token_id(1)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    info = load_model_info(EngineArgs(model=path))
    assert info.vocab_size == N_TOKENS
    assert "tokenizer.ggml.unknown_strings" not in info.tokenizer_config
    assert info.tokenizer_config["tokenizer.ggml.short_strings"] == ["x", "y"]
    assert json.loads(json.dumps(info.to_dict()))["tokenizer_config"] == info.tokenizer_config
