"""EngineArgs: every engine setting in one typed place, with validation and env bridging."""

from __future__ import annotations

import dataclasses
import json
import os
import re
from dataclasses import dataclass, field
from typing import Any, Optional

from .errors import InvalidRequestError, UnsupportedFeatureError

BACKENDS = ("auto", "torch")
LOAD_FORMATS = ("auto", "safetensors", "gguf", "dummy")
DTYPES = ("auto", "float32", "float16", "bfloat16")
DEVICES = ("auto", "cpu", "cuda")
TOOL_CALL_PARSERS = ("hermes", "qwen3_xml")
# Dummy weights in GGUF block types (workers/loader/dummy_blocks.py): one type, or a mix
QUANTIZATIONS = ("q4_0", "q4_1", "q5_0", "q5_1", "q8_0", "q2_k", "q3_k", "q4_k", "q5_k", "q6_k",
                 "iq4_nl", "iq4_xs", "q4_k_m", "q5_k_m")
# Any float checkpoint (or dummy weights) quantized at load to e4m3 with row scales, on a
# GPU with FP8 tensor cores (workers/loader/stored_types.py)
FP8_QUANTIZATION = "fp8"
# The KV cache's element type: the model dtype, or e4m3 with a scale per position and KV
# head on the GPU path (workers/kernels/kv_fp8.py)
KV_CACHE_DTYPES = ("auto", "fp8")
# Speculative decoding (docs/speculative.md): drafts proposed by n-gram lookup in the
# scheduler, by a smaller model of the same vocabulary that the worker runs
# (``speculative_model``) or by the checkpoint's multi-token-prediction layer ("mtp"),
# verified by the worker in one multi-token step. "replay" (benchmarks only) proposes a
# recorded output read from ``speculative_replay``.
SPECULATIVE_METHODS = ("ngram", "draft", "mtp", "replay")
MAX_SPECULATIVE_TOKENS = 16
DEFAULT_SPECULATIVE_TOKENS = 4
# The largest batch of decodes that drafts at all: past it a step is better spent on more
# requests than on more tokens of a few (the scheduler's default; the GPU worker's verify
# graphs stop there).
SPECULATIVE_MAX_BATCH = 4
BACKEND_OPTIONS = {"eos_token_id"}  # every key the torch backend reads


