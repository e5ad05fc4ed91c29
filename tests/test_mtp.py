"""Speculative decoding with the checkpoint's multi-token-prediction layer
(``speculative_method="mtp"``: workers/models/mtp_layer.py, workers/mtp_proposer.py):
the layer against one composed from transformers' own Qwen3.5 modules, then the engine's
text with MTP drafts against the text without speculation, on tiny random Qwen3.5,
Qwen3.5-MoE and DeepSeek-V3 (MLA) checkpoints given an MTP layer
(``tiny_checkpoints.add_mtp_layer``). The torch worker on the CPU, and on a GPU where
there is one."""

from __future__ import annotations

import pytest

from pocketllm.errors import UnsupportedFeatureError
from speculation_checks import GPU, decoded, same_and_drafts, same_case_by_case

PROMPTS = [[40, 41, 42, 43, 40, 41, 42, 43, 40, 41], [50, 51, 52, 50, 51, 52, 50]]


def _with_mtp(family="qwen3_5"):
    from tiny_checkpoints import add_mtp_layer, make_tiny_checkpoint

    return add_mtp_layer(make_tiny_checkpoint(family))


def _mtp_engine(path, device="cpu", **kw):
    from pocketllm import LLM

    return LLM(model=path, dtype="float32", max_model_len=256, device=device,
               speculative_method="mtp", **kw)


