"""`pocketllm bench latency | throughput | serve`: their arguments and what each runs."""

from __future__ import annotations

import argparse
import json
import os
import sys

from ..cli import add_engine_args, engine_args_from


def cmd_bench_latency(ns: argparse.Namespace) -> int:
    from .latency import check_prompt, report, roofline, run_pocketllm
    from ..config import cpu_thread_count
    from ..model_info import load_model_info

    if ns.output_len < 2:
        raise SystemExit("--output-len must be at least 2 (decode speed is timed after the "
                         "first token)")
    for flag, value in (("--input-len", ns.input_len), ("--threads", ns.threads)):
        if value is not None and value < 1:
            raise SystemExit(f"{flag} must be at least 1")
    k = None  # the replay drafter's draft count: no --speculative-method names it
    if ns.replay_acceptance and ns.speculative_method is None:
        k, ns.num_speculative_tokens = ns.num_speculative_tokens, None
    args = engine_args_from(ns)
    info = load_model_info(args)
    check_prompt(info, ns.prompt)
    if ns.peer == "llama.cpp":  # refuse before the long pocketllm run
        from .peer_llama_cpp import gguf_path, import_llama_cpp

        path = gguf_path(info, args.load_format)
        import_llama_cpp()
    if ns.threads is not None:  # the worker sizes its CPU thread pool from this
        os.environ["POCKETLLM_NUM_THREADS"] = str(ns.threads)
    threads = cpu_thread_count()
    batches = tuple(int(b) for b in ns.batch_sizes.split(",") if b) if ns.batch_sizes else ()
    if ns.replay_acceptance:
        from .latency import speculative_replay

        if args.speculative_method not in (None, "draft", "mtp") or ns.peer or ns.batch_sizes:
            raise SystemExit("--speculative-replay runs its own two engines (without "
                             "speculation, then replaying): no --peer or --batch-sizes, and "
                             "a --speculative-method only of the worker's drafters (draft, "
                             "mtp), whose proposals then carry the replayed tokens")
        print(speculative_replay(args, ns.prompt, ns.input_len, ns.output_len, ns.runs,
                                 ns.warmup, ns.replay_acceptance, info.vocab_size, threads,
                                 num_speculative_tokens=k))
        return 0
    ours, prompt_ids = run_pocketllm(args, None, ns.prompt, ns.output_len, ns.runs, ns.warmup,
                                     batches, input_len=ns.input_len)
    results = [ours]
    if ns.peer == "transformers":
        from .peer_transformers import run_transformers

        results.append(run_transformers(info, prompt_ids, ns.output_len, ns.runs, ns.warmup,
                                        dtype=ours.dtype, threads=threads))
    elif ns.peer == "llama.cpp":
        from .peer_llama_cpp import run_llama_cpp

        results.append(run_llama_cpp(path, prompt_ids, info.vocab_size, ns.output_len,
                                     ns.runs, ns.warmup, threads))
    print(f"prompt: {len(prompt_ids)} tokens")
    print(report(results, ns.output_len, threads=threads if ours.device == "cpu" else None))
    print(roofline(ours))
    return 0


def cmd_bench_throughput(ns: argparse.Namespace) -> int:
    from .throughput import Penalties, report, run_pocketllm

    args = engine_args_from(ns)
    penalties = Penalties(ns.frequency_penalty, ns.presence_penalty, ns.repetition_penalty,
                          ns.logit_bias_tokens)
    ours, prompts = run_pocketllm(args, ns.num_prompts, ns.input_len, ns.output_len, ns.seed,
                                  ns.runs, penalties)
    results = [ours]
    if ns.peer == "transformers":
        from .peer_transformers import run_transformers_throughput
        from ..model_info import load_model_info

        peer_prompts = prompts[:ns.peer_num_prompts]
        results.append(run_transformers_throughput(load_model_info(args), peer_prompts,
                                                   ns.output_len, ns.peer_batch,
                                                   ours.dtype))
    elif ns.peer is not None:
        raise SystemExit(f"unknown peer {ns.peer!r}; the peer this command runs is transformers")
    print(report(results))
    return 0


def cmd_bench_serve(ns: argparse.Namespace) -> int:
    from .serve import ServeBenchConfig, run_serve_bench

    cfg = ServeBenchConfig(
        url=ns.url, endpoint=ns.endpoint, concurrency=ns.concurrency,
        request_rate=ns.request_rate, num_requests=ns.num_requests, input_len=ns.input_len,
        output_len=ns.output_len, seed=ns.seed,
        api_key=ns.api_key or os.environ.get("POCKETLLM_API_KEY"), model=ns.model,
        timeout=ns.timeout, token_ids=ns.token_ids)
    result = run_serve_bench(cfg)
    if ns.json:
        with open(ns.json, "w") as f:
            json.dump(result.as_dict(), f, indent=2)
        print(f"wrote {ns.json}", file=sys.stderr)
    print(result.table())
    return 0 if result.summary()["completed"] else 1


