"""Tiny random HF checkpoints (with a real tokenizer) for tests, plus a hand scheduler.

``make_tiny_checkpoint(family, path)`` writes a transformers model of the family
("llama", "qwen2", "qwen3", "gemma3", "qwen3_moe", "gpt_oss", "deepseek_v3",
"deepseek_v2", "qwen3_5", "qwen3_5_moe", "qwen3_next") with random weights, a byte-level BPE
tokenizer trained on a fixed corpus, a chat template and a generation config.
Each (family, overrides) is built once per process and copied afterwards.
``add_mtp_layer(path)`` copies a Qwen3.5 or DeepSeek-V3 one and adds the multi-token-prediction
tensors that the released checkpoints ship (``mtp.*``; DeepSeek-V3's ``model.layers.{L}.*``).

``PlanDriver`` plays the scheduler for a ``ModelRunner``: it hands out blocks and
builds StepPlans (new requests, per-step diffs, chunked prefill, preemption).
"""

from __future__ import annotations

import json
import os
import random
import shutil
import tempfile
from dataclasses import dataclass, field
from typing import Optional

VOCAB_SIZE = 512
SPECIAL_TOKENS = ["<pad>", "<eos>", "<bos>", "<unk>", "<|system|>", "<|user|>",
                  "<|assistant|>", "<|end|>", "<think>", "</think>", "<tool_call>", "</tool_call>"]
PAD_ID, EOS_ID, BOS_ID, END_OF_TURN_ID = 0, 1, 2, 7
THINK_ID, END_THINK_ID, TOOL_CALL_ID, END_TOOL_CALL_ID = 8, 9, 10, 11
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}")

CORPUS = """\
The quick brown fox jumps over the lazy dog while a small cat watches from the warm window.
Engines that serve language models batch many requests together, page their key value caches
in fixed blocks, and sample one token per running sequence at every step of the loop.
A scheduler decides which prompts to prefill and which sequences to decode; when memory runs
short it preempts the newest request and recomputes it later, never corrupting another one.
Hello world! Numbers like 0 1 2 3 4 5 6 7 8 9 10 42 100 2024 and 3.14159 appear in text too.
She sells sea shells by the sea shore; Peter Piper picked a peck of pickled peppers.
Paris is the capital of France, Berlin of Germany, Rome of Italy and Madrid of Spain.
def main():\n    print("hello, world")\n    return 0\n
{"name": "tool", "arguments": {"city": "Tokyo", "unit": "celsius"}} <think>why?</think>
Rain falls softly on quiet streets; bright lights blink, travellers hurry, trains depart.
Mathematics, physics, chemistry and biology explain patterns found throughout nature.
"""

_GDN = dict(linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
            linear_value_head_dim=16, linear_conv_kernel_dim=4,
            rope_parameters={"rope_type": "default", "rope_theta": 1e4,
                             "partial_rotary_factor": 0.25})

