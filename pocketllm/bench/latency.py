"""`pocketllm bench latency`: load time, time to first token and decode speed at batch 1."""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field

from ..config import EngineArgs
from ..sampling import SamplingParams
from .throughput import settled_stats

DEFAULT_PROMPT = ("Write a short story about a lighthouse keeper who discovers that the light "
                  "has been sending messages to ships for a hundred years.")
DUMMY_PROMPT_LEN = 32  # the prompt of a model without a vocabulary, when --input-len is not given
NAME_WIDTH = 20


@dataclass
class LatencyResult:
    name: str
    load_s: float
    ttft_s: float  # median
    decode_tps: float  # median tokens/s after the first token
    runs: int
    batched: dict = field(default_factory=dict)  # batch size -> output tokens/s
    device: str = ""
    dtype: str = "float32"
    weight_bytes: int = 0  # per rank: what one decode step reads
    state_bytes: int = 0  # per rank: a sequence's recurrent state read and written a step
    cached_prompt_tokens: int = 0  # of the batch-1 runs, served from the prefix cache (~0)
    prompt_tokens: int = 0
    spec: tuple[int, int] = (0, 0)  # speculative drafts verified, accepted (batch-1 runs)

    @property
    def prefill_tps(self) -> float:
        """Prompt tokens / TTFT: the prefill speed, first sampled token included."""
        return self.prompt_tokens / self.ttft_s if self.ttft_s > 0 else 0.0

    def row(self) -> str:
        return (f"{self.name:<{NAME_WIDTH}} {self.load_s:>8.2f} {self.ttft_s * 1000:>10.1f} "
                f"{self.prefill_tps:>13.1f} {self.decode_tps:>12.1f}")


def run_pocketllm(args: EngineArgs, prompt_ids: list[int] | None, prompt: str | None,
                  output_len: int, runs: int, warmup: int, batch_sizes: tuple[int, ...] = (),
                  input_len: int | None = None, record: list | None = None
                  ) -> tuple[LatencyResult, list[int]]:
    """Batch-1 latency of PocketLLM on ``prompt_ids``, else on ``prompt_ids_for(prompt,
    input_len)``; returns the ids too, for the peer to run the same prompt. ``record``:
    a list that gets each run's (prompt ids, output ids)."""
    from .. import LLM

    t0 = time.perf_counter()
    llm = LLM(args)
    load_s = time.perf_counter() - t0
    caps = llm.engine_caps()
    try:
        sp = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
        ids = prompt_ids if prompt_ids is not None else prompt_ids_for(llm.model_info, prompt,
                                                                       input_len)
        before = settled_stats(llm)
        ttfts, tps = [], []
        for i in range(warmup + runs):
            start = time.perf_counter()
            first = None
            out: list[int] = []
            prompt_i = fresh_prompt(ids, i, llm.model_info.vocab_size)
            for event in llm.generate_stream(prompt_i, sp):
                if event.token_ids and first is None:
                    first = time.perf_counter()
                out.extend(event.token_ids)
            end = time.perf_counter()
            n = len(out)
            if record is not None:
                record.append((prompt_i, out))
            if i >= warmup and first is not None and n > 1:
                ttfts.append(first - start)
                tps.append((n - 1) / (end - first))
        after = settled_stats(llm, newer_than=before)
        cached = after.prefix_cache_hits - before.prefix_cache_hits
        spec = (after.spec_draft_tokens - before.spec_draft_tokens,
                after.spec_accepted_tokens - before.spec_accepted_tokens)
        batched = {b: batch_decode_tps(llm, ids, b, output_len, runs) for b in batch_sizes}
    finally:
        llm.shutdown()
    result = LatencyResult("pocketllm", load_s, statistics.median(ttfts),
                           statistics.median(tps), runs)
    result.batched = batched
    result.device, result.dtype, result.weight_bytes = caps.device, caps.dtype, caps.weight_bytes
    result.state_bytes = caps.state_step_bytes
    result.cached_prompt_tokens = cached
    result.prompt_tokens = len(ids)
    result.spec = spec
    return result, ids


