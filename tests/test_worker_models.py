"""Config parsing (defaults as transformers' config classes) and rope variants vs transformers."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from pocketllm.errors import CheckpointError, UnsupportedFeatureError  # noqa: E402
from pocketllm.workers.layers.rotary import rope_inv_freq  # noqa: E402
from pocketllm.workers.models.config import FULL, SLIDING  # noqa: E402
from pocketllm.workers.models.gemma3_config import gemma3_arch_config  # noqa: E402
from pocketllm.workers.models.llama_config import llama_arch_config  # noqa: E402


def test_gemma3_defaults_match_transformers():
    ref = transformers.Gemma3TextConfig()
    cfg = gemma3_arch_config({"architectures": ["Gemma3ForCausalLM"]}, "Gemma3ForCausalLM")
    assert (cfg.vocab_size, cfg.hidden_size, cfg.num_layers, cfg.num_heads, cfg.num_kv_heads,
            cfg.head_dim) == (ref.vocab_size, ref.hidden_size, ref.num_hidden_layers,
                              ref.num_attention_heads, ref.num_key_value_heads, ref.head_dim)
    assert cfg.layer_rope == ref.layer_types
    assert cfg.layer_windows == [ref.sliding_window if k == SLIDING else None for k in ref.layer_types]
    assert cfg.rope[FULL]["rope_theta"] == ref.rope_parameters[FULL]["rope_theta"]
    assert cfg.rope[SLIDING]["rope_theta"] == ref.rope_parameters[SLIDING]["rope_theta"]
    assert cfg.attn_scale == ref.query_pre_attn_scalar ** -0.5
    assert cfg.tie_word_embeddings and cfg.hidden_act == "gelu_pytorch_tanh"
    assert cfg.embed_scale == ref.hidden_size ** 0.5 and cfg.final_softcap is None


def test_gemma3_old_style_keys():
    hf = {"num_hidden_layers": 4, "sliding_window_pattern": 2, "rope_theta": 5e5,
          "rope_local_base_freq": 2e4, "rope_scaling": {"rope_type": "linear", "factor": 8.0},
          "sliding_window": 512}
    cfg = gemma3_arch_config(hf, "Gemma3ForCausalLM")
    assert cfg.layer_windows == [512, None, 512, None]
    assert cfg.rope[FULL] == {"rope_type": "linear", "factor": 8.0, "rope_theta": 5e5}
    assert cfg.rope[SLIDING] == {"rope_type": "default", "rope_theta": 2e4}  # no scaling locally


@pytest.mark.parametrize("arch, cls", [("LlamaForCausalLM", "LlamaConfig"),
                                       ("Qwen2ForCausalLM", "Qwen2Config"),
                                       ("Qwen3ForCausalLM", "Qwen3Config"),
                                       ("MistralForCausalLM", "MistralConfig")])
def test_llama_family_defaults_match_transformers(arch, cls):
    ref = getattr(transformers, cls)()
    cfg = llama_arch_config({"architectures": [arch]}, arch)
    assert (cfg.vocab_size, cfg.hidden_size, cfg.intermediate_size, cfg.num_layers, cfg.num_heads,
            cfg.num_kv_heads, cfg.max_position_embeddings, cfg.tie_word_embeddings) == (
        ref.vocab_size, ref.hidden_size, ref.intermediate_size, ref.num_hidden_layers,
        ref.num_attention_heads, ref.num_key_value_heads, ref.max_position_embeddings,
        ref.tie_word_embeddings)
    assert cfg.head_dim == (getattr(ref, "head_dim", None) or ref.hidden_size // ref.num_attention_heads)
    assert cfg.rope["default"]["rope_theta"] == 10000.0
    assert cfg.qkv_bias == (arch == "Qwen2ForCausalLM") and cfg.qk_norm == (arch == "Qwen3ForCausalLM")
    window = getattr(ref, "sliding_window", None) if arch == "MistralForCausalLM" else None
    assert set(cfg.layer_windows) == {window}


def test_qwen_sliding_layers_follow_max_window_layers():
    hf = {"num_hidden_layers": 4, "use_sliding_window": True, "sliding_window": 16,
          "max_window_layers": 2}
    assert llama_arch_config(hf, "Qwen2ForCausalLM").layer_windows == [None, None, 16, 16]
    hf["use_sliding_window"] = False
    assert llama_arch_config(hf, "Qwen2ForCausalLM").layer_windows == [None] * 4


@pytest.mark.parametrize("params", [
    {"rope_type": "default", "rope_theta": 10000.0},
    {"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0},
    {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
     "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
    {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
     "original_max_position_embeddings": 4096},
])
def test_rope_frequencies_match_transformers(params):
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    config = transformers.LlamaConfig(hidden_size=512, num_attention_heads=4,
                                      max_position_embeddings=16384, rope_parameters=dict(params))
    mine, mine_scale = rope_inv_freq(128, params, 16384)
    if params["rope_type"] == "default":
        ref = 1.0 / (params["rope_theta"] ** (torch.arange(0, 128, 2).float() / 128))
        ref_scale = 1.0
    else:
        ref, ref_scale = ROPE_INIT_FUNCTIONS[params["rope_type"]](config, "cpu")
    torch.testing.assert_close(mine, ref.float())
    assert mine_scale == pytest.approx(ref_scale)


def test_unsupported_and_malformed_configs_are_refused():
    with pytest.raises(UnsupportedFeatureError):
        rope_inv_freq(64, {"rope_type": "dynamic", "rope_theta": 1e4, "factor": 2.0}, 4096)
    with pytest.raises(CheckpointError, match="layer_types"):
        gemma3_arch_config({"num_hidden_layers": 2, "layer_types": ["full_attention"]}, "Gemma3ForCausalLM")
    bad = llama_arch_config({"num_attention_heads": 6, "num_key_value_heads": 4}, "LlamaForCausalLM")
    with pytest.raises(CheckpointError, match="multiple"):
        bad.validate()
