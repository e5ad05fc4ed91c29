"""Gemma 3's sliding-window layers keep only their window's KV (workers/kv_cache.py,
scheduler/kv_groups.py): the real scheduler drives the real worker in-process, on a tiny
random Gemma 3 (window 8, blocks of 4) and on the embedded model (window 512). A sequence
far longer than the window holds at most ceil(window / block_size) + 1 blocks in its
sliding group, and the tokens are those of one full-attention pool for every layer (the
behaviour before cache groups) and of transformers; also with prefix caching, chunked
prefill and preemption."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from pocketllm import EngineArgs  # noqa: E402
from pocketllm.model_info import load_model_info  # noqa: E402
from pocketllm.proto.messages import (NULL_BLOCK, CacheSpec, SamplingSpec,  # noqa: E402
                                      TokenizedRequest)
from pocketllm.scheduler.config import config_from_capabilities  # noqa: E402
from pocketllm.scheduler.scheduler import Scheduler  # noqa: E402
from pocketllm.workers import runner as runner_module  # noqa: E402
from pocketllm.workers.kv_cache import CacheLayout  # noqa: E402
from pocketllm.workers.runner import ModelRunner  # noqa: E402
from tiny_checkpoints import make_tiny_checkpoint, run_step  # noqa: E402

WINDOW, BS = 8, 4


def one_pool_layout(windows: list, _max_model_len: int, latent: bool = False,
                    state_layers=None) -> CacheLayout:
    """Every layer in one full-attention pool: the layout before cache groups."""
    assert not latent and not state_layers  # Gemma 3 caches K and V
    return CacheLayout([CacheSpec()], [0] * len(windows),
                       [sorted(set(windows), key=lambda w: -1 if w is None else w)])


def make_runner(path: str, one_pool: bool = False, monkeypatch=None, device: str = "cpu",
                **kw) -> ModelRunner:
    """``one_pool``: every layer in one full-attention pool, as before cache groups."""
    args = EngineArgs(model=path, device=device, dtype="float32", block_size=BS,
                      **{"num_kv_blocks": 256, "max_num_seqs": 4, **kw})
    if one_pool:
        monkeypatch.setattr(runner_module, "cache_layout", one_pool_layout)
    try:
        return ModelRunner(load_model_info(args), args)
    finally:
        if one_pool:
            monkeypatch.undo()


def shared_prefix_workload(engine: "Engine") -> dict[str, list[int]]:
    """Long sequences past the window, chunked prompts, then prefix hits on them (the
    hit's sliding table starts with NULL entries): what the GPU tests run on each path."""
    shared = prompt_of(30, seed=3)
    engine.add("a", shared + [5, 6], 24)
    engine.add("b", prompt_of(9, seed=4), 30)
    engine.run()
    engine.add("c", shared + [7, 8, 9], 24)
    engine.add("d", prompt_of(21, seed=6), 20)
    return engine.run()


class Engine:
    """The scheduler stage's loop without sockets: schedule, execute, update."""

    def __init__(self, runner: ModelRunner, **cfg):
        self.runner = runner
        caps = runner.capabilities()
        self.sched = Scheduler(config_from_capabilities(
            caps, cfg.pop("max_num_batched_tokens", runner.args.max_num_batched_tokens), 0.0,
            False))
        for name, value in cfg.items():
            setattr(self.sched.config, name, value)
        self.tokens: dict[str, list[int]] = {}
        self.cached: dict[str, int] = {}
        self.most_sliding_blocks = 0  # one decoding sequence's, in its sliding group

    def add(self, rid: str, prompt: list[int], max_tokens: int) -> None:
        error = self.sched.add_request(TokenizedRequest(
            rid, prompt, SamplingSpec(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)))
        assert error is None, error

    def run(self) -> dict[str, list[int]]:
        while self.sched.has_unfinished():
            plan = self.sched.schedule()
            self.sched.check_invariants()
            ids = [r.request_id for r in plan.new_requests + plan.cached_requests]
            decodes = {rid for rid, n in zip(ids, plan.num_scheduled_tokens) if n == 1}
            for req in self.sched.running:
                if len(req.block_ids) > 1 and req.request_id in decodes:
                    held = sum(b != NULL_BLOCK for b in req.block_ids[1])
                    self.most_sliding_blocks = max(self.most_sliding_blocks, held)
            result = run_step(self.runner, plan)
            assert result.error is None, result.error
            for delta in self.sched.update(plan, result).deltas:
                self.tokens.setdefault(delta.request_id, []).extend(delta.token_ids)
                self.cached[delta.request_id] = delta.num_cached_tokens
            self.sched.check_invariants()
        return self.tokens


def prompt_of(n: int, seed: int = 0) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(20, 500, (n,), generator=g).tolist()


@pytest.fixture(scope="module")
def gemma(tmp_path_factory):
    return make_tiny_checkpoint("gemma3", str(tmp_path_factory.mktemp("gemma3")))


@pytest.fixture(scope="module")
def reference(gemma):
    """Tokens of one full-attention pool for every layer (no cache groups)."""
    mp = pytest.MonkeyPatch()
    runner = make_runner(gemma, one_pool=True, monkeypatch=mp)
    assert len(runner.kv.num_blocks) == 1

    def tokens(prompt: list[int], max_tokens: int) -> list[int]:
        engine = Engine(runner)
        engine.add("ref", prompt, max_tokens)
        return engine.run()["ref"]

    return tokens


def test_a_long_sequence_holds_its_window_only_and_matches_transformers(gemma, reference):
    runner = make_runner(gemma)
    groups = runner.capabilities().cache_groups
    assert [(g.spec.kind, g.spec.window, g.num_layers) for g in groups] == [
        ("full", 0, 1), ("sliding", WINDOW, 2)]
    prompt = prompt_of(20)
    engine = Engine(runner)
    engine.add("a", prompt, 200)
    tokens = engine.run()["a"]
    assert engine.most_sliding_blocks == -(-WINDOW // BS) + 1  # 3 of the 55 positions' blocks
    assert engine.sched.kv.pools[1].num_used_blocks == 0
    assert tokens == reference(prompt, 200)
    model = transformers.AutoModelForCausalLM.from_pretrained(
        gemma, dtype=torch.float32, attn_implementation="eager")
    model.generation_config.eos_token_id = None
    with torch.inference_mode():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=200, do_sample=False,
                             pad_token_id=0)
    assert tokens == out[0, len(prompt):].tolist()


def test_prefix_caching_with_a_sliding_group(gemma, reference):
    engine = Engine(make_runner(gemma))
    shared = prompt_of(60, seed=1)
    engine.add("a", shared + [7, 8], 20)
    engine.run()
    engine.add("b", shared + [9, 10, 11], 20)
    tokens = engine.run()
    assert engine.cached["b"] == 60  # the window before the hit point is still cached
    assert tokens["b"] == reference(shared + [9, 10, 11], 20)
    assert tokens["a"] == reference(shared + [7, 8], 20)


def test_chunked_prefill_and_preemption_with_a_small_sliding_pool(gemma, reference):
    # 16-token chunks; the sliding pool is sized for 4 sequences' windows and two chunks
    # (22 blocks), the full pool holds 48: four 100-token sequences must take turns.
    runner = make_runner(gemma, num_kv_blocks=48, max_num_batched_tokens=16)
    assert runner.kv.num_blocks == [48, 4 * 3 + 2 * 4 + 2]
    engine = Engine(runner)
    prompts = {f"r{i}": prompt_of(40 + 7 * i, seed=10 + i) for i in range(4)}
    for rid, prompt in prompts.items():
        engine.add(rid, prompt, 60)
    tokens = engine.run()
    assert engine.sched.num_preemptions > 0
    assert engine.most_sliding_blocks <= -(-WINDOW // BS) + 1
    for rid, prompt in prompts.items():
        assert tokens[rid] == reference(prompt, 60), rid


def test_embedded_model_keeps_512_positions_in_its_sliding_layers(default_model_path,
                                                                  monkeypatch):
    """Gemma 3 270M: 15 of its 18 layers slide (window 512). A 1,100-token prompt and 24
    tokens: the sliding layers hold 33 blocks of 16, and the tokens are unchanged."""
    kw = dict(num_kv_blocks=160, max_num_seqs=2, block_size=16)
    runner = ModelRunner(load_model_info(EngineArgs(model=default_model_path, device="cpu", **kw)),
                         EngineArgs(model=default_model_path, device="cpu", **kw))
    groups = runner.capabilities().cache_groups
    assert [(g.spec.kind, g.spec.window, g.num_layers) for g in groups] == [
        ("full", 0, 3), ("sliding", 512, 15)]
    prompt = [2] + prompt_of(1099, seed=5)
    engine = Engine(runner)
    engine.add("long", prompt, 24)
    tokens = engine.run()["long"]
    assert engine.most_sliding_blocks == 512 // 16 + 1
    monkeypatch.setattr(runner_module, "cache_layout", one_pool_layout)
    args = EngineArgs(model=default_model_path, device="cpu", **kw)
    before = Engine(ModelRunner(load_model_info(args), args))
    before.add("long", prompt, 24)
    assert before.run()["long"] == tokens
