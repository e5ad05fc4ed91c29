"""gpt-oss's MXFP4 expert checkpoints (the format the released files use): the
dequantization against transformers' own, a tiny checkpoint rewritten in MXFP4 against
transformers dequantizing it (tokens, log probabilities, each tensor-parallel rank's
share), and the checks on the blocks/scales pairs and on which tensors may be MXFP4."""

from __future__ import annotations

import json
import shutil

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from pocketllm import EngineArgs  # noqa: E402
from pocketllm.errors import CheckpointError  # noqa: E402
from pocketllm.model_info import load_model_info  # noqa: E402
from pocketllm.workers.distributed import TPGroup  # noqa: E402
from test_worker_parity import PROMPT, make_runner  # noqa: E402
from tiny_checkpoints import gpt_oss_clamp_from_config, make_tiny_checkpoint  # noqa: E402
from family_parity import assert_matches, run  # noqa: E402

FP4 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
                    -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0])


def quantize_mxfp4(weight):
    """An HF-layout expert tensor [E, cols, rows] -> (blocks [E, rows, cols/32, 16], scales
    [E, rows, cols/32]) as the released files store it: 32 values share a power of two
    that brings their largest to at most 6, each rounded to the nearest e2m1 value."""
    groups = weight.transpose(1, 2).reshape(weight.shape[0], weight.shape[2], -1, 32)
    exp = torch.ceil(torch.log2(groups.abs().amax(-1).clamp(min=1e-30) / 6.0)).clamp(-127, 127)
    scaled = groups / torch.exp2(exp).unsqueeze(-1)
    codes = (scaled.unsqueeze(-1) - FP4).abs().argmin(-1).to(torch.uint8)
    return codes[..., 0::2] | (codes[..., 1::2] << 4), (exp + 127).to(torch.uint8)


def test_mxfp4_dequantization_equals_transformers():
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    from pocketllm.workers.loader.mxfp4 import dequantize_mxfp4

    gen = torch.Generator().manual_seed(0)
    blocks = torch.randint(0, 256, (3, 10, 4, 16), generator=gen, dtype=torch.uint8)
    scales = torch.randint(0, 255, (3, 10, 4), generator=gen, dtype=torch.uint8)  # E8M0, no NaN
    ours = dequantize_mxfp4(blocks, scales)
    assert ours.shape == (3, 128, 10) and ours.dtype == torch.float32
    assert torch.equal(ours, convert_moe_packed_tensors(blocks, scales, dtype=torch.float32))


@pytest.fixture(scope="module")
def mxfp4_path(tmp_path_factory) -> str:
    """The tiny checkpoint (intermediate 64: both expert widths are whole 32-value blocks)
    with its experts rewritten in MXFP4, as the released files are."""
    from safetensors.torch import load_file, save_file

    path = make_tiny_checkpoint("gpt_oss", str(tmp_path_factory.mktemp("mxfp4")),
                                overrides={"intermediate_size": 64})
    state = load_file(f"{path}/model.safetensors")
    for name in [n for n in state if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        state[name + "_blocks"], state[name + "_scales"] = quantize_mxfp4(state.pop(name))
    save_file(state, f"{path}/model.safetensors", metadata={"format": "pt"})
    with open(f"{path}/config.json") as f:
        cfg = json.load(f)
    cfg["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens",
        "lm_head"]}
    with open(f"{path}/config.json", "w") as f:
        json.dump(cfg, f)
    return path


@pytest.mark.skipif(not gpt_oss_clamp_from_config(), reason="an older transformers (5.17) "
                    "computes MXFP4 experts in another order: logprobs differ by ~5e-4")
def test_mxfp4_checkpoint_matches_transformers(mxfp4_path):
    """transformers dequantizes an MXFP4 checkpoint on the CPU; so does the loader here:
    the same tokens and log probabilities; at TP=2 each rank holds its share."""
    from transformers import Mxfp4Config

    hf = transformers.AutoModelForCausalLM.from_pretrained(
        mxfp4_path, dtype=torch.float32, attn_implementation="eager",
        quantization_config=Mxfp4Config(dequantize=True))
    hf.generation_config.eos_token_id = None
    with torch.inference_mode():
        out = hf.generate(torch.tensor([PROMPT]), max_new_tokens=16, do_sample=False,
                          output_logits=True, return_dict_in_generate=True, pad_token_id=0)
    reference = (out.sequences[0, len(PROMPT):].tolist(),
                 torch.stack(out.logits)[:, 0].float().log_softmax(-1))
    runner = make_runner(mxfp4_path)
    moe = runner.model.layers[1].mlp
    assert torch.equal(moe.w2, hf.model.layers[1].mlp.experts.down_proj.transpose(1, 2))
    tokens, driver = run(runner, {"r": PROMPT}, new_tokens=16)
    assert_matches(tokens["r"], driver.reqs["r"].logprobs, reference)
    # each tensor-parallel rank dequantizes and keeps its own intermediate columns
    from pocketllm.workers.layers.attention import TorchAttention
    from pocketllm.workers.loader import load_model_weights
    from pocketllm.workers.models.registry import build_model

    args = EngineArgs(model=mxfp4_path, device="cpu", dtype="float32")
    info = load_model_info(args)
    whole = runner.model.layers[1].mlp.w13  # [E, gate 64 | up 64, H]
    for rank in range(2):
        model = build_model(info, TorchAttention(), torch.device("cpu"), torch.float32,
                            TPGroup(rank, 2))
        load_model_weights(model, info, args, show_progress=False)
        cols = slice(32 * rank, 32 * rank + 32)
        want = torch.cat((whole[:, cols], whole[:, 64:][:, cols]), dim=1)
        assert torch.equal(model.layers[1].mlp.w13, want)


def test_mxfp4_pairs_and_names_are_checked(mxfp4_path, tmp_path):
    from safetensors.torch import load_file, save_file

    path = shutil.copytree(mxfp4_path, tmp_path / "broken")
    state = load_file(path / "model.safetensors")
    del state["model.layers.2.mlp.experts.down_proj_scales"]
    save_file(state, path / "model.safetensors")
    with pytest.raises(CheckpointError, match="down_proj_scales' is missing"):
        make_runner(str(path))
    state = load_file(mxfp4_path + "/model.safetensors")
    state["model.layers.0.self_attn.q_proj.weight_blocks"] = torch.zeros(64, 2, 16,
                                                                        dtype=torch.uint8)
    save_file(state, path / "model.safetensors")
    with pytest.raises(CheckpointError, match="only the experts' gate_up_proj and down_proj"):
        make_runner(str(path))
