"""Checkpoint metadata: shipped model shapes, --tokenizer, EOS resolution."""

from __future__ import annotations

import json
import shutil

import pytest

from pocketllm import CheckpointError, EngineArgs
from pocketllm.model_info import load_model_info
from pocketllm.tokenizer.tokenizer import load_tokenizer


@pytest.mark.parametrize("name, arch, layers", [("llama-3-8b", "LlamaForCausalLM", 32),
                                                ("llama-3-70b", "LlamaForCausalLM", 80),
                                                ("qwen3-8b", "Qwen3ForCausalLM", 36),
                                                ("qwen3-30b-a3b", "Qwen3MoeForCausalLM", 48),
                                                ("gpt-oss-20b", "GptOssForCausalLM", 24),
                                                ("deepseek-v2-lite", "DeepseekV2ForCausalLM", 27),
                                                ("qwen3.5-0.8b", "Qwen3_5ForCausalLM", 24),
                                                ("qwen3.5-9b", "Qwen3_5ForCausalLM", 32),
                                                ("qwen3.5-35b-a3b", "Qwen3_5MoeForCausalLM", 40)])
def test_shipped_shapes_for_dummy_benchmarks(name, arch, layers):
    info = load_model_info(EngineArgs(model=name, load_format="dummy"))
    assert info.architecture == arch and info.hf_config["num_hidden_layers"] == layers
    assert info.format == "dummy" and info.tokenizer_path is None
    tok = load_tokenizer(info)  # a placeholder vocabulary: ids read as <id>
    assert tok.placeholder and tok.tokenizer.decode([5, 17]) == "<5><17>"
    with pytest.raises(CheckpointError):
        load_model_info(EngineArgs(model=name))  # only dummy weights exist for a shape


def test_tokenizer_override_and_eos_order(tiny_llama, tmp_path):
    bare = tmp_path / "bare"
    bare.mkdir()
    shutil.copy(f"{tiny_llama}/config.json", bare / "config.json")
    info = load_model_info(EngineArgs(model=str(bare), load_format="dummy",
                                      tokenizer=tiny_llama))
    assert info.tokenizer_path.endswith("tokenizer.json") and info.chat_template
    assert not load_tokenizer(info).placeholder
    cfg_eos = json.loads((bare / "config.json").read_text()).get("eos_token_id")
    assert info.eos_source == "config" and info.eos_token_ids == [cfg_eos]
    (bare / "generation_config.json").write_text(json.dumps({"eos_token_id": [3, 4]}))
    info = load_model_info(EngineArgs(model=str(bare), load_format="dummy"))
    assert info.eos_source == "generation_config" and info.eos_token_ids == [3, 4]
    info = load_model_info(EngineArgs(model=str(bare), load_format="dummy",
                                      backend_options={"eos_token_id": 9}))
    assert info.eos_source == "backend_options" and info.eos_token_ids == [9]
    with pytest.raises(CheckpointError):
        load_model_info(EngineArgs(model=str(bare), tokenizer=str(tmp_path / "nope")))


def test_default_gguf_eos_from_metadata(default_model_path):
    info = load_model_info(EngineArgs())
    assert info.eos_source == "gguf" and 1 in info.eos_token_ids
