"""FP8 (e4m3) checkpoints (``workers/loader/fp8.py``): a tiny Llama checkpoint's matrices
stored as float8 with block scales (DeepSeek-V3's and Qwen3-FP8's ``weight_scale_inv``,
blocks that do not divide the matrix included) or per-row scales (compressed-tensors'
``weight_scale``, with static activation scales it does not use) computes exactly what a
float checkpoint of the dequantized weights does; other quantizations and broken pairs
are refused by name."""

from __future__ import annotations

import json
import os
import shutil

import pytest

torch = pytest.importorskip("torch")
from safetensors.torch import load_file, save_file  # noqa: E402

from pocketllm.errors import CheckpointError, UnsupportedFeatureError  # noqa: E402
from family_parity import run  # noqa: E402
from test_worker_parity import PROMPT, make_runner  # noqa: E402
from tiny_checkpoints import make_tiny_checkpoint  # noqa: E402

E4M3_MAX = 448.0


def _quantize(w: torch.Tensor, block):
    """(e4m3 matrix, scales): per (rows x cols) block, or per row where block is None."""
    if block is None:
        scale = w.abs().amax(1, keepdim=True).clamp_min(1e-12) / E4M3_MAX
        full = scale
    else:
        r, c = block
        grid = (-(-w.shape[0] // r), -(-w.shape[1] // c))
        scale = torch.zeros(grid)
        for i in range(grid[0]):
            for j in range(grid[1]):
                scale[i, j] = w[i * r:(i + 1) * r, j * c:(j + 1) * c].abs().max().clamp_min(1e-12) / E4M3_MAX
        full = scale.repeat_interleave(r, 0)[:w.shape[0]].repeat_interleave(c, 1)[:, :w.shape[1]]
    q = (w / full).to(torch.float8_e4m3fn)
    return q, scale


def fp8_pair(tmp_path, scheme: str):
    """(the FP8 checkpoint, a float32 checkpoint of its dequantized weights)."""
    src = make_tiny_checkpoint("llama")
    fp8_dir, ref_dir = str(tmp_path / "fp8"), str(tmp_path / "ref")
    shutil.copytree(src, fp8_dir)
    shutil.copytree(src, ref_dir)
    tensors = load_file(os.path.join(src, "model.safetensors"))
    quantized, reference = {}, {}
    block = (48, 32) if scheme == "fp8" else None  # 64 rows: one whole block and one of 16
    for name, w in tensors.items():
        if name.endswith("proj.weight"):
            q, scale = _quantize(w.float(), block)
            quantized[name] = q
            if scheme == "fp8":
                quantized[name + "_scale_inv"] = scale
            else:
                quantized[name + "_scale"] = scale
                quantized[name.replace(".weight", ".input_scale")] = torch.ones(1)
            full = (scale.repeat_interleave(block[0], 0)[:w.shape[0]]
                    .repeat_interleave(block[1], 1)[:, :w.shape[1]] if block else scale)
            reference[name] = q.float() * full
        else:
            quantized[name] = reference[name] = w
    save_file(quantized, os.path.join(fp8_dir, "model.safetensors"))
    save_file(reference, os.path.join(ref_dir, "model.safetensors"))
    with open(os.path.join(fp8_dir, "config.json")) as f:
        cfg = json.load(f)
    if scheme == "fp8":
        cfg["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3",
                                      "activation_scheme": "dynamic",
                                      "weight_block_size": list(block)}
    else:
        cfg["quantization_config"] = {
            "quant_method": "compressed-tensors", "format": "float-quantized",
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": {
                "num_bits": 8, "type": "float", "strategy": "channel", "symmetric": True}}}}
    with open(os.path.join(fp8_dir, "config.json"), "w") as f:
        json.dump(cfg, f)
    return fp8_dir, ref_dir


@pytest.mark.parametrize("scheme", ["fp8", "compressed-tensors"])
def test_an_fp8_checkpoint_computes_what_its_dequantized_weights_do(tmp_path, scheme):
    fp8_dir, ref_dir = fp8_pair(tmp_path, scheme)
    got, got_driver = run(make_runner(fp8_dir), {"r": PROMPT}, new_tokens=12)
    want, want_driver = run(make_runner(ref_dir), {"r": PROMPT}, new_tokens=12)
    assert got["r"] == want["r"]
    assert [lp.logprob for lp in got_driver.reqs["r"].logprobs] == \
        [lp.logprob for lp in want_driver.reqs["r"].logprobs]


def _edit(path, change_config=None, drop=None):
    if change_config is not None:
        with open(os.path.join(path, "config.json")) as f:
            cfg = json.load(f)
        change_config(cfg)
        with open(os.path.join(path, "config.json"), "w") as f:
            json.dump(cfg, f)
    if drop is not None:
        file = os.path.join(path, "model.safetensors")
        tensors = load_file(file)
        del tensors[drop]
        save_file(tensors, file)


def test_other_quantizations_and_broken_pairs_are_refused_by_name(tmp_path):
    fp8_dir, _ = fp8_pair(tmp_path, "fp8")
    _edit(fp8_dir, drop="model.layers.0.mlp.down_proj.weight_scale_inv")
    with pytest.raises(CheckpointError, match="'model.layers.0.mlp.down_proj.weight' has no "
                                              "weight_scale_inv"):
        make_runner(fp8_dir)
    _edit(fp8_dir, change_config=lambda c: c["quantization_config"].update(quant_method="awq"))
    with pytest.raises(UnsupportedFeatureError, match="quant_method='awq' is not supported"):
        make_runner(fp8_dir)
    _edit(fp8_dir, change_config=lambda c: c["quantization_config"].update(
        quant_method="fp8", weight_block_size=[128]))
    with pytest.raises(CheckpointError, match="block size"):
        make_runner(fp8_dir)
