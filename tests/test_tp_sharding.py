"""Tensor-parallel weight sharding, in process (no process group is needed to build and
load one rank's model): each rank's parameters are its part of the single-rank model's,
read lazily from safetensors or sliced from whole tensors (the GGUF path), and the split
rules refuse what does not divide."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from pocketllm.config import EngineArgs  # noqa: E402
from pocketllm.errors import UnsupportedFeatureError  # noqa: E402
from pocketllm.model_info import load_model_info  # noqa: E402
from pocketllm.workers.distributed import TPGroup  # noqa: E402
from pocketllm.workers.layers.attention import TorchAttention  # noqa: E402
from pocketllm.workers.layers.linear import Shard, vocab_shard  # noqa: E402
from pocketllm.workers.loader import load_model_weights  # noqa: E402
from pocketllm.workers.loader.safetensors import load_safetensors_weights  # noqa: E402
from pocketllm.workers.models.base import check_tensor_parallel  # noqa: E402
from pocketllm.workers.models.registry import arch_config, build_model  # noqa: E402
from tiny_checkpoints import make_tiny_checkpoint  # noqa: E402

CPU = torch.device("cpu")


def build(info, args, tp=TPGroup(), eager=False):
    with torch.inference_mode():
        model = build_model(info, TorchAttention(), CPU, torch.float32, tp)
        if eager:  # whole tensors, sliced by the model: what the GGUF loader hands over
            model.load_weights(load_safetensors_weights(info.path))
        else:
            load_model_weights(model, info, args)
    return model


@pytest.mark.parametrize("family, overrides, world", [
    ("llama", {"vocab_size": 509}, 2),  # uneven vocabulary slices
    ("qwen2", {}, 2),  # biases
    ("gemma3", {"num_key_value_heads": 1}, 2),  # a replicated KV head, (1 + w) norms
    ("qwen3", {}, 4),  # 2 KV heads over 4 ranks
])
def test_each_rank_holds_its_part(family, overrides, world, tmp_path):
    path = make_tiny_checkpoint(family, str(tmp_path / family), overrides)
    for load_format in ("auto", "dummy"):
        args = EngineArgs(model=path, device="cpu", load_format=load_format)
        info = load_model_info(args)
        cfg = arch_config(info)
        whole = build(info, args).state_dict()
        d, heads, kv = cfg.head_dim, cfg.num_heads, cfg.num_kv_heads
        whole_qkv = whole["layers.0.self_attn.qkv_proj.weight"]
        qkv_parts, o_parts, gate_up_parts, down_parts, embed_parts = [], [], [], [], []
        for rank in range(world):
            tp = TPGroup(rank, world)
            model = build(info, args, tp)
            if load_format == "auto":  # lazy reads and whole-tensor slicing agree
                eager = build(info, args, tp, eager=True).state_dict()
                for name, value in model.state_dict().items():
                    assert torch.equal(value, eager[name]), name
            part = model.state_dict()
            # every replicated parameter is the single rank's
            for name in ("norm.weight", "layers.0.input_layernorm.weight"):
                assert torch.equal(part[name], whole[name])
            q, k, v = part["layers.0.self_attn.qkv_proj.weight"].split(
                model.layers[0].self_attn.split)
            whole_q, whole_k, whole_v = whole_qkv.split([heads * d, kv * d, kv * d])
            first = rank * kv // world  # the KV head(s) this rank's query heads read
            kv_rows = slice(first * d, (first + max(1, kv // world)) * d)
            assert torch.equal(k, whole_k[kv_rows]) and torch.equal(v, whole_v[kv_rows])
            qkv_parts.append(q)
            o_parts.append(part["layers.0.self_attn.o_proj.weight"])
            gate, up = part["layers.0.mlp.gate_up_proj.weight"].chunk(2)
            gate_up_parts.append((gate, up))
            down_parts.append(part["layers.0.mlp.down_proj.weight"])
            rows, shard = vocab_shard(cfg.vocab_size, tp)
            embed = part["embed_tokens.weight"]
            assert embed.shape[0] == rows and not embed[shard.size:].any()  # zero padding
            embed_parts.append(embed[:shard.size])
        assert torch.equal(torch.cat(qkv_parts), whole_q)
        assert torch.equal(torch.cat(o_parts, dim=1), whole["layers.0.self_attn.o_proj.weight"])
        inter = cfg.intermediate_size
        whole_gate_up = whole["layers.0.mlp.gate_up_proj.weight"]
        assert torch.equal(torch.cat([g for g, _ in gate_up_parts]), whole_gate_up[:inter])
        assert torch.equal(torch.cat([u for _, u in gate_up_parts]), whole_gate_up[inter:])
        assert torch.equal(torch.cat(down_parts, dim=1), whole["layers.0.mlp.down_proj.weight"])
        assert torch.equal(torch.cat(embed_parts), whole["embed_tokens.weight"])


def test_rules_refuse_what_does_not_split():
    info = load_model_info(EngineArgs(model=make_tiny_checkpoint("llama")))
    cfg = arch_config(info)  # 4 heads, 2 KV heads, intermediate 128
    for world in (1, 2, 4):
        check_tensor_parallel(cfg, world)
    with pytest.raises(UnsupportedFeatureError, match="num_attention_heads=4 is not divisible "
                                                      "by tensor_parallel_size=8"):
        check_tensor_parallel(cfg, 8)
    cfg.num_heads, cfg.num_kv_heads = 6, 3
    with pytest.raises(UnsupportedFeatureError, match="num_key_value_heads=3 neither divides"):
        check_tensor_parallel(cfg, 2)
    cfg.num_heads, cfg.num_kv_heads, cfg.intermediate_size = 4, 2, 130
    with pytest.raises(UnsupportedFeatureError, match="intermediate_size=130"):
        check_tensor_parallel(cfg, 4)


def test_shard_and_vocab_split():
    assert Shard(0, 0, 8, 8).whole and not Shard(1, 4, 8, 8).whole
    t = torch.arange(24).view(3, 8)
    assert torch.equal(Shard(1, 4, 8, 8).take(t), t[:, 4:])
    # 10 ids over 4 ranks: 3 rows each, the last rank holds one real id
    assert [vocab_shard(10, TPGroup(r, 4))[1] for r in range(4)] == [
        Shard(0, 0, 3, 10), Shard(0, 3, 6, 10), Shard(0, 6, 9, 10), Shard(0, 9, 10, 10)]
    assert vocab_shard(10, TPGroup(0, 4))[0] == 3
