"""Qwen3.5's and DeepSeek-V3's multi-token-prediction (MTP) layer, computed from
transformers' own pieces.

transformers loads a Qwen3.5 checkpoint without its ``mtp.*`` tensors (a DeepSeek-V3 one
without its extra ``model.layers.{L}.*`` layer), so ``hf_mtp_logits`` assembles the MTP head
from transformers' classes (its RMSNorm, decoder layer, rotary embedding, and the embedding
and head) and no PocketLLM code: the reference PocketLLM's MTP is checked against. The
tests here check the reference itself: its shape, its causality, and that its layer loading
(and, for DeepSeek-V3, its result) agrees with transformers' own.
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

_rng = random.Random(11)  # one generator: a fresh one per token repeats a single token
PROMPT = [_rng.randrange(3, VOCAB_SIZE) for _ in range(12)]


def _modeling(config):
    """transformers' modeling module and class prefix of the (text) config's family."""
    family = config.model_type.removesuffix("_text")  # qwen3_5_text -> qwen3_5
    prefixes = {"qwen3_5": "Qwen3_5", "qwen3_5_moe": "Qwen3_5Moe", "deepseek_v3": "DeepseekV3"}
    if family not in prefixes:
        raise ValueError(f"no MTP reference for {config.model_type!r}")
    module = importlib.import_module(f"transformers.models.{family}.modeling_{family}")
    return module, prefixes[family]


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
    as transformers' own conversion (MergeModulelist, then gate and up concatenated) does;
    Qwen3.5-MoE and DeepSeek-V3 alike (both map to its "qwen2_moe" pattern)."""
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
    """transformers' decoder layer, built as a full-attention one (Qwen3.5) or as layer L
    (DeepSeek-V3's MTP layer index: past first_k_dense_replace, so a MoE one), holding
    ``tensors``."""
    module, cls = _modeling(config)
    layer_config = copy.deepcopy(config)
    layer_config._attn_implementation = "eager"  # the explicit additive mask below
    if cls == "DeepseekV3":
        # transformers picks MoE or dense MLP by layer_idx >= first_k_dense_replace
        layer = module.DeepseekV3DecoderLayer(layer_config, layer_idx=config.num_hidden_layers)
        assert isinstance(layer.mlp, module.DeepseekV3MoE)
    else:
        layer_config.layer_types = ["full_attention"] * config.num_hidden_layers
        layer = getattr(module, f"{cls}DecoderLayer")(layer_config, layer_idx=0)
        assert layer.block_type == "full_attention"
    layer = layer.float().eval()
    layer.load_state_dict(layer_state_dict(tensors), strict=True)
    return layer


def _mtp_parts(path: str, model):
    """The checkpoint's MTP tensors by role: (fc, embedding norm, hidden norm, final norm)
    names, the decoder layer's tensors, the embedding and the head (callables)."""
    config = model.config
    if config.model_type == "deepseek_v3":
        mtp = _checkpoint_tensors(path, f"model.layers.{config.num_hidden_layers}.")
        layer = {k: v for k, v in mtp.items() if k.split(".")[0] in
                 ("input_layernorm", "post_attention_layernorm", "self_attn", "mlp")}
        # the MTP module's own embedding and head (copies of the main model's)
        embed = torch.nn.Embedding.from_pretrained(mtp["embed_tokens.weight"])
        head = torch.nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        head.load_state_dict({"weight": mtp["shared_head.head.weight"]})
        return mtp, ("eh_proj", "enorm", "hnorm", "shared_head.norm"), layer, embed, head
    mtp = _checkpoint_tensors(path, "mtp.")
    layer = {k[len("layers.0."):]: v for k, v in mtp.items() if k.startswith("layers.0.")}
    return (mtp, ("fc", "pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"), layer,
            model.get_input_embeddings(), model.lm_head)