def speculative_replay(args: EngineArgs, prompt: str | None, input_len: int | None,
                       output_len: int, runs: int, warmup: int, accept: str, vocab_size: int,
                       threads: int, num_speculative_tokens: int | None = None) -> str:
    """``bench latency --speculative-replay``: batch-1 decode without speculation, recording
    the greedy output, then with the replay drafter proposing it (``accept="full"``) or a
    copy no draft of which is accepted (``"none"``): speculation's cost at either end of
    acceptance. With ``args.speculative_method`` "draft" or "mtp" that drafter proposes, and
    its proposals carry the replayed tokens (``scheduler/worker_drafts.py``): its own cost
    at either end; ``num_speculative_tokens``: the replay drafter's (None: the default).
    Returns the report."""
    import dataclasses
    import os

    record: list = []
    method = args.speculative_method  # None (the replay drafter), "draft" or "mtp"
    plain_args = args.without_speculation()
    plain, prompt_ids = run_pocketllm(plain_args, None, prompt, output_len, runs, warmup,
                                      input_len=input_len, record=record)
    path = replay_file(record, accept, vocab_size)
    try:
        spec_args = dataclasses.replace(args, speculative_method=method or "replay",
                                        speculative_replay=path,
                                        num_speculative_tokens=(num_speculative_tokens
                                                                or args.num_speculative_tokens))
        ours, _ = run_pocketllm(spec_args, prompt_ids, None, output_len, runs, warmup)
    finally:
        os.unlink(path)
    plain.name = "no speculation"
    inside = f", inside the {method} drafter's proposals" if method else ""
    return "\n".join([
        f"prompt: {len(prompt_ids)} tokens; drafts: the greedy output replayed ({accept} "
        f"acceptance{inside}), k = {spec_args.num_speculative_tokens}",
        report([ours, plain], output_len, threads=threads if ours.device == "cpu" else None),
        roofline(ours)])


def replay_file(record: list, accept: str, vocab_size: int) -> str:
    """A file of the recorded runs for the replay drafter (``scheduler/replay.py``):
    ``accept="full"`` as recorded (every draft accepted); ``"none"`` each token moved to the
    next id, so no draft is the token the target picks (a draft shifted by one position
    would still be accepted wherever the output repeats a token)."""
    import json
    import tempfile

    shift = {"full": 0, "none": 1}[accept]
    runs = [{"prompt": p, "output": [(t + shift) % vocab_size for t in out]} for p, out in record]
    with tempfile.NamedTemporaryFile("w", suffix=".json", prefix="pocketllm-replay-",
                                     delete=False) as f:
        json.dump({"runs": runs}, f)
    return f.name


def fresh_prompt(ids: list[int], run: int, vocab_size: int) -> list[int]:
    """``ids`` with one token changed per run (the second: the first may be BOS). A repeated
    prompt would come from the prefix cache that the runs before filled, and its TTFT would
    leave out most of the prefill that the peer's TTFT includes."""
    j = 1 if len(ids) > 1 else 0
    return ids[:j] + [(ids[j] + 1 + run) % vocab_size] + ids[j + 1:]


def batch_decode_tps(llm, ids: list[int], batch: int, output_len: int, runs: int) -> float:
    """Output tokens/s of ``batch`` sequences decoding together: the time of a full run
    minus that of a prefill-only run. Each sequence's first token differs, so the prefix
    cache cannot fold them into one."""
    vocab = llm.model_info.vocab_size
    prompts = [[(ids[0] + i) % vocab] + ids[1:] for i in range(batch)]
    full = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
    first = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    rates = []
    for _ in range(runs):
        llm.generate(prompts, first)  # warm, and fills the prefix cache for both runs below
        t0 = time.perf_counter()
        llm.generate(prompts, first)
        t1 = time.perf_counter()
        llm.generate(prompts, full)
        t2 = time.perf_counter()
        rates.append(batch * (output_len - 1) / max((t2 - t1) - (t1 - t0), 1e-9))
    return statistics.median(rates)