@dataclass
class EngineArgs:
    """Engine settings. ``model=None`` serves the embedded Gemma 3 270M GGUF."""

    model: Optional[str] = None
    tokenizer: Optional[str] = None  # defaults to the model's own
    # A Hugging Face id's branch, tag or commit (pocketllm/hub.py); None: main
    revision: Optional[str] = None
    served_model_name: Optional[str] = None
    backend: str = "auto"
    load_format: str = "auto"
    # load_format="dummy" only: random weights in these GGUF block types (QUANTIZATIONS);
    # or "fp8": any float checkpoint's linear weights held in e4m3 on the GPU
    quantization: Optional[str] = None
    # Expand every GGUF block weight to the float dtype at load (the reference numerics of
    # float products; ~4x the memory): on a CPU the torch worker serves, not the torch-free
    # worker that computes on the blocks (docs/cpu_kernels.md); on a GPU no layer keeps
    # its blocks (docs/gpu_kernels.md).
    dequantize_weights: bool = False
    dtype: str = "auto"
    device: str = "auto"
    tensor_parallel_size: int = 1
    max_model_len: Optional[int] = None  # default: the checkpoint's context length, capped
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048  # per-step token budget (chunked prefill size)
    block_size: int = 16
    num_kv_blocks: Optional[int] = None  # explicit KV budget in blocks
    kv_cache_memory_gb: Optional[float] = None  # explicit KV budget in GiB
    gpu_memory_utilization: float = 0.90  # share of free device memory for KV on CUDA
    kv_cache_dtype: str = "auto"  # KV_CACHE_DTYPES
    speculative_method: Optional[str] = None  # SPECULATIVE_METHODS; None: no speculation
    # most drafts a request verifies in one step (None: DEFAULT_SPECULATIVE_TOKENS where
    # speculating; without a method it would change nothing, so it is refused)
    num_speculative_tokens: Optional[int] = None
    # "replay"'s file, or the tokens put in the worker drafter's proposals (scheduler/replay.py)
    speculative_replay: Optional[str] = None
    # "draft"'s model: a local path, a shipped shape (dummy weights) or a Hugging Face id
    speculative_model: Optional[str] = None
    cpu_kv_cache_fraction: float = 0.10  # share of available RAM for KV on CPU (capped at 4 GiB)
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    cuda_graphs: bool = True  # decode steps replay CUDA graphs on GPU; False: eager launches
    cuda_graph_max_batch: int = 512  # largest captured decode batch (capped at max_num_seqs)
    # Largest step holding a prefill that replays piecewise CUDA graphs (capped at
    # max_num_batched_tokens); None: max_num_batched_tokens; 0: such steps run eagerly.
    cuda_graph_max_tokens: Optional[int] = None
    # Seconds a new request may wait, while CUDA-graph decodes run, for others to share its
    # prefill step (0: admit at once); see docs/architecture.md "Admission batching".
    admission_delay: float = 0.05
    # Plan step N+1 while step N runs. None: on for one CUDA rank (the only place it pays).
    overlap_scheduling: Optional[bool] = None
    # CUDA: a request's logits do not depend on what else shares its steps (kernel choices
    # fixed per row; slower). See docs/api.md "Batch-invariant mode".
    batch_invariant: bool = False
    seed: int = 0
    # Constrained decoding: a grammar that takes longer to compile fails its request (400).
    structured_output_timeout_s: float = 10.0
    # The largest max_tokens a request may ask (a 400 above it); None: max_model_len.
    max_output_tokens: Optional[int] = None
    startup_timeout: float = 300.0  # seconds for every process to report ready
    shutdown_timeout: float = 10.0  # seconds between SIGTERM and SIGKILL (and the HTTP drain)
    # Seconds a process may leave a heartbeat unanswered before /health and /ready say 503.
    heartbeat_timeout: float = 10.0
    rendezvous_dir: Optional[str] = None  # parent of the private run directory (never removed)
    master_addr: str = "127.0.0.1"  # torch.distributed rendezvous for tensor-parallel ranks
    master_port: int = 0  # 0: a free port chosen at startup
    nnodes: int = 1  # hosts the tensor-parallel ranks span
    node_rank: int = 0  # this host's index; host 0 runs the scheduler and the HTTP server
    tensor_parallel_secret_file: Optional[str] = None  # shared secret for ranks on other hosts
    backend_options: dict[str, Any] = field(default_factory=dict)
    # What one request may hold (pocketllm/protocol/limits.py; docs/api.md "Limits").
    max_stop_strings: int = 32
    max_stop_bytes: int = 4096
    max_prompt_chars: int = 1_000_000
    max_json_depth: int = 64
    chat_template: Optional[str] = None  # a Jinja file replacing the checkpoint's template
    # The call syntax "tool_choice": "auto" parses on a template that teaches none.
    tool_call_parser: Optional[str] = None

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        if self.backend == "cpp":
            raise UnsupportedFeatureError(
                "backend='cpp' is not available: PocketLLM ships only the torch backend "
                "(the native C++ engine is archived). Use backend='torch' or 'auto'.")
        _choice("backend", self.backend, BACKENDS, UnsupportedFeatureError)
        _choice("load_format", self.load_format, LOAD_FORMATS)
        if self.quantization is not None:
            _choice("quantization", self.quantization, QUANTIZATIONS + (FP8_QUANTIZATION,))
            if self.load_format == "gguf" and self.quantization == FP8_QUANTIZATION:
                raise UnsupportedFeatureError(
                    "quantization=fp8 quantizes a float checkpoint: a GGUF file is served in "
                    "the types it stores", "quantization")
            if self.load_format != "dummy" and self.quantization != FP8_QUANTIZATION:
                raise UnsupportedFeatureError(
                    "GGUF block types apply to dummy weights (load_format='dummy'): a GGUF "
                    "file is served in the types it stores, and a safetensors checkpoint is "
                    "quantized at load only to fp8", "quantization")
            if self.dequantize_weights:
                raise UnsupportedFeatureError(
                    "quantization with dequantize_weights: weights quantized and expanded at "
                    "load are plain float weights; drop one of the two", "quantization")
        if self.revision is not None and (not isinstance(self.revision, str)
                                          or not re.fullmatch(r"[\w./-]{1,256}", self.revision)):
            raise InvalidRequestError("revision must name a branch, tag or commit (letters, "
                                      "digits, '.', '_', '-', '/')", "revision")
        _choice("dtype", self.dtype, DTYPES)
        _choice("kv_cache_dtype", self.kv_cache_dtype, KV_CACHE_DTYPES)
        if self.speculative_method is not None:
            _choice("speculative_method", self.speculative_method, SPECULATIVE_METHODS)
        if self.speculative_method == "replay" and self.speculative_replay is None:
            raise InvalidRequestError("speculative_method='replay' proposes a recorded output: "
                                      "speculative_replay names its file", "speculative_replay")
        if self.speculative_replay is not None and self.speculative_method not in (
                "replay", "draft", "mtp"):
            raise InvalidRequestError("speculative_replay (a recorded output, benchmarks only) "
                                      "is proposed by speculative_method='replay', or put in "
                                      "place of the tokens 'draft' or 'mtp' propose",
                                      "speculative_replay")
        if (self.speculative_method == "draft") != (self.speculative_model is not None):
            raise InvalidRequestError("speculative_method='draft' and speculative_model (the "
                                      "draft model) go together", "speculative_model")
        if self.speculative_model is not None and (
                not isinstance(self.speculative_model, str) or not self.speculative_model):
            raise InvalidRequestError("speculative_model must name a model", "speculative_model")
        if self.speculative_method is None:
            if self.num_speculative_tokens is not None:
                raise InvalidRequestError("num_speculative_tokens without speculative_method "
                                          "would change nothing: no request drafts",
                                          "num_speculative_tokens")
        elif self.num_speculative_tokens is None:
            self.num_speculative_tokens = DEFAULT_SPECULATIVE_TOKENS
        elif (isinstance(self.num_speculative_tokens, bool)
                or not isinstance(self.num_speculative_tokens, int)
                or not 1 <= self.num_speculative_tokens <= MAX_SPECULATIVE_TOKENS):
            raise InvalidRequestError(f"num_speculative_tokens must be an integer in 1.."
                                      f"{MAX_SPECULATIVE_TOKENS}", "num_speculative_tokens")
        _choice("device", self.device, DEVICES)
        # Whether the model's heads split across this many ranks is the worker's check.
        if not isinstance(self.tensor_parallel_size, int) or self.tensor_parallel_size < 1:
            raise InvalidRequestError("tensor_parallel_size must be a positive integer",
                                      "tensor_parallel_size")
        for name in ("max_num_seqs", "max_num_batched_tokens", "block_size",
                     "cuda_graph_max_batch"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise InvalidRequestError(f"{name} must be a positive integer", name)
        for name, least, what in (("cuda_graph_max_tokens", 0, "a non-negative"),
                                  ("max_output_tokens", 1, "a positive")):  # None: the default
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value < least):
                raise InvalidRequestError(f"{name} must be {what} integer", name)
        if self.max_model_len is not None and self.max_model_len < 1:
            raise InvalidRequestError("max_model_len must be a positive integer", "max_model_len")
        for name in ("startup_timeout", "shutdown_timeout", "structured_output_timeout_s",
                     "heartbeat_timeout"):
            if getattr(self, name) <= 0:
                raise InvalidRequestError(f"{name} must be positive", name)
        if not 0 <= self.master_port < 65535:
            raise InvalidRequestError("master_port must be in 0..65534", "master_port")
        if not isinstance(self.nnodes, int) or self.nnodes < 1 or not (
                0 <= self.node_rank < self.nnodes):
            raise InvalidRequestError("nnodes must be >= 1 and node_rank in 0..nnodes-1",
                                      "node_rank")
        if self.batch_invariant and self.tensor_parallel_size > 1:
            raise UnsupportedFeatureError(
                "batch_invariant with tensor parallelism is not supported: an all-reduce's "
                "summation order follows the message size", "batch_invariant")
        if self.nnodes > 1:
            if self.tensor_parallel_size % self.nnodes:
                raise InvalidRequestError(
                    f"tensor_parallel_size={self.tensor_parallel_size} must be a multiple of "
                    f"nnodes={self.nnodes} (the same number of ranks on every host)", "nnodes")
            if self.master_port == 0:
                raise InvalidRequestError(
                    "ranks on several hosts need an explicit master_port (the same on every "
                    "host); the plan link uses master_port + 1", "master_port")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise InvalidRequestError("num_kv_blocks must be a positive integer", "num_kv_blocks")
        if self.kv_cache_memory_gb is not None and self.kv_cache_memory_gb <= 0:
            raise InvalidRequestError("kv_cache_memory_gb must be positive", "kv_cache_memory_gb")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise InvalidRequestError("gpu_memory_utilization must be in (0, 1]",
                                      "gpu_memory_utilization")
        from .protocol.limits import validate_settings

        validate_settings(self.__dict__)
        if self.tool_call_parser is not None:
            _choice("tool_call_parser", self.tool_call_parser, TOOL_CALL_PARSERS)
        unknown = sorted(set(self.backend_options) - BACKEND_OPTIONS)
        if unknown:
            raise InvalidRequestError(
                f"backend_options key {unknown[0]!r} is not one this engine acts on; "
                f"known: {', '.join(sorted(BACKEND_OPTIONS))}", "backend_options")
        eos = self.backend_options.get("eos_token_id")
        if eos is not None and not (isinstance(eos, int) and not isinstance(eos, bool)) and not (
                isinstance(eos, list) and eos and all(isinstance(e, int) for e in eos)):
            raise InvalidRequestError(
                "backend_options['eos_token_id'] must be an integer or a list of integers",
                "backend_options")

    @classmethod
    def from_env(cls, environ: Optional[dict] = None, **overrides: Any) -> "EngineArgs":
        """Build from ``POCKETLLM_<FIELD>`` variables; explicit ``overrides`` win."""
        env = os.environ if environ is None else environ
        values: dict[str, Any] = {}
        for f in dataclasses.fields(cls):
            raw = env.get("POCKETLLM_" + f.name.upper())
            if raw is None:
                continue
            values[f.name] = _parse_env(f.name, f.type, raw)
        values.update(overrides)
        return cls(**values)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def without_speculation(self, **changes: Any) -> "EngineArgs":
        """These settings with every speculative one dropped, and ``changes``: an engine
        derived from a speculating one that drafts nothing itself (a draft model's own
        settings, a benchmark's engine without speculation)."""
        return dataclasses.replace(self, speculative_method=None, speculative_model=None,
                                   speculative_replay=None, num_speculative_tokens=None,
                                   **changes)


