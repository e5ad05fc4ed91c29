"""Weight loading: safetensors (single, sharded, multimodal names), dummy weights, bad checkpoints."""

from __future__ import annotations

import json
import os
import shutil

import pytest

torch = pytest.importorskip("torch")
from safetensors.torch import load_file, save_file  # noqa: E402

from pocketllm.config import EngineArgs  # noqa: E402
from pocketllm.errors import CheckpointError  # noqa: E402
from pocketllm.model_info import load_model_info  # noqa: E402
from pocketllm.proto.messages import SamplingSpec  # noqa: E402
from pocketllm.workers.runner import ModelRunner  # noqa: E402
from tiny_checkpoints import PlanDriver, make_tiny_checkpoint  # noqa: E402

PROMPT = [5, 17, 42, 99, 123, 7, 300, 301, 12, 64, 88]


def runner_for(path: str, **kw) -> ModelRunner:
    args = EngineArgs(model=path, device="cpu", dtype="float32", block_size=4, num_kv_blocks=32,
                      **kw)
    return ModelRunner(load_model_info(args), args)


def greedy(runner: ModelRunner, n: int = 8) -> list[int]:
    driver = PlanDriver(runner)
    driver.add("r", PROMPT, SamplingSpec(temperature=0.0, logprobs=0), n)
    return driver.run()["r"]


@pytest.fixture(scope="module")
def gemma_dir(tmp_path_factory) -> str:
    return make_tiny_checkpoint("gemma3", str(tmp_path_factory.mktemp("gemma")))


@pytest.fixture(scope="module")
def reference_tokens(gemma_dir) -> list[int]:
    return greedy(runner_for(gemma_dir))


def rewrite(src: str, dst: str, edit) -> str:
    """Copy a checkpoint, passing its tensors through ``edit(dict) -> dict``."""
    shutil.copytree(src, dst)
    tensors = edit(load_file(os.path.join(src, "model.safetensors")))
    save_file(tensors, os.path.join(dst, "model.safetensors"))
    return dst


def test_sharded_checkpoint_with_index(gemma_dir, reference_tokens, tmp_path):
    dst = str(tmp_path / "sharded")
    shutil.copytree(gemma_dir, dst)
    tensors = load_file(os.path.join(dst, "model.safetensors"))
    os.remove(os.path.join(dst, "model.safetensors"))
    names = sorted(tensors)
    shards = {"model-00001-of-00002.safetensors": names[::2],
              "model-00002-of-00002.safetensors": names[1::2]}
    for shard, keys in shards.items():
        save_file({k: tensors[k] for k in keys}, os.path.join(dst, shard))
    with open(os.path.join(dst, "model.safetensors.index.json"), "w") as f:
        json.dump({"weight_map": {k: s for s, ks in shards.items() for k in ks}}, f)
    assert greedy(runner_for(dst)) == reference_tokens


def test_multimodal_gemma_names_load_the_text_tower(gemma_dir, reference_tokens, tmp_path):
    def nest(tensors: dict) -> dict:
        out = {k.replace("model.", "model.language_model.", 1): v for k, v in tensors.items()}
        out["model.vision_tower.patch_embedding.weight"] = torch.zeros(2, 2)
        return out

    dst = rewrite(gemma_dir, str(tmp_path / "mm"), nest)
    with open(os.path.join(gemma_dir, "config.json")) as f:
        text_config = json.load(f)
    with open(os.path.join(dst, "config.json"), "w") as f:
        json.dump({"architectures": ["Gemma3ForConditionalGeneration"], "model_type": "gemma3",
                   "text_config": text_config}, f)
    assert greedy(runner_for(dst)) == reference_tokens


@pytest.mark.parametrize("edit, needle", [
    (lambda t: {k: v for k, v in t.items() if k != "model.layers.1.mlp.up_proj.weight"},
     "model.layers.1.mlp.up_proj.weight"),
    (lambda t: {**t, "model.layers.9.mlp.up_proj.weight": torch.zeros(1)}, "model.layers.9"),
    (lambda t: {**t, "model.layers.0.self_attn.k_proj.weight": torch.zeros(3, 64)},
     "model.layers.0.self_attn.k_proj.weight"),
], ids=["missing", "unknown", "ill-shaped"])
def test_bad_checkpoints_name_the_tensor(gemma_dir, tmp_path, edit, needle):
    dst = rewrite(gemma_dir, str(tmp_path / "bad"), edit)
    with pytest.raises(CheckpointError, match=needle.replace(".", r"\.")):
        runner_for(dst)


def test_dummy_weights_from_a_bare_config(gemma_dir, tmp_path):
    bare = tmp_path / "bare"
    bare.mkdir()
    shutil.copy(os.path.join(gemma_dir, "config.json"), bare / "config.json")
    first = runner_for(str(bare), load_format="dummy", seed=1)
    again = runner_for(str(bare), load_format="dummy", seed=1)
    other = runner_for(str(bare), load_format="dummy", seed=2)
    for (name, a), (_, b) in zip(first.model.named_parameters(), again.model.named_parameters()):
        assert torch.equal(a, b), name
    assert not torch.equal(first.model.embed_tokens.weight, other.model.embed_tokens.weight)
    assert greedy(first) == greedy(again)
    driver = PlanDriver(first)
    driver.add("r", PROMPT, SamplingSpec(temperature=0.0, logprobs=5), 3)
    driver.run()
    lp = driver.reqs["r"].logprobs[0]
    assert all(-20 < v <= 0 for v in lp.top_logprobs)  # small std: sane, finite logits