def hf_mtp_logits(path: str, token_ids) -> "torch.Tensor":
    """The MTP head's logits [T-1, vocab] for ``token_ids`` (T of them), float32: row t
    takes the main model's final (normed) hidden state at t and token t+1, at position t,
    and predicts token t+2.

    x_t = fc(cat(pre_fc_norm_embedding(embed(token_{t+1})), pre_fc_norm_hidden(h_t)));
    one causal full-attention decoder layer over x_0..x_{T-2}; logits = lm_head(norm(.)).
    DeepSeek-V3 (layer L = num_hidden_layers): eh_proj, enorm, hnorm, a MoE decoder layer,
    shared_head.norm, and its own embed_tokens / shared_head.head (the main model's, copied).
    """
    model = transformers.AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, attn_implementation="eager").eval()
    config = model.config
    module, cls = _modeling(config)
    ids = torch.as_tensor(token_ids, dtype=torch.long).reshape(1, -1)
    n = ids.shape[1] - 1
    if n < 1:
        raise ValueError("the MTP head needs at least two tokens")
    mtp, (fc_name, embedding_norm, hidden_norm, final_norm), layer_tensors, embed, head = \
        _mtp_parts(path, model)
    hidden = config.hidden_size

    def norm(name):
        rms = getattr(module, f"{cls}RMSNorm")(hidden, eps=config.rms_norm_eps)
        rms.load_state_dict({"weight": mtp[f"{name}.weight"]})
        return rms

    fc = torch.nn.Linear(2 * hidden, hidden, bias=False)
    fc.load_state_dict({"weight": mtp[f"{fc_name}.weight"]})
    layer = mtp_decoder_layer(config, layer_tensors)

    with torch.no_grad():
        out = model(ids, output_hidden_states=True)
        h = out.hidden_states[-1]
        # transformers 5.x hands back the last hidden state after the final norm (the
        # state MTP takes); lm_head over it giving the model's logits proves it.
        assert torch.allclose(model.lm_head(h), out.logits, atol=1e-5), \
            "hidden_states[-1] is not the final normed state in this transformers"
        x = fc(torch.cat([norm(embedding_norm)(embed(ids[:, 1:])), norm(hidden_norm)(h[:, :-1])],
                         dim=-1))
        positions = torch.arange(n).unsqueeze(0)  # x_t sits at h_t's position, t
        # (DeepSeek-V3: yarn's cos/sin scaling here, its softmax mscale in the layer, and
        # the interleaved rope dims the layer's own business: the raw weights go in as is)
        # (Qwen3.5's rotary takes a position stream per rope section; transformers before
        # 5.25 does not broadcast one to three)
        rotary = model.model.rotary_emb
        cos_sin = rotary(x, positions.expand(3, -1, -1) if hasattr(rotary, "mrope_section")
                         else positions)
        # Eager attention adds the mask to the scores: 0 on and below the diagonal.
        mask = torch.full((n, n), torch.finfo(torch.float32).min).triu(1)[None, None]
        y = layer(x, position_embeddings=cos_sin, attention_mask=mask, position_ids=positions)
        return head(norm(final_norm)(y))[0]


# config.json's MTP layer count (DeepSeek-V3's defaults to 1 in transformers' config anyway)
MTP_CONFIG_KEY = {"qwen3_5": "mtp_num_hidden_layers", "deepseek_v3": "num_nextn_predict_layers"}


@pytest.mark.parametrize("family", ["qwen3_5", "deepseek_v3"])
def test_the_reference_is_deterministic_and_shaped(family):
    path = add_mtp_layer(make_tiny_checkpoint(family))
    with open(os.path.join(path, "config.json")) as f:
        assert json.load(f)[MTP_CONFIG_KEY[family]] == 1
    logits = hf_mtp_logits(path, PROMPT)
    assert logits.shape == (len(PROMPT) - 1, VOCAB_SIZE) and logits.dtype == torch.float32
    assert torch.isfinite(logits).all()
    assert torch.equal(logits, hf_mtp_logits(path, PROMPT))
    assert len(set(logits.argmax(-1).tolist())) > 3, "a degenerate reference would prove little"
    # Causal: a different last token changes only the last row (its x), not earlier ones.
    changed = hf_mtp_logits(path, PROMPT[:-1] + [(PROMPT[-1] + 1) % VOCAB_SIZE])
    assert torch.allclose(changed[:-1], logits[:-1], atol=1e-5)
    assert not torch.allclose(changed[-1], logits[-1], atol=1e-3)
    # Another draw of the MTP tensors gives other logits: they are read, not ignored.
    other = hf_mtp_logits(add_mtp_layer(make_tiny_checkpoint(family), seed=1), PROMPT)
    assert not torch.allclose(other, logits, atol=1e-3)