@pytest.mark.parametrize("family", ["qwen3_5", "qwen3_5_moe", "deepseek_v3"])
def test_the_mtp_layer_guesses_as_transformers_modules_do(family):
    """Each prompt position's guess (the layer's logits over the target's hidden state at
    t and token t + 1) against the layer composed from transformers' decoder layer, norms
    and head (test_mtp_reference.py), in one forward over the prompt."""
    import torch

    from pocketllm.config import EngineArgs
    from pocketllm.model_info import load_model_info
    from pocketllm.workers.runner import ModelRunner
    from pocketllm.workers.step_rows import ScheduledSeq
    from test_mtp_reference import hf_mtp_logits

    path = _with_mtp(family)
    tokens = [7 * i % 400 + 20 for i in range(19)]
    args = EngineArgs(model=path, device="cpu", dtype="float32", block_size=4,
                      num_kv_blocks=64, max_num_seqs=4, speculative_method="mtp")
    runner = ModelRunner(load_model_info(args), args)
    model, proposer = runner.model, runner.draft
    t = len(tokens)
    table = list(range((t + 3) // 4))
    # the prompt's rows in each cache group: blocks for the attention layers, state slot 0
    seqs = [[ScheduledSeq([0] if state else table, 0, t, 0)] for state in runner.state_groups]
    with torch.inference_mode():
        if any(runner.state_groups):
            runner.kv.start_states(runner.state_groups.index(True), [0])
        hidden = model(proposer.ids(tokens), proposer.ids(list(range(t))), t - 1,
                       runner.metadata(seqs), runner.kv_caches)
        out = model.mtp(proposer.ids(tokens[1:]), proposer.ids(list(range(t - 1))), t - 2,
                        model.norm(hidden[:t - 1]),
                        proposer.metadata([ScheduledSeq(table, 0, t - 1, 0)]),
                        proposer.kv.layer_caches[0])
        got = model.mtp.logits(out).float()
    want = hf_mtp_logits(path, tokens)
    assert got.shape == want.shape
    torch.testing.assert_close(got, want, atol=2e-4, rtol=1e-4)


@pytest.mark.parametrize("family", ["qwen3_5", "deepseek_v3"])  # hybrid, MLA
def test_rows_waiting_for_the_layer_write_the_kv_a_pass_each_step_writes(family, monkeypatch):
    """The layer's KV is written once a request is asked to propose or holds
    ``WAIT_ROWS`` verified rows (workers/mtp_proposer.py): a prompt and decode steps that
    propose nothing leave their rows waiting until then, and the KV their pass writes is
    the KV a pass after every step writes."""
    import torch

    from pocketllm.proto.messages import SamplingSpec
    from pocketllm.workers import mtp_proposer
    from tiny_checkpoints import PlanDriver
    from test_worker_parity import make_runner

    path = _with_mtp(family)

    def decode(wait_rows: int, steps: int):
        monkeypatch.setattr(mtp_proposer, "WAIT_ROWS", wait_rows)
        runner = make_runner(path, speculative_method="mtp")
        driver = PlanDriver(runner)
        driver.add("r", PROMPTS[0], SamplingSpec(temperature=0.0, max_tokens=steps), steps)
        for _ in range(steps):
            driver.step_once()
        waiting = runner.draft.waiting.get("r")
        return runner, driver.reqs["r"].blocks, 0 if waiting is None else len(waiting.ids)

    each, blocks, waiting = decode(1, 12)
    assert waiting == 0
    deferred, same_blocks, waiting = decode(16, 12)  # 10 prompt rows, a pass at 16
    assert same_blocks == blocks and waiting == (10 + 11) - 16
    slots = torch.tensor([blocks[p // 4] * 4 + p % 4 for p in range(16)])
    for want, got in zip(each.draft.kv.layer_caches[0], deferred.draft.kv.layer_caches[0]):
        if want is not None:
            torch.testing.assert_close(got[slots], want[slots], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("family,device", [
    ("qwen3_5", "cpu"), ("qwen3_5_moe", "cpu"), ("deepseek_v3", "cpu"),
    pytest.param("qwen3_5", "cuda", marks=GPU), pytest.param("deepseek_v3", "cuda", marks=GPU)])
def test_greedy_text_is_the_same_with_mtp_drafts(family, device):
    """The text without speculation, twice (the second time from the prefix cache), with
    the MTP layer's drafts verified (few accepted: its weights are random)."""
    from pocketllm import SamplingParams

    path = _with_mtp(family)
    greedy = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    want = decoded(PROMPTS, greedy, model=path, dtype="float32", max_model_len=256,
                    device=device)
    drafted, _ = same_and_drafts(_mtp_engine(path, device), want, PROMPTS, greedy, times=2)
    assert drafted > 0


@GPU
@pytest.mark.parametrize("family", ["qwen3_5", "deepseek_v3"])  # gated attention, MLA
def test_the_layers_guesses_under_cuda_graphs_are_its_eager_guesses(family):
    """A proposal's guesses after the first replay ``GuessGraphs`` (fed their tokens and
    hidden states on the device): at each batch rung, the outputs and logits of the eager
    layer at the same positions, tokens and hidden states."""
    import torch

    from pocketllm.proto.messages import SamplingSpec
    from pocketllm.workers.step_rows import ScheduledSeq
    from tiny_checkpoints import PlanDriver
    from test_worker_parity import make_runner

    runner = make_runner(_with_mtp(family), device="cuda", speculative_method="mtp")
    proposer = runner.draft
    assert proposer.graphs is not None and proposer.graphs.batch_sizes
    driver = PlanDriver(runner)
    for i, prompt in enumerate(PROMPTS * 2):
        driver.add(f"r{i}", prompt, SamplingSpec(temperature=0.0, max_tokens=4), 4)
    driver.step_once()  # the prompts: each request has its blocks
    tables = [driver.reqs[f"r{i}"].blocks for i in range(4)]
    gen = torch.Generator(device="cuda").manual_seed(0)
    with torch.inference_mode():
        for b in proposer.graphs.batch_sizes:
            seqs = [ScheduledSeq(tables[i], 5, 1, i) for i in range(b)]  # (in every prompt)
            tokens = torch.arange(40, 40 + b, device="cuda")
            hidden = torch.randn(b, proposer.hidden_size, generator=gen, device="cuda")
            graphed = [t.clone() for t in proposer._guess(seqs, tokens, [5] * b, hidden)]
            graphs, proposer.graphs = proposer.graphs, None
            try:
                eager = proposer._guess(seqs, tokens, [5] * b, hidden)
            finally:
                proposer.graphs = graphs
            for got, want in zip(graphed, eager):
                torch.testing.assert_close(got.float(), want.float(), atol=1e-4, rtol=1e-4)


def test_replayed_tokens_in_mtp_proposals_are_accepted_at_either_end(tmp_path):
    """``speculative_replay`` with ``mtp`` (the bench's ``--speculative-replay``): the layer
    proposes as always, its proposals carry the recorded output, so every draft is accepted
    (as recorded) or none is (each moved to another id), the text unchanged either way."""
    import json

    from pocketllm import SamplingParams
    from tiny_checkpoints import VOCAB_SIZE

    path = _with_mtp()
    greedy = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    want = decoded(PROMPTS, greedy, model=path, dtype="float32", max_model_len=256)
    for shift, full in ((0, True), (1, False)):
        replay = tmp_path / f"replay{shift}.json"
        replay.write_text(json.dumps({"runs": [
            {"prompt": p, "output": [(t + shift) % VOCAB_SIZE for t in o.token_ids]}
            for p, o in zip(PROMPTS, want)]}))
        drafted, accepted = same_and_drafts(
            _mtp_engine(path, speculative_replay=str(replay)), want, PROMPTS, greedy)
        assert drafted > 0 and accepted == (drafted if full else 0), (shift, drafted, accepted)


def test_the_bench_replays_inside_the_mtp_proposals():
    """``bench latency --speculative-method mtp --speculative-replay full``: the recording
    is made without speculation, then every draft the layer proposes carries it."""
    import re

    from pocketllm.bench.latency import speculative_replay
    from pocketllm.config import EngineArgs
    from tiny_checkpoints import VOCAB_SIZE

    args = EngineArgs(model=_with_mtp(), dtype="float32", device="cpu", max_model_len=256,
                      speculative_method="mtp")
    report = speculative_replay(args, None, 12, 16, 1, 0, "full", VOCAB_SIZE, 1)
    assert "inside the mtp drafter's proposals" in report
    verified, accepted = map(int, re.search(r"(\d+) verified, (\d+) accepted", report).groups())
    assert verified > 0 and accepted == verified, report


@pytest.mark.parametrize("family", ["qwen3_5", "deepseek_v3"])  # hybrid, MLA
def test_sampled_stopped_penalised_structured_and_preempted_text_with_mtp(family):
    """Seeded sampling (one prompt three times at once, the server's n = 3), a stop
    string, penalties and logit_bias per position, a JSON grammar, and a KV cache small
    enough to preempt: each the text without speculation."""
    from pocketllm import SamplingParams

    path = _with_mtp(family)
    common = dict(model=path, dtype="float32", max_model_len=256, device="cpu")
    plain = decoded(PROMPTS, SamplingParams(max_tokens=24, temperature=0), **common)
    cases = [SamplingParams(max_tokens=16, temperature=1.0, top_p=0.9, seed=s, ignore_eos=True)
             for s in range(3)]
    cases += [SamplingParams(max_tokens=24, temperature=0, stop=[plain[0].text[8:11]]),
              SamplingParams(max_tokens=30, temperature=0, frequency_penalty=0.5,
                             presence_penalty=0.3, logit_bias={45: 2.0}),
              SamplingParams(max_tokens=30, temperature=0,
                             response_format={"type": "json_object"})]
    same_case_by_case(lambda **kw: _mtp_engine(path, **kw), cases, PROMPTS, **common)


def test_mtp_refusals():
    """A family with no MTP layer built, Qwen3.5 and DeepSeek checkpoints without one, a
    draft model beside it: startup errors saying why."""
    from pocketllm.config import EngineArgs
    from pocketllm.errors import InvalidRequestError
    from tiny_checkpoints import make_tiny_checkpoint

    with pytest.raises(UnsupportedFeatureError, match="no MTP layer of"):
        _mtp_engine(make_tiny_checkpoint("llama")).shutdown()
    with pytest.raises(UnsupportedFeatureError, match="mtp_num_hidden_layers"):
        _mtp_engine(make_tiny_checkpoint("qwen3_5")).shutdown()
    with pytest.raises(UnsupportedFeatureError, match="num_nextn_predict_layers"):
        _mtp_engine(make_tiny_checkpoint("deepseek_v2")).shutdown()
    with pytest.raises(InvalidRequestError, match="speculative_model"):
        EngineArgs(speculative_method="mtp", speculative_model="x")
