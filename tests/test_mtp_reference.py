"""Qwen3.5's multi-token-prediction (MTP) layer, computed from transformers' own pieces.

transformers loads a Qwen3.5 checkpoint without its ``mtp.*`` tensors, so ``hf_mtp_logits``
assembles the MTP head from transformers' classes (its RMSNorm, decoder layer, rotary
embedding, and the model's embedding and lm_head) and no PocketLLM code: the reference
PocketLLM's MTP is checked against. The tests here check the reference itself: its shape,
its causality, and that its layer loading agrees with transformers' own.
"""

from __future__ import annotations

import copy
import importlib
import json
import os
import random

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from tiny_checkpoints import VOCAB_SIZE, add_mtp_layer, make_tiny_checkpoint  # noqa: E402

PROMPT = [random.Random(11).randrange(3, VOCAB_SIZE) for _ in range(12)]


def _modeling(config):
    """transformers' modeling module and class prefix of the (text) config's family."""
    family = config.model_type.removesuffix("_text")  # qwen3_5_text -> qwen3_5
    if family not in ("qwen3_5", "qwen3_5_moe"):
        raise ValueError(f"no MTP reference for {config.model_type!r}")
    module = importlib.import_module(f"transformers.models.{family}.modeling_{family}")
    return module, {"qwen3_5": "Qwen3_5", "qwen3_5_moe": "Qwen3_5Moe"}[family]


def _checkpoint_tensors(path: str, prefix: str) -> dict[str, "torch.Tensor"]:
    """Every tensor of the checkpoint whose name starts with ``prefix``, prefix dropped."""
    from safetensors.torch import load_file

    files = [n for n in os.listdir(path) if n.endswith(".safetensors")]
    out = {}
    for name in sorted(files):
        for key, value in load_file(os.path.join(path, name)).items():
            if key.startswith(prefix):
                out[key[len(prefix):]] = value.float()
    return out


def layer_state_dict(tensors: dict[str, "torch.Tensor"]) -> dict[str, "torch.Tensor"]:
    """A decoder layer's checkpoint tensors as its module's state dict: the per-expert
    gate/up/down of a MoE layer stacked into the fused [E, 2I, H] / [E, H, I] parameters,
    as transformers' own conversion (MergeModulelist, then gate and up concatenated) does."""
    out = {k: v for k, v in tensors.items() if not k.startswith("mlp.experts.")}
    experts = sorted({int(k.split(".")[2]) for k in tensors if k.startswith("mlp.experts.")})
    if experts:
        assert experts == list(range(len(experts)))

        def stack(proj):
            return torch.stack([tensors[f"mlp.experts.{e}.{proj}.weight"] for e in experts])

        out["mlp.experts.gate_up_proj"] = torch.cat([stack("gate_proj"), stack("up_proj")], 1)
        out["mlp.experts.down_proj"] = stack("down_proj")
    return out


def mtp_decoder_layer(config, tensors: dict[str, "torch.Tensor"]):
    """transformers' decoder layer, built as a full-attention one, holding ``tensors``."""
    module, cls = _modeling(config)
    layer_config = copy.deepcopy(config)
    layer_config.layer_types = ["full_attention"] * config.num_hidden_layers
    layer_config._attn_implementation = "eager"  # the explicit additive mask below
    layer = getattr(module, f"{cls}DecoderLayer")(layer_config, layer_idx=0).float().eval()
    layer.load_state_dict(layer_state_dict(tensors), strict=True)
    assert layer.block_type == "full_attention"
    return layer