def _choice(name: str, value: Any, allowed: tuple, exc: type = InvalidRequestError) -> None:
    if value not in allowed:
        msg = f"{name}={value!r} is not supported; choose one of {', '.join(allowed)}"
        raise exc(msg) if exc is UnsupportedFeatureError else exc(msg, name)


def _parse_env(name: str, typ: Any, raw: str) -> Any:
    t = str(typ)
    try:
        if name == "backend_options":
            value = json.loads(raw)
            if not isinstance(value, dict):
                raise ValueError("not a JSON object")
            return value
        if "bool" in t:
            if raw.lower() in ("1", "true", "yes", "on"):
                return True
            if raw.lower() in ("0", "false", "no", "off"):
                return False
            raise ValueError("not a boolean")
        if "int" in t:
            return int(raw)
        if "float" in t:
            return float(raw)
    except ValueError as e:
        raise InvalidRequestError(f"POCKETLLM_{name.upper()}={raw!r}: {e}", name) from None
    return raw


def cpu_thread_count() -> int:
    """The CPU threads a worker computes with: POCKETLLM_NUM_THREADS or OMP_NUM_THREADS if
    the user pinned a count, else every core this process may run on. (The bench's peers
    run with the same count.)"""
    pinned = os.environ.get("POCKETLLM_NUM_THREADS") or os.environ.get("OMP_NUM_THREADS")
    if pinned:
        return max(1, int(pinned))
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1