FAMILY_CONFIGS: dict[str, dict] = {
    "llama": dict(architectures=["LlamaForCausalLM"], num_hidden_layers=2,
                  rope_scaling={"rope_type": "llama3", "factor": 4.0, "low_freq_factor": 1.0,
                                "high_freq_factor": 4.0, "original_max_position_embeddings": 64},
                  rope_theta=10000.0, tie_word_embeddings=False),
    "qwen2": dict(architectures=["Qwen2ForCausalLM"], num_hidden_layers=2, rope_theta=1e6,
                  tie_word_embeddings=True),
    "qwen3": dict(architectures=["Qwen3ForCausalLM"], num_hidden_layers=2, head_dim=32,
                  rope_theta=1e6, tie_word_embeddings=False),
    # 8 experts, 2 per token, renormalised; layer 1 keeps a dense MLP (mlp_only_layers)
    "qwen3_moe": dict(architectures=["Qwen3MoeForCausalLM"], num_hidden_layers=3, head_dim=32,
                      rope_theta=1e6, tie_word_embeddings=False, num_experts=8,
                      num_experts_per_tok=2, moe_intermediate_size=64, norm_topk_prob=True,
                      mlp_only_layers=[1]),
    # gpt-oss: sliding (window 8, shorter than the test prompts) and full layers alternating,
    # 8 biased experts with 2 per token, YaRN rope; swiglu_limit low enough that the clamp
    # cuts some gate/up values (the random init rarely reaches the released 7.0).
    "gpt_oss": dict(architectures=["GptOssForCausalLM"], num_hidden_layers=3, head_dim=16,
                    layer_types=["sliding_attention", "full_attention", "sliding_attention"],
                    sliding_window=8, num_local_experts=8, num_experts_per_tok=2,
                    intermediate_size=48, swiglu_limit=1.0, tie_word_embeddings=False,
                    rope_parameters={"rope_type": "yarn", "factor": 8.0, "beta_fast": 32.0,
                                     "beta_slow": 1.0, "truncate": False, "rope_theta": 1e4,
                                     "original_max_position_embeddings": 16}),
    # MLA with a q LoRA, yarn rope (softmax scale x mscale^2), rope dims interleaved; layer 0
    # dense (first_k_dense_replace), layers 1-2 route 8 experts in 4 groups (2 groups kept,
    # sigmoid + correction bias, top-2 renormalised, scaled 2.5) plus one shared expert.
    # (R = 32, P = 16: widths the Triton MLA decode takes.)
    "deepseek_v3": dict(architectures=["DeepseekV3ForCausalLM"], num_hidden_layers=3,
                        head_dim=16, num_key_value_heads=4, q_lora_rank=48, kv_lora_rank=32,
                        qk_nope_head_dim=16, qk_rope_head_dim=16, v_head_dim=20,
                        n_routed_experts=8, num_experts_per_tok=2, n_group=4, topk_group=2,
                        n_shared_experts=1, moe_intermediate_size=32, first_k_dense_replace=1,
                        routed_scaling_factor=2.5, norm_topk_prob=True, rope_interleave=True,
                        rope_scaling={"rope_type": "yarn", "factor": 4.0,
                                      "original_max_position_embeddings": 128,
                                      "mscale": 1.0, "mscale_all_dim": 0.8,
                                      "beta_fast": 32, "beta_slow": 1},
                        rope_theta=10000.0, tie_word_embeddings=False),
    # MLA without a q LoRA (as V2-Lite); softmax greedy top-2 of 8, two shared experts.
    "deepseek_v2": dict(architectures=["DeepseekV2ForCausalLM"], num_hidden_layers=3, head_dim=8,
                        num_key_value_heads=4, q_lora_rank=None, kv_lora_rank=24,
                        qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=20,
                        n_routed_experts=8, num_experts_per_tok=2, topk_method="greedy",
                        n_shared_experts=2, moe_intermediate_size=32, first_k_dense_replace=1,
                        routed_scaling_factor=1.5, rope_theta=10000.0,
                        tie_word_embeddings=False),
    # Hybrid Gated DeltaNet: linear attention (2 q/k heads of 16, 4 value heads of 16, conv
    # kernel 4) with gated full attention every fourth layer (every second in the MoE
    # one), a quarter of each 32-wide head rotated. Qwen3.5-MoE: 8 experts, top 2, a shared
    # expert; Qwen3-Next: its interleaved in_proj_qkvz / in_proj_ba, every layer routed.
    "qwen3_5": dict(architectures=["Qwen3_5ForCausalLM"], num_hidden_layers=4, head_dim=32,
                    layer_types=["linear_attention"] * 3 + ["full_attention"],
                    **_GDN, tie_word_embeddings=False),
    "qwen3_5_moe": dict(architectures=["Qwen3_5MoeForCausalLM"], num_hidden_layers=4,
                        head_dim=32, layer_types=["linear_attention", "full_attention"] * 2,
                        **_GDN, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                        shared_expert_intermediate_size=48, tie_word_embeddings=False),
    "qwen3_next": dict(architectures=["Qwen3NextForCausalLM"], num_hidden_layers=4, head_dim=32,
                       **_GDN, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                       shared_expert_intermediate_size=48, norm_topk_prob=True,
                       tie_word_embeddings=False),
    # Two sliding layers (window 8) and one global layer, with Gemma's own scalars.
    "gemma3": dict(architectures=["Gemma3ForCausalLM"], num_hidden_layers=3,
                   layer_types=["sliding_attention", "sliding_attention", "full_attention"],
                   sliding_window=8, query_pre_attn_scalar=24, rope_theta=1e6,
                   rope_local_base_freq=1e4, tie_word_embeddings=True),
}
COMMON = dict(vocab_size=VOCAB_SIZE, hidden_size=64, intermediate_size=128, num_attention_heads=4,
              num_key_value_heads=2, head_dim=16, max_position_embeddings=512, rms_norm_eps=1e-6,
              bos_token_id=BOS_ID, eos_token_id=EOS_ID, pad_token_id=PAD_ID)