def hf_mtp_logits(path: str, token_ids) -> "torch.Tensor":
    """The MTP head's logits [T-1, vocab] for ``token_ids`` (T of them), float32: row t
    takes the main model's final (normed) hidden state at t and token t+1, at position t,
    and predicts token t+2.

    x_t = fc(cat(pre_fc_norm_embedding(embed(token_{t+1})), pre_fc_norm_hidden(h_t)));
    one causal full-attention decoder layer over x_0..x_{T-2}; logits = lm_head(norm(.)).
    """
    model = transformers.AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, attn_implementation="eager").eval()
    config = model.config
    module, cls = _modeling(config)
    ids = torch.as_tensor(token_ids, dtype=torch.long).reshape(1, -1)
    n = ids.shape[1] - 1
    if n < 1:
        raise ValueError("the MTP head needs at least two tokens")
    mtp = _checkpoint_tensors(path, "mtp.")
    hidden = config.hidden_size

    def norm(name):
        rms = getattr(module, f"{cls}RMSNorm")(hidden, eps=config.rms_norm_eps)
        rms.load_state_dict({"weight": mtp[f"{name}.weight"]})
        return rms

    fc = torch.nn.Linear(2 * hidden, hidden, bias=False)
    fc.load_state_dict({"weight": mtp["fc.weight"]})
    layer = mtp_decoder_layer(config, {k[len("layers.0."):]: v for k, v in mtp.items()
                                       if k.startswith("layers.0.")})

    with torch.no_grad():
        out = model(ids, output_hidden_states=True)
        h = out.hidden_states[-1]
        # transformers 5.x hands back the last hidden state after the final norm (the
        # state MTP takes); lm_head over it giving the model's logits proves it.
        assert torch.allclose(model.lm_head(h), out.logits, atol=1e-5), \
            "hidden_states[-1] is not the final normed state in this transformers"
        x = fc(torch.cat([norm("pre_fc_norm_embedding")(model.get_input_embeddings()(ids[:, 1:])),
                          norm("pre_fc_norm_hidden")(h[:, :-1])], dim=-1))
        positions = torch.arange(n).unsqueeze(0)  # x_t sits at h_t's position, t
        cos_sin = model.model.rotary_emb(x, positions)
        # Eager attention adds the mask to the scores: 0 on and below the diagonal.
        mask = torch.full((n, n), torch.finfo(torch.float32).min).triu(1)[None, None]
        y = layer(x, position_embeddings=cos_sin, attention_mask=mask, position_ids=positions)
        return model.lm_head(norm("norm")(y))[0]


@pytest.fixture(scope="module")
def qwen3_5_mtp():
    return add_mtp_layer(make_tiny_checkpoint("qwen3_5"))


def test_the_reference_is_deterministic_and_shaped(qwen3_5_mtp):
    with open(os.path.join(qwen3_5_mtp, "config.json")) as f:
        assert json.load(f)["mtp_num_hidden_layers"] == 1
    logits = hf_mtp_logits(qwen3_5_mtp, PROMPT)
    assert logits.shape == (len(PROMPT) - 1, VOCAB_SIZE) and logits.dtype == torch.float32
    assert torch.isfinite(logits).all()
    assert torch.equal(logits, hf_mtp_logits(qwen3_5_mtp, PROMPT))
    assert len(set(logits.argmax(-1).tolist())) > 3, "a degenerate reference would prove little"
    # Causal: a different last token changes only the last row (its x), not earlier ones.
    changed = hf_mtp_logits(qwen3_5_mtp, PROMPT[:-1] + [(PROMPT[-1] + 1) % VOCAB_SIZE])
    assert torch.allclose(changed[:-1], logits[:-1], atol=1e-5)
    assert not torch.allclose(changed[-1], logits[-1], atol=1e-3)
    # Another draw of the MTP tensors gives other logits: they are read, not ignored.
    other = hf_mtp_logits(add_mtp_layer(make_tiny_checkpoint("qwen3_5"), seed=1), PROMPT)
    assert not torch.allclose(other, logits, atol=1e-3)


@pytest.mark.parametrize("family", ["qwen3_5", "qwen3_5_moe"])
def test_the_layer_loading_matches_transformers_own(family):
    """The reference's loading of a full-attention layer (the MoE's experts stacked by
    hand) holds what transformers' from_pretrained put into the model's own layer."""
    path = make_tiny_checkpoint(family)
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    k = model.config.layer_types.index("full_attention")
    layer = mtp_decoder_layer(model.config, _checkpoint_tensors(path, f"model.layers.{k}."))
    theirs = model.model.layers[k].state_dict()
    assert sorted(layer.state_dict()) == sorted(theirs)
    for name, value in layer.state_dict().items():
        assert torch.equal(value, theirs[name]), name
    # and the MTP tensors written for this family load into that layer, names and shapes
    assert mtp_decoder_layer(model.config, _checkpoint_tensors(add_mtp_layer(path),
                                                               "mtp.layers.0."))