def prompt_ids_for(info, prompt: str | None, input_len: int | None) -> list[int]:
    """The exact token ids every engine prefills: ``prompt``'s (default: DEFAULT_PROMPT), or
    with ``input_len`` a synthetic prompt of that many ids. A model without a vocabulary
    (dummy weights) gets synthetic ids only."""
    check_prompt(info, prompt)
    if info.tokenizer_path is None:
        return synthetic_ids(input_len or DUMMY_PROMPT_LEN, info.vocab_size,
                             skip={info.bos_token_id, *info.eos_token_ids})
    from ..tokenizer.tokenizer import load_tokenizer

    tok = load_tokenizer(info).tokenizer
    ids = tok.encode(prompt or DEFAULT_PROMPT, add_special_tokens=True).ids
    if input_len is None:
        return ids
    body = tok.encode(DEFAULT_PROMPT, add_special_tokens=False).ids
    while len(ids) < input_len:  # BOS (if any), then the text's ids over and over
        ids = ids + body
    return ids[:input_len]


def check_prompt(info, prompt: str | None) -> None:
    """Refuse a prompt text that the model cannot tokenize (rather than ignore it)."""
    if prompt is not None and info.tokenizer_path is None:
        raise SystemExit(f"--prompt needs a tokenizer and {info.path!r} has none (dummy "
                         "weights?); use --input-len N for a synthetic prompt of N tokens")


def synthetic_ids(n: int, vocab_size: int, skip: set) -> list[int]:
    """``n`` fixed token ids spread over the vocabulary, none of them in ``skip``."""
    ids, j = [], 0
    while len(ids) < n:
        t = (7 * j + 11) % vocab_size
        j += 1
        if t not in skip:
            ids.append(t)
    return ids


def roofline(result: LatencyResult) -> str:
    """Decode speed as a share of the memory roofline: the device's copy bandwidth
    (measured now, in this process) over the bytes one step moves: the weights it reads,
    and a linear-attention model's recurrent state, read and written."""
    from pocketllm.workers.device import copy_bandwidth  # the bench may import torch

    import torch

    device = torch.device(result.device)
    bw = copy_bandwidth(device, nbytes=(1 << 30) if device.type == "cuda" else (256 << 20))
    limit = bw / (result.weight_bytes + result.state_bytes)
    state = (f" + state {result.state_bytes / 1e6:,.1f} MB" if result.state_bytes else "")
    return (f"roofline: copy bandwidth {bw / 1e9:,.0f} GB/s (read + write) / weights "
            f"{result.weight_bytes / 1e9:.2f} GB{state} per rank = {limit:,.1f} tok/s at "
            f"batch 1; decode reaches {result.decode_tps / limit:.0%} of it"
            + (" (speculative: several tokens a step)" if result.spec[0] else ""))


def report(results: list[LatencyResult], output_len: int, threads: int | None = None) -> str:
    head = f"decode of {output_len} tokens, batch 1, greedy; medians"
    if threads is not None:
        head += f"; CPU threads: {threads}"
    lines = [head, f"{'engine':<{NAME_WIDTH}} {'load s':>8} {'TTFT ms':>10} "
                   f"{'prefill tok/s':>13} {'decode tok/s':>12}"]
    lines += [r.row() for r in results]
    if len(results) == 2:
        a, b = results
        lines.append(ratio_row(a, b))
        lines.append(f"({a.name}/{b.name}: {a.name}'s figure over {b.name}'s; under 1 is "
                     f"faster for load and TTFT, over 1 for tok/s)")
    if results[0].name == "pocketllm":
        lines.append(f"pocketllm prompt tokens served from the prefix cache in the batch-1 runs: "
                     f"{results[0].cached_prompt_tokens:,}")
        drafted, accepted = results[0].spec
        if drafted:
            lines.append(f"pocketllm speculative drafts in the batch-1 runs (warm-up included): "
                         f"{drafted:,} verified, {accepted:,} accepted ({accepted / drafted:.0%})")
    for r in results:
        for b, tps in r.batched.items():
            lines.append(f"{r.name:<14} batch {b:>3}: {tps:>10.1f} output tok/s (decode)")
    return "\n".join(lines)


def ratio_row(a: LatencyResult, b: LatencyResult) -> str:
    def r(x: float, y: float, width: int) -> str:
        return f"{x / y:>{width - 1}.2f}x" if y > 0 else f"{'-':>{width}}"

    return (f"{a.name + '/' + b.name:<{NAME_WIDTH}} {r(a.load_s, b.load_s, 8)} "
            f"{r(a.ttft_s, b.ttft_s, 10)} {r(a.prefill_tps, b.prefill_tps, 13)} "
            f"{r(a.decode_tps, b.decode_tps, 12)}")