@pytest.mark.parametrize("family", ["qwen3_5", "qwen3_5_moe", "deepseek_v3"])
def test_the_layer_loading_matches_transformers_own(family):
    """The reference's loading of a checkpoint layer (the MoE's experts stacked by hand)
    holds what transformers' from_pretrained put into the model's own layer: Qwen3.5's
    first full-attention layer, DeepSeek-V3's last (a MoE one, as its MTP layer is)."""
    path = make_tiny_checkpoint(family)
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    if family == "deepseek_v3":
        k = model.config.num_hidden_layers - 1
    else:
        k = model.config.layer_types.index("full_attention")
    layer = mtp_decoder_layer(model.config, _checkpoint_tensors(path, f"model.layers.{k}."))
    theirs = model.model.layers[k].state_dict()
    assert sorted(layer.state_dict()) == sorted(theirs)
    for name, value in layer.state_dict().items():
        assert torch.equal(value, theirs[name]), name
    # and the MTP tensors written for this family load into that layer, names and shapes
    mtp_path = add_mtp_layer(path)
    assert mtp_decoder_layer(model.config, _mtp_parts(mtp_path, model)[2])
    if family == "deepseek_v3":
        # the MTP layer's embedding and head: the main model's, copied exactly
        mtp = _checkpoint_tensors(mtp_path, f"model.layers.{model.config.num_hidden_layers}.")
        assert torch.equal(mtp["embed_tokens.weight"], model.get_input_embeddings().weight)
        assert torch.equal(mtp["shared_head.head.weight"], model.lm_head.weight)
        assert not torch.equal(mtp["shared_head.head.weight"], mtp["embed_tokens.weight"])
        # transformers loads the copy (extra layer and all) as it loads the original
        again = transformers.AutoModelForCausalLM.from_pretrained(mtp_path, dtype=torch.float32)
        assert len(again.model.layers) == model.config.num_hidden_layers
        mine = again.state_dict()
        assert sorted(mine) == sorted(model.state_dict())
        for name, value in model.state_dict().items():
            assert torch.equal(value, mine[name]), name


def test_the_deepseek_reference_matches_transformers_own_mtp_model():
    """transformers (5.2x) composes DeepSeek-V3's MTP layer itself (``MtpModel``, for its
    MTP drafting), reading layer L's tensors under other names: the reference agrees."""
    mtp_model_cls = getattr(importlib.import_module("transformers.modeling_layers"),
                            "MtpModel", None)
    if mtp_model_cls is None:
        pytest.skip("this transformers has no MtpModel")
    path = add_mtp_layer(make_tiny_checkpoint("deepseek_v3"))
    model = transformers.AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, attn_implementation="eager").eval()
    mtp, _, layer_tensors, _, _ = _mtp_parts(path, model)
    theirs = mtp_model_cls(model, 1).float().eval()  # its layer: MoE (first_k_dense_replace 0)
    state = {f"layers.0.mtp_block.{k}": v for k, v in layer_state_dict(layer_tensors).items()}
    state.update({f"layers.0.{b}.weight": mtp[f"{a}.weight"] for a, b in (
        ("enorm", "enorm"), ("hnorm", "hnorm"), ("eh_proj", "eh_proj"),
        ("shared_head.norm", "post_norm"))})
    missing, unexpected = theirs.load_state_dict(state, strict=False)
    assert not unexpected and sorted(missing) == ["embed_tokens.weight", "shared_head.weight"]
    ids = torch.as_tensor(PROMPT).reshape(1, -1)
    n = ids.shape[1] - 1
    with torch.no_grad():
        h = model(ids, output_hidden_states=True).hidden_states[-1]
        embeds = theirs.embed_tokens(ids[:, 1:])  # the main model's (shared)
        positions = torch.arange(n).unsqueeze(0)
        mask = torch.full((n, n), torch.finfo(torch.float32).min).triu(1)[None, None]
        y = theirs.layers[0](embeds, h[:, :-1], theirs.rotary_emb(embeds, positions), mask,
                             positions, None)
        expected = theirs._project_to_logits(y)[0]
    assert torch.allclose(hf_mtp_logits(path, PROMPT), expected, atol=1e-5)