_built: dict[str, str] = {}
_cache_root: Optional[str] = None


def make_tiny_checkpoint(family: str, path: Optional[str] = None,
                         overrides: Optional[dict] = None) -> str:
    """Write the tiny checkpoint of ``family`` into ``path`` (a fresh temp dir if None)."""
    global _cache_root
    if family not in FAMILY_CONFIGS:
        raise ValueError(f"unknown family {family!r}; choose from {sorted(FAMILY_CONFIGS)}")
    key = family + json.dumps(overrides or {}, sort_keys=True)
    if key not in _built:
        if _cache_root is None:
            _cache_root = tempfile.mkdtemp(prefix="pocketllm-tiny-")
        built = os.path.join(_cache_root, f"{family}-{len(_built)}")
        _build(family, built, overrides or {})
        _built[key] = built
    if path is None:
        return _built[key]
    shutil.copytree(_built[key], path, dirs_exist_ok=True)
    return str(path)


def gpt_oss_clamp_from_config() -> bool:
    """Whether this transformers' gpt-oss reads its SwiGLU clamp from the config (5.2x
    does: ``swiglu_alpha``, ``swiglu_limit``); 5.17 and older hard-code alpha 1.702 and
    limit 7.0, the released checkpoints' values, so a tiny checkpoint keeps those there."""
    from transformers import GptOssConfig

    return hasattr(GptOssConfig(), "swiglu_alpha")


def _build(family: str, path: str, overrides: dict) -> None:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg_dict = {**COMMON, **FAMILY_CONFIGS[family], **overrides}
    if family == "gpt_oss" and not gpt_oss_clamp_from_config():
        cfg_dict.pop("swiglu_limit")  # the reference would clamp at 7.0 whatever it says
    model_type = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "gemma3": "gemma3_text",
                  "qwen3_moe": "qwen3_moe", "gpt_oss": "gpt_oss", "deepseek_v3": "deepseek_v3",
                  "deepseek_v2": "deepseek_v2", "qwen3_5": "qwen3_5_text",
                  "qwen3_5_moe": "qwen3_5_moe_text", "qwen3_next": "qwen3_next"}
    config = AutoConfig.for_model(model_type[family], **cfg_dict)
    torch.manual_seed(1234)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        # Larger than HF's init so the tiny model has confident (tie-free) greedy choices,
        # and non-trivial norm weights so (1 + w) handling is exercised.
        for name, param in sorted(model.named_parameters()):
            if name.endswith(".sinks"):  # HF draws them at std 0.02: make them matter
                param.normal_(0.0, 1.0)
            elif "norm" in name:
                param.normal_(0.0, 0.1)
                if family != "gemma3":
                    param.add_(1.0)
            elif "embed" in name and config.tie_word_embeddings:
                param.normal_(0.0, 0.03)  # else the tied head mostly echoes the last token
            else:
                param.normal_(0.0, 0.15)
        for name, buf in model.named_buffers():
            if name.endswith("e_score_correction_bias"):  # DeepSeek-V3: a bias that matters
                buf.normal_(0.0, 0.3)
    model.save_pretrained(path, safe_serialization=True)
    _write_tokenizer(path)
    with open(os.path.join(path, "generation_config.json"), "w") as f:
        json.dump({"bos_token_id": BOS_ID, "eos_token_id": [EOS_ID, END_OF_TURN_ID],
                   "pad_token_id": PAD_ID}, f)