def add_bench_parsers(sub) -> None:
    """``pocketllm bench ...`` under the top-level parser's subcommands ``sub``."""
    bench = sub.add_parser("bench", help="benchmarks").add_subparsers(dest="bench", required=True)
    lat = bench.add_parser("latency", help="load time, TTFT and decode tokens/s at batch 1")
    add_engine_args(lat)
    prompt = lat.add_mutually_exclusive_group()
    prompt.add_argument("--prompt", default=None,
                        help="the prompt text (default: a fixed one-sentence prompt; needs a "
                             "tokenizer)")
    prompt.add_argument("--input-len", type=int, default=None,
                        help="a synthetic prompt of this many token ids, for any model "
                             "(default: the fixed prompt; 32 ids without a tokenizer)")
    lat.add_argument("--output-len", type=int, default=128)
    lat.add_argument("--runs", type=int, default=3)
    lat.add_argument("--warmup", type=int, default=1)
    lat.add_argument("--peer", default=None, choices=["transformers", "llama.cpp"],
                     help="also run this engine on the same checkpoint and prompt "
                          "(llama.cpp: a GGUF, through llama-cpp-python)")
    lat.add_argument("--threads", type=int, default=None,
                     help="CPU threads of both engines (default: POCKETLLM_NUM_THREADS or "
                          "OMP_NUM_THREADS, else every core this process may use)")
    lat.add_argument("--batch-sizes", default="",
                     help="also measure decode output tok/s at these batch sizes, e.g. 1,64")
    lat.add_argument("--speculative-replay", dest="replay_acceptance", default=None,
                     choices=["full", "none"],
                     help="speculation's cost at full or no acceptance: decode without it, "
                          "recording the greedy output, then with that output replayed as "
                          "drafts (full) or shifted to other tokens (none); with "
                          "--speculative-method draft|mtp that drafter runs and its "
                          "proposals carry the replayed tokens")
    lat.set_defaults(func=cmd_bench_latency)

    tp = bench.add_parser("throughput", help="offline output tokens/s over many requests")
    add_engine_args(tp)
    tp.add_argument("--num-prompts", type=int, default=1000)
    tp.add_argument("--input-len", type=int, default=256)
    tp.add_argument("--output-len", type=int, default=256)
    tp.add_argument("--runs", type=int, default=1)
    tp.add_argument("--peer", default=None, help="transformers: static batches of the same "
                    "prompts")
    tp.add_argument("--peer-batch", type=int, default=64)
    tp.add_argument("--peer-num-prompts", type=int, default=128,
                    help="the peer's share of the prompts (it is much slower)")
    # the cost of penalties and logit_bias in use (the peer runs without them)
    tp.add_argument("--frequency-penalty", type=float, default=0.0)
    tp.add_argument("--presence-penalty", type=float, default=0.0)
    tp.add_argument("--repetition-penalty", type=float, default=1.0)
    tp.add_argument("--logit-bias-tokens", type=int, default=0,
                    help="logit_bias of +-2 on this many random token ids")
    tp.set_defaults(func=cmd_bench_throughput)

    bs = bench.add_parser("serve", help="load a RUNNING server with streaming requests: "
                          "TTFT, ITL, E2E percentiles and throughput")
    bs.add_argument("--url", default="http://127.0.0.1:8000", help="the server's root URL")
    bs.add_argument("--endpoint", default="chat", choices=["chat", "completions"])
    loop = bs.add_mutually_exclusive_group()
    loop.add_argument("--concurrency", type=int, default=None,
                      help="closed loop: requests in flight (default 8)")
    loop.add_argument("--request-rate", type=float, default=None,
                      help="open loop: Poisson arrivals at this many requests/s")
    bs.add_argument("--num-requests", type=int, default=100)
    bs.add_argument("--input-len", type=int, default=128,
                    help="prompt length in random words (about one token each)")
    bs.add_argument("--output-len", type=int, default=128, help="max_tokens, with ignore_eos")
    bs.add_argument("--seed", type=int, default=0, help="prompts and arrival times")
    bs.add_argument("--token-ids", action="store_true",
                    help="send random token-id prompts (completions; for dummy weights)")
    bs.add_argument("--api-key", default=None, help="(or POCKETLLM_API_KEY)")
    bs.add_argument("--model", default=None,
                    help="the model field to send (default: the first of GET /v1/models)")
    bs.add_argument("--timeout", type=float, default=300.0, help="seconds per request")
    bs.add_argument("--json", default=None, metavar="FILE", help="write every figure here")
    bs.set_defaults(func=cmd_bench_serve)
