"""`pocketllm serve | generate | chat | bench ...` (also `python -m pocketllm`)."""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import sys
from typing import Optional

from .config import EngineArgs
from .errors import PocketLLMError


class HelpWithDefaults(argparse.ArgumentDefaultsHelpFormatter):
    """--help shows every option's default, except where its help already says it."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        return text if "default" in text else super()._get_help_string(action)


def add_sampling_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-tokens", type=int, default=128, help="most tokens per answer")
    p.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    p.add_argument("--sample-seed", type=int, default=None,
                   help="seed of the sampling (default: unseeded)")


def add_engine_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("engine")
    g.add_argument("--model", default=None,
                   help="checkpoint directory or .gguf file, or a Hugging Face id org/name "
                        "(org/name-GGUF:Q4_K_M picks a GGUF quantization), fetched into the "
                        "Hugging Face cache (default: embedded Gemma 3 270M)")
    g.add_argument("--revision", default=None,
                   help="with a Hugging Face id: the branch, tag or commit (default: main)")
    g.add_argument("--tokenizer", default=None,
                   help="a tokenizer.json, a directory holding one, or a .gguf whose vocabulary "
                        "replaces the checkpoint's (default: the checkpoint's own)")
    g.add_argument("--backend", default="auto", help="auto | torch")
    g.add_argument("--load-format", default="auto", help="auto | safetensors | gguf | dummy")
    g.add_argument("--quantization", default=None,
                   help="fp8: hold the linear weights in FP8 (e4m3, a scale per row) on a GPU "
                        "with FP8 tensor cores; with --load-format dummy also random weights "
                        "in GGUF block types, one type (q8_0, q4_k, ...) or a mix (q4_k_m)")
    g.add_argument("--dequantize-weights", action="store_true",
                   help="expand GGUF block weights to float at load (reference numerics, ~4x "
                        "the memory) instead of running the CPU block kernels on them")
    g.add_argument("--dtype", default="auto", help="auto | float32 | float16 | bfloat16")
    g.add_argument("--device", default="auto", help="auto | cpu | cuda")
    g.add_argument("--tensor-parallel-size", type=int, default=1,
                   help="split the model across this many worker processes (one per GPU)")
    g.add_argument("--max-model-len", type=int, default=None,
                   help="longest prompt + output, in tokens (default: the checkpoint's context "
                        "length, capped at 8192)")
    g.add_argument("--max-num-seqs", type=int, default=64,
                   help="most requests in the running batch")
    g.add_argument("--max-num-batched-tokens", type=int, default=2048,
                   help="per-step token budget (the chunked-prefill size)")
    g.add_argument("--block-size", type=int, default=16, help="tokens per KV-cache block")
    g.add_argument("--num-kv-blocks", type=int, default=None,
                   help="KV-cache size in blocks (default: sized from memory)")
    g.add_argument("--kv-cache-memory-gb", type=float, default=None,
                   help="KV-cache size in GiB (default: sized from memory)")
    g.add_argument("--speculative-method", default=None,
                   help="ngram: draft tokens by looking the last tokens up earlier in the "
                        "prompt and output; draft: a smaller model of the same vocabulary "
                        "(--speculative-model) drafts them; mtp: the checkpoint's "
                        "multi-token-prediction layer (Qwen3.5); verified in one step")
    g.add_argument("--speculative-model", default=None,
                   help="the draft model of --speculative-method draft (a path, a shipped "
                        "shape with --load-format dummy, or a Hugging Face id)")
    g.add_argument("--num-speculative-tokens", type=int, default=None,
                   help="most draft tokens a request verifies in one step (default 4; "
                        "only with --speculative-method)")
    g.add_argument("--kv-cache-dtype", default="auto",
                   help="auto (the model dtype) | fp8: e4m3 keys and values with a scale per "
                        "position and head, about half the bytes (a GPU with FP8 support)")
    g.add_argument("--gpu-memory-utilization", type=float, default=0.90,
                   help="share of free GPU memory the KV cache may take")
    g.add_argument("--no-prefix-caching", action="store_true",
                   help="do not reuse the KV blocks of shared prompt prefixes")
    g.add_argument("--no-chunked-prefill", action="store_true",
                   help="prefill each prompt in one step instead of in budget-sized chunks")
    g.add_argument("--seed", type=int, default=0, help="engine seed (unseeded sampling)")
    g.add_argument("--no-cuda-graphs", action="store_true",
                   help="run decode steps eagerly instead of replaying CUDA graphs")
    g.add_argument("--cuda-graph-max-batch", type=int, default=EngineArgs.cuda_graph_max_batch,
                   help="largest decode batch captured as a CUDA graph (capped at "
                        "--max-num-seqs)")
    g.add_argument("--cuda-graph-max-tokens", type=int, default=None,
                   help="largest step holding a prefill that replays piecewise CUDA graphs "
                        "(default: --max-num-batched-tokens; 0: such steps run eagerly)")
    g.add_argument("--overlap-scheduling", choices=["auto", "on", "off"], default="auto",
                   help="plan step N+1 while step N runs (auto: on for one CUDA rank)")
    g.add_argument("--batch-invariant", action="store_true",
                   help="CUDA: a request's logits do not depend on what else shares its "
                        "steps (slower; docs/api.md)")
    g.add_argument("--admission-delay", type=float, default=0.05,
                   help="seconds a new request may wait, while CUDA-graph decodes run, for "
                        "others to share its prefill step (0: admit at once)")
    g.add_argument("--max-output-tokens", type=int, default=None,
                   help="largest max_tokens a request may ask (400 above it; default: "
                        "max_model_len)")
    g.add_argument("--structured-output-timeout", type=float, default=10.0,
                   help="seconds a response_format grammar may take to compile")
    g.add_argument("--tensor-parallel-startup-timeout", type=float, default=300.0,
                   help="seconds for every process to load and report ready")
    g.add_argument("--heartbeat-timeout", type=float, default=EngineArgs.heartbeat_timeout,
                   help="seconds a process may leave a heartbeat unanswered before /health and "
                   "/ready say 503 (raise it where one step can take longer)")
    g.add_argument("--tensor-parallel-shutdown-timeout", "--shutdown-timeout", type=float,
                   default=10.0,
                   help="seconds to drain and stop before SIGKILL")
    g.add_argument("--tensor-parallel-master-addr", default="127.0.0.1",
                   help="torch.distributed rendezvous address for the ranks")
    g.add_argument("--tensor-parallel-master-port", type=int, default=0,
                   help="torch.distributed rendezvous port (0: a free port)")
    g.add_argument("--tensor-parallel-rendezvous-dir", default=None,
                   help="parent directory for the private run directory (never removed)")
    g.add_argument("--nnodes", type=int, default=1, help="hosts the ranks span")
    g.add_argument("--node-rank", type=int, default=0,
                   help="this host's index; 0 runs the scheduler and HTTP, others only ranks")
    g.add_argument("--tensor-parallel-secret-file", default=None,
                   help="shared secret (same file on every host) authenticating remote ranks")
    g.add_argument("--no-tensor-parallel-supervisor", action="store_true",
                   help="this process is one rank started by an external launcher (torchrun): "
                        "RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT come from the environment")
    g.add_argument("--backend-options", type=json.loads, default=None,
                   help="JSON object of backend-specific options")
    g.add_argument("--chat-template", default=None, metavar="FILE",
                   help="a Jinja chat template replacing the checkpoint's (or the built-in) one")
    g.add_argument("--tool-call-parser", default=None, choices=["hermes", "qwen3_xml"],
                   help='the call syntax "tool_choice": "auto" parses on a template that '
                        "teaches none (default: the template's own; none: auto is refused)")
    lim = p.add_argument_group("request limits (docs/api.md \"Limits\")")
    lim.add_argument("--max-stop-strings", type=int, default=EngineArgs.max_stop_strings,
                     help="stop strings a request may hold")
    lim.add_argument("--max-stop-bytes", type=int, default=EngineArgs.max_stop_bytes,
                     help="all of a request's stop strings together, UTF-8")
    lim.add_argument("--max-prompt-chars", type=int, default=EngineArgs.max_prompt_chars,
                     help="a request's prompt text (all prompts, all message contents)")
    lim.add_argument("--max-json-depth", type=int, default=EngineArgs.max_json_depth,
                     help="nesting of a request body")


def engine_args_from(ns: argparse.Namespace) -> EngineArgs:
    """Every flag named like an EngineArgs field sets that field; the others are mapped here."""
    if getattr(ns, "no_tensor_parallel_supervisor", False):
        launched_rank(ns)
    mapped = dict(
        enable_prefix_caching=not ns.no_prefix_caching,
        enable_chunked_prefill=not ns.no_chunked_prefill, cuda_graphs=not ns.no_cuda_graphs,
        overlap_scheduling={"auto": None, "on": True, "off": False}[ns.overlap_scheduling],
        structured_output_timeout_s=ns.structured_output_timeout,
        startup_timeout=ns.tensor_parallel_startup_timeout,
        shutdown_timeout=ns.tensor_parallel_shutdown_timeout,
        master_addr=ns.tensor_parallel_master_addr, master_port=ns.tensor_parallel_master_port,
        rendezvous_dir=ns.tensor_parallel_rendezvous_dir,
        backend_options=ns.backend_options or {})
    same = {f.name: getattr(ns, f.name) for f in dataclasses.fields(EngineArgs)
            if f.name not in mapped and hasattr(ns, f.name)}
    return EngineArgs(**same, **mapped)


def launched_rank(ns: argparse.Namespace) -> None:
    """An external launcher started one process per rank: each is its own "host" of one
    rank, and rank 0 also runs the control plane and HTTP (the multi-host machinery)."""
    env = os.environ
    missing = [k for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if k not in env]
    if missing:
        raise SystemExit(f"--no-tensor-parallel-supervisor needs {', '.join(missing)} in the "
                         "environment (set by torchrun or your launcher)")
    world = int(env["WORLD_SIZE"])
    if ns.tensor_parallel_size not in (1, world):
        raise SystemExit(f"--tensor-parallel-size {ns.tensor_parallel_size} disagrees with "
                         f"WORLD_SIZE={world}")
    ns.tensor_parallel_size = ns.nnodes = world
    ns.node_rank = int(env["RANK"])
    ns.tensor_parallel_master_addr = env["MASTER_ADDR"]
    ns.tensor_parallel_master_port = int(env["MASTER_PORT"])


def port_number(text: str) -> int:
    """A TCP port, refused at parse time (a port past 65535 would wrap around silently)."""
    try:
        port = int(text)
    except ValueError:
        port = -1
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"{text!r} is not a port number (0 to 65535)")
    return port


def cmd_serve(ns: argparse.Namespace) -> int:
    from .server.serve import ServeOptions, serve

    if ns.model_arg is not None:
        if ns.model is not None and ns.model != ns.model_arg:
            print(f"pocketllm: error: two models given: {ns.model_arg!r} and --model "
                  f"{ns.model!r}", file=sys.stderr)
            return 2
        ns.model = ns.model_arg

    logging.basicConfig(level=ns.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    opts = ServeOptions(host=ns.host, port=ns.port, served_model_name=ns.served_model_name,
                        api_key=ns.api_key or os.environ.get("POCKETLLM_API_KEY"),
                        request_timeout=ns.request_timeout, max_body_bytes=ns.max_body_bytes,
                        keepalive_timeout=ns.keepalive_timeout, header_timeout=ns.header_timeout,
                        body_timeout=ns.body_timeout, max_connections=ns.max_connections,
                        allowed_origins=tuple(ns.allowed_origins or ()),
                        access_log=not ns.no_access_log,
                        admission=admission_limits_from(ns))
    return serve(engine_args_from(ns), opts)


def cmd_download(ns: argparse.Namespace) -> int:
    """Resolve and fetch; one line and exit 1 on failure (as ``serve`` fails)."""
    from .hub import looks_local, resolve

    logging.basicConfig(level="INFO", format="%(message)s")
    if looks_local(ns.model):
        print(os.path.abspath(os.path.expanduser(ns.model)))
        return 0
    try:
        resolved = resolve(ns.model, ns.revision)
    except PocketLLMError as e:
        print(f"pocketllm: error: {e}", file=sys.stderr)
        return 1
    print(resolved.path)
    return 0


def admission_limits_from(ns: argparse.Namespace):
    from .server.admission import AdmissionLimits

    if ns.request_timeout < 0:
        raise SystemExit("--request-timeout must be >= 0 (0: no deadline)")
    return AdmissionLimits(max_requests=ns.max_requests, max_choices=ns.max_choices,
                           max_client_requests=ns.max_requests_per_client,
                           max_client_choices=ns.max_choices_per_client)


def cmd_generate(ns: argparse.Namespace) -> int:
    from . import LLM, SamplingParams

    sp = SamplingParams(max_tokens=ns.max_tokens, temperature=ns.temperature, seed=ns.sample_seed)
    with LLM(engine_args_from(ns)) as llm:
        if ns.chat:
            stream = llm.chat_stream([{"role": "user", "content": ns.prompt}], sp)
        else:
            stream = llm.generate_stream(ns.prompt, sp)
        for event in stream:
            print(event.text, end="", flush=True)
            if event.finished:
                print(f"\n[finish_reason={event.finish_reason} usage={event.usage.as_dict()}]",
                      file=sys.stderr)
    return 0


def cmd_chat(ns: argparse.Namespace) -> int:
    from . import SamplingParams
    from .chat_repl import run_chat

    sp = SamplingParams(max_tokens=ns.max_tokens, temperature=ns.temperature, seed=ns.sample_seed)
    return run_chat(engine_args_from(ns), sp, ns.system)


def build_parser() -> argparse.ArgumentParser:
    from .server.admission import AdmissionLimits as AdmissionDefaults

    parser = argparse.ArgumentParser(prog="pocketllm", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    srv = sub.add_parser("serve", help="the OpenAI-compatible HTTP server",
                         formatter_class=HelpWithDefaults)
    srv.add_argument("model_arg", nargs="?", default=None, metavar="MODEL",
                     help="the same as --model")
    add_engine_args(srv)
    srv.add_argument("--host", default="127.0.0.1", help="address to listen on")
    srv.add_argument("--port", type=port_number, default=8000,
                     help="port to listen on (0: any free port)")
    srv.add_argument("--served-model-name", default=None,
                     help="the model id clients send and /v1/models shows (default: the "
                          "Hugging Face id as given, or the checkpoint's file or directory "
                          "name)")
    srv.add_argument("--api-key", default=None,
                     help="require 'Authorization: Bearer KEY' on /v1/* (or POCKETLLM_API_KEY)")
    srv.add_argument("--request-timeout", type=float, default=600.0,
                     help="per-request deadline in seconds (504, or fewer choices, when hit); "
                          "0: none")
    lim = AdmissionDefaults()
    srv.add_argument("--max-requests", type=int, default=lim.max_requests,
                     help="requests the server holds at once (queued or running); beyond: 429")
    srv.add_argument("--max-choices", type=int, default=lim.max_choices,
                     help="choices (n x prompts x best_of) the server holds at once; beyond: 429")
    srv.add_argument("--max-requests-per-client", type=int, default=lim.max_client_requests,
                     help="requests one client (address, plus API key) holds at once")
    srv.add_argument("--max-choices-per-client", type=int, default=lim.max_client_choices,
                     help="choices one client holds at once")
    srv.add_argument("--max-body-bytes", type=int, default=8 << 20,
                     help="larger request bodies get a 413")
    srv.add_argument("--keepalive-timeout", type=float, default=15.0,
                     help="seconds a connection may stay idle without a complete request head")
    srv.add_argument("--header-timeout", type=float, default=10.0,
                     help="seconds from a request head's first byte to its end")
    srv.add_argument("--body-timeout", type=float, default=60.0,
                     help="seconds for a request's whole body to arrive (else 408)")
    srv.add_argument("--max-connections", type=int, default=None,
                     help="open connections at once (default and ceiling: the file descriptor "
                     "limit, raised to its hard limit, less 256)")
    srv.add_argument("--log-level", default="info", help="log level of the server's logs",
                     choices=["debug", "info", "warning", "error", "critical"])
    srv.add_argument("--allowed-origins", nargs="+", default=None, metavar="ORIGIN",
                     help="answer CORS (preflights included) for these browser origins, e.g. "
                          "http://localhost:3000, or * for any (default: CORS off)")
    srv.add_argument("--no-access-log", action="store_true",
                     help="do not log one line per request (logger pocketllm.access)")
    srv.set_defaults(func=cmd_serve)

    gen = sub.add_parser("generate", help="generate from one prompt, streaming to stdout",
                         formatter_class=HelpWithDefaults)
    add_engine_args(gen)
    gen.add_argument("prompt", help="the prompt text")
    gen.add_argument("--chat", action="store_true", help="send the prompt as a user message")
    add_sampling_args(gen)
    gen.set_defaults(func=cmd_generate)

    chat = sub.add_parser("chat", help="chat interactively, streaming each answer (/exit or "
                          "Ctrl-D quits)", formatter_class=HelpWithDefaults)
    add_engine_args(chat)
    chat.add_argument("--system", default=None, help="a system message opening the conversation")
    add_sampling_args(chat)
    chat.set_defaults(func=cmd_chat)

    dl = sub.add_parser("download", help="fetch a Hugging Face model (org/name, or "
                        "org/name-GGUF:QUANT) into the Hugging Face cache without serving it; "
                        "prints the local path", formatter_class=HelpWithDefaults)
    dl.add_argument("model", help="org/name[:QUANT] (a local path is printed as it is)")
    dl.add_argument("--revision", default=None, help="branch, tag or commit (default: main)")
    dl.set_defaults(func=cmd_download)

    from .bench.cli import add_bench_parsers

    add_bench_parsers(sub)
    return parser


def main(argv: Optional[list[str]] = None) -> int:
    ns = build_parser().parse_args(argv)
    try:
        return ns.func(ns)
    except PocketLLMError as e:
        print(f"pocketllm: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