def _write_tokenizer(path: str) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB_SIZE, special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator([CORPUS], trainer)
    tok.post_processor = processors.TemplateProcessing(
        single="<bos> $A", pair="<bos> $A <bos> $B", special_tokens=[("<bos>", BOS_ID)])
    tok.save(os.path.join(path, "tokenizer.json"))
    with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
        json.dump({"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<bos>",
                   "eos_token": "<eos>", "pad_token": "<pad>", "unk_token": "<unk>",
                   "chat_template": CHAT_TEMPLATE, "model_max_length": 512}, f)


_mtp_built: dict[tuple[str, int], str] = {}
MTP_FILE = "model-mtp.safetensors"


def add_mtp_layer(path: str, seed: int = 0) -> str:
    """A copy of the Qwen3.5 (``qwen3_5``, ``qwen3_5_moe``) or DeepSeek-V3 checkpoint at
    ``path`` with the multi-token-prediction tensors the released checkpoints ship, random;
    ``path`` itself is left alone. Built once per (path, seed); the copy returned is shared,
    so don't write to it. The tensors go into a file of their own (and the index, if any).

    Qwen3.5: ``mtp.fc.weight`` [H, 2H] (over cat(embedding, hidden), the embedding first),
    the norms ``mtp.pre_fc_norm_embedding``, ``mtp.pre_fc_norm_hidden`` and ``mtp.norm``, and
    ``mtp.layers.0.*``: the names and shapes of the checkpoint's own first full-attention
    layer, drawn afresh; config.json gets ``mtp_num_hidden_layers: 1``.

    DeepSeek-V3: one layer past the last, ``model.layers.{L}.*`` (L = num_hidden_layers):
    ``eh_proj.weight`` [H, 2H] (over cat(enorm(embedding), hnorm(hidden)), the embedding
    first), the norms ``enorm``, ``hnorm`` and ``shared_head.norm``, the decoder layer's
    tensors (the names and shapes of the checkpoint's last layer, a MoE one, drawn afresh),
    and ``embed_tokens.weight`` / ``shared_head.head.weight``: exact copies of the model's
    embedding and lm_head, as released; config.json gets ``num_nextn_predict_layers: 1``.
    """
    global _cache_root
    import torch
    from safetensors import safe_open
    from safetensors.torch import save_file

    key = (os.path.abspath(path), seed)
    if key in _mtp_built:
        return _mtp_built[key]
    with open(os.path.join(path, "config.json")) as f:
        config = json.load(f)
    text = config.get("text_config", config)
    deepseek = text.get("model_type") == "deepseek_v3"
    if deepseek:
        mtp_prefix = f"model.layers.{text['num_hidden_layers']}."
        prefix = f"model.layers.{text['num_hidden_layers'] - 1}."  # the last layer: MoE
    elif str(text.get("model_type", "")).startswith("qwen3_5"):
        full = text["layer_types"].index("full_attention")
        prefix = f"model.layers.{full}."  # the text-only models' names (no "language_model")
    else:
        raise ValueError(f"{path!r} is a {text.get('model_type')!r} checkpoint, "
                         "not Qwen3.5 or DeepSeek-V3")

    index_path = os.path.join(path, "model.safetensors.index.json")
    if os.path.isfile(index_path):
        with open(index_path) as f:
            files = sorted(set(json.load(f)["weight_map"].values()))
    else:
        files = sorted(n for n in os.listdir(path) if n.endswith(".safetensors"))
    shapes: dict[str, list[int]] = {}
    copies = {}  # DeepSeek-V3's MTP embedding and head: the main model's, duplicated
    dtype = None
    for name in files:
        with safe_open(os.path.join(path, name), framework="pt") as handle:
            for tensor in handle.keys():
                if tensor.startswith(prefix):
                    shapes[tensor[len(prefix):]] = handle.get_slice(tensor).get_shape()
                if tensor == "model.norm.weight":
                    dtype = handle.get_tensor(tensor).dtype
                if deepseek and tensor in ("model.embed_tokens.weight", "lm_head.weight"):
                    copies[tensor] = handle.get_tensor(tensor)
    if not shapes or dtype is None:
        raise ValueError(f"{path!r} holds no {prefix}* or model.norm.weight tensors")
    if deepseek and len(copies) != 2:
        raise ValueError(f"{path!r} holds no model.embed_tokens.weight or lm_head.weight "
                         "(a tied one?)")

    hidden = text["hidden_size"]
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    if deepseek:
        shapes = {"eh_proj.weight": [hidden, 2 * hidden],
                  **{f"{n}.weight": [hidden] for n in ("enorm", "hnorm", "shared_head.norm")},
                  **shapes}
        for name, shape in sorted(shapes.items()):
            # As _build draws them: DeepSeek's norms are plain w, so around 1; the router's
            # correction bias large enough to change the choice of experts.
            draw = torch.randn(shape, generator=gen)
            if name.endswith("norm.weight"):
                draw = 1.0 + 0.1 * draw
            else:
                draw = draw * (0.3 if name.endswith("e_score_correction_bias") else 0.15)
            tensors[mtp_prefix + name] = draw.to(dtype).contiguous()
        tensors[mtp_prefix + "embed_tokens.weight"] = copies["model.embed_tokens.weight"]
        tensors[mtp_prefix + "shared_head.head.weight"] = copies["lm_head.weight"]
    else:
        shapes = {"mtp.fc.weight": [hidden, 2 * hidden],
                  **{f"mtp.{n}.weight": [hidden]
                     for n in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm")},
                  **{"mtp.layers.0." + n: shape for n, shape in shapes.items()}}
        for name, shape in sorted(shapes.items()):
            # Matrices at _build's scale; norms around 0, where Qwen3.5's (1 + w) norms start
            # (_build's sit around 1), so a norm read as plain w, not 1 + w, shows at once.
            std = 0.1 if name.endswith("norm.weight") else 0.15
            tensors[name] = (torch.randn(shape, generator=gen) * std).to(dtype).contiguous()

    if _cache_root is None:
        _cache_root = tempfile.mkdtemp(prefix="pocketllm-tiny-")
    out = os.path.join(_cache_root, f"mtp-{len(_mtp_built)}")
    shutil.copytree(path, out)
    save_file(tensors, os.path.join(out, MTP_FILE), metadata={"format": "pt"})
    if os.path.isfile(index_path):
        with open(index_path) as f:
            index = json.load(f)
        index["weight_map"].update({name: MTP_FILE for name in tensors})
        meta = index.get("metadata", {})
        if "total_size" in meta:
            meta["total_size"] += sum(t.numel() * t.element_size() for t in tensors.values())
        if "total_parameters" in meta:
            meta["total_parameters"] += sum(t.numel() for t in tensors.values())
        with open(os.path.join(out, "model.safetensors.index.json"), "w") as f:
            json.dump(index, f, indent=2)
    if deepseek:
        config["num_nextn_predict_layers"] = 1
    else:
        config["mtp_num_hidden_layers"] = 1
        if "text_config" in config:
            config["text_config"]["mtp_num_hidden_layers"] = 1
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    _mtp_built[key] = out
    return out


# ---------------------------------------------------------------------- a hand scheduler


def tables(runner, block_ids: list[int], slot: int = 0) -> list[list[int]]:
    """The same block ids in every KV cache group's table (a plan built by hand); a state
    group's table is the one ``slot``."""
    return [[slot] if state else list(block_ids) for state in _state_groups(runner)]


def _num_blocks(runner) -> list[int]:
    """Each cache group's pool size (the torch worker's ``kv``, the torch-free one's own)."""
    return getattr(runner, "kv", runner).num_blocks


def _state_groups(runner) -> list[bool]:
    return list(getattr(runner, "state_groups", None) or [False] * len(_num_blocks(runner)))


def run_step(runner, plan):
    """One step through the worker's own entry point: launch it, then wait for its tokens."""
    return runner.finish(runner.launch(plan))


@dataclass
class _Req:
    tokens: list[int]
    spec: object
    max_new: int
    computed: int = 0
    blocks: list[int] = field(default_factory=list)
    slot: Optional[int] = None  # its recurrent-state slot (models with a state group)
    sent_tokens: int = 0  # how many tokens the runner holds
    sent_blocks: int = 0
    known: bool = False  # the runner holds its state
    generated: list[int] = field(default_factory=list)
    logprobs: list = field(default_factory=list)


class PlanDriver:
    """Drives a ModelRunner with StepPlans, as a minimal scheduler would."""

    def __init__(self, runner, chunk: Optional[int] = None, shuffle_blocks: Optional[int] = None):
        self.runner, self.chunk, self.step = runner, chunk, 0
        # The same block ids in every KV cache group's pool (each at least this large); a
        # state group's slots apart, one per request.
        self.state = _state_groups(runner)
        counts = _num_blocks(runner)
        self.free = list(range(min(n for n, s in zip(counts, self.state) if not s)))
        self.free_slots = list(range(min((n for n, s in zip(counts, self.state) if s),
                                         default=0)))
        if shuffle_blocks is not None:
            random.Random(shuffle_blocks).shuffle(self.free)
        self.reqs: dict[str, _Req] = {}
        self.finished: list[str] = []

    def add(self, rid: str, prompt: list[int], spec, max_new: int) -> None:
        self.reqs[rid] = _Req(list(prompt), spec, max_new)

    def preempt(self, rid: str) -> None:
        """Drop the request's KV; it comes back as a new request with all its tokens."""
        req = self.reqs[rid]
        self._release(req)
        req.blocks, req.computed, req.known, req.sent_blocks = [], 0, False, 0
        self.finished.append(rid)

    def step_once(self, only: Optional[list[str]] = None):
        from pocketllm.proto.messages import CachedRequestData, NewRequestData, StepPlan

        bs = self.runner.block_size
        plan = StepPlan(step_id=self.step, finished_request_ids=self.finished)
        self.finished = []
        scheduled: list[tuple[str, int]] = []
        new, cached, n_new, n_cached = [], [], [], []
        for rid, req in self.reqs.items():
            if len(req.generated) >= req.max_new or (only is not None and rid not in only):
                continue
            n = len(req.tokens) - req.computed
            if self.chunk:
                n = min(n, self.chunk)
            while len(req.blocks) * bs < req.computed + n:
                req.blocks.append(self.free.pop(0))
            if req.slot is None and any(self.state):
                req.slot = self.free_slots.pop(0)
            if not req.known:
                new.append(NewRequestData(rid, list(req.tokens), self._tables(req.blocks, req.slot),
                                          req.computed, req.spec))
                n_new.append(n)
                req.known = True
            else:
                cached.append(CachedRequestData(rid, req.tokens[req.sent_tokens:],
                                                self._tables(req.blocks[req.sent_blocks:]),
                                                req.computed))
                n_cached.append(n)
            req.sent_tokens, req.sent_blocks = len(req.tokens), len(req.blocks)
            scheduled.append((rid, n))
        plan.new_requests, plan.cached_requests = new, cached
        plan.num_scheduled_tokens = n_new + n_cached
        result = run_step(self.runner, plan)
        assert result.error is None, result.error
        for rid, n in scheduled:
            self.reqs[rid].computed += n
        for rid, token, lp in zip(result.request_ids, result.token_ids, result.logprobs):
            req = self.reqs[rid]
            req.tokens.append(token)
            req.generated.append(token)
            req.logprobs.append(lp)
            if len(req.generated) >= req.max_new:
                self._release(req)
                self.finished.append(rid)
        self.step += 1
        return result

    def _tables(self, blocks: list[int], slot: Optional[int] = None) -> list[list[int]]:
        """Per group: the blocks, or a state group's slot (new requests) / nothing."""
        return [([] if slot is None else [slot]) if state else list(blocks)
                for state in self.state]

    def _release(self, req: _Req) -> None:
        self.free.extend(req.blocks)
        if req.slot is not None:
            self.free_slots.append(req.slot)
            req.slot = None

    def run(self) -> dict[str, list[int]]:
        while any(len(r.generated) < r.max_new for r in self.reqs.values()):
            self.step_once()
        return {rid: r.generated for rid, r in self.reqs.items()}
