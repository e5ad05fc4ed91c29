"""Every message that crosses a socket between PocketLLM processes.

Rules: each message is a tagged ``msgspec.Struct``; a socket decodes the union
of the messages it may receive (see ``codec.py``). A new request's full data
travels once; later steps carry only what changed. Nothing here imports the
rest of the project, so every stage can share it.
"""

from __future__ import annotations

import enum
from typing import Optional, Union

import msgspec

# 2: per-group block tables (cache groups); 3: speculative drafts; 4: drafts the worker proposes
PROTOCOL_VERSION = 4


class _Msg(msgspec.Struct, tag=True, omit_defaults=True, array_like=False):
    pass


class ErrorKind(enum.StrEnum):
    """Why a request failed: whichever stage found it says which, and the frontend maps
    each kind to one exception class and one HTTP status (pocketllm/errors.py)."""

    invalid_request = "invalid_request"  # the input is malformed or out of range
    too_long = "too_long"  # the prompt (plus its budget) can never fit
    unsupported = "unsupported"  # a feature this engine or checkpoint does not have
    not_found = "not_found"  # no such active request (cancellation)
    conflict = "conflict"  # the request id is already in use
    rate_limited = "rate_limited"  # over an admission limit: retry later
    timeout = "timeout"  # the request's deadline passed
    internal = "internal"  # the engine failed (not the input's fault)
    engine_dead = "engine_dead"  # a process of the engine died


class ErrorDetail(msgspec.Struct, array_like=True, omit_defaults=True):
    """A request's failure, carried on its last TokenDelta and RequestOutput."""

    kind: ErrorKind
    message: str
    param: Optional[str] = None


# ---------------------------------------------------------------- requests


class StructuredSpec(msgspec.Struct, omit_defaults=True):
    """A grammar the generated text must match; the scheduler compiles it (xgrammar)."""

    kind: str  # "json_object" | "json_schema" | "regex" | "grammar" (EBNF/GBNF) | "structural_tag"
    value: str = ""  # the schema, pattern, grammar or structural-tag JSON, as text
    # The request field a refusal names (a bad or too slow grammar): tool_choice grammars set theirs.
    param: str = "response_format"


class SamplingSpec(msgspec.Struct, omit_defaults=True):
    """The sampling and termination settings of one request, already validated."""

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    min_p: float = 0.0
    seed: Optional[int] = None
    ignore_eos: bool = False
    stop: list[str] = []
    stop_token_ids: list[int] = []
    logprobs: Optional[int] = None  # None = not asked; 0 = sampled token only
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    # Penalties and bias act on the sampling logits only (logprobs stay raw).
    frequency_penalty: float = 0.0  # OpenAI: times the token's count in the output
    presence_penalty: float = 0.0  # OpenAI: once if the token is in the output
    repetition_penalty: float = 1.0  # HF/CTRL: divides (or multiplies) over prompt + output
    logit_bias: dict[int, float] = {}  # token id -> added to its logit
    structured: Optional[StructuredSpec] = None  # response_format / tool_choice grammar


class OutputSplit(msgspec.Struct, omit_defaults=True):
    """How the detokenizer splits a chat answer into reasoning, content and tool calls.

    The tokenizer stage fills it from the chat template and the request; a
    request without it (completions, or a template that teaches neither) is
    plain content.
    """

    reasoning_start_id: Optional[int] = None  # e.g. <think>
    reasoning_end_id: Optional[int] = None  # e.g. </think>: the block ends on this token id
    in_reasoning: bool = False  # the prompt already opened the block
    drop_reasoning: bool = False  # drop_thinking: generate the block, return none of it
    tool_parser: Optional[str] = None  # "hermes" | "qwen3_xml"; None = calls stay content
    tools: Optional[list[dict]] = None  # the request's tools: they type the arguments


class GenerateRequest(_Msg):
    """frontend -> tokenizer: one request as the caller wrote it."""

    request_id: str
    sampling: SamplingSpec
    prompt: Optional[str] = None
    prompt_token_ids: Optional[list[int]] = None
    messages: Optional[list[dict]] = None  # chat: normalized messages
    chat_options: dict = {}  # add_generation_prompt, tools, reasoning_effort, ...
    arrival_time: float = 0.0
    echo: bool = False  # completions `echo`: the answer's text starts with the prompt's
    client: str = ""  # who sent it (the server's tag); the scheduler is fair across clients


class DetokRequest(msgspec.Struct, array_like=True):
    """What the detokenizer needs of a request: built by the tokenizer stage, carried
    unread by the scheduler inside ``TokenizedRequest.detok``, and handed on (in a
    ``TokenBatch``) before the request's first tokens."""

    request_id: str
    prompt_len: int
    sampling: SamplingSpec
    split: Optional[OutputSplit] = None
    echo_text: str = ""  # `echo`: prepended to the request's first output text


class TokenizedRequest(_Msg):
    """tokenizer -> scheduler: a validated, tokenized request."""

    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingSpec
    eos_token_ids: list[int] = []
    arrival_time: float = 0.0
    client: str = ""  # GenerateRequest.client
    detok: Optional[DetokRequest] = None  # None: the plain one (no split, no echo)

    def __post_init__(self):
        if self.detok is None:
            self.detok = DetokRequest(self.request_id, len(self.prompt_token_ids), self.sampling)


class Abort(_Msg):
    """frontend -> scheduler: stop computing these requests; each ends with "abort"."""

    request_ids: list[str]


class StopMatched(_Msg):
    """detokenizer -> scheduler: these requests ended downstream (a stop string matched, or
    their output failed there); stop computing them, without a final delta."""

    request_ids: list[str]


# ---------------------------------------------------------------- worker


class NewRequestData(msgspec.Struct, array_like=True):
    """The first time a rank sees a request (or sees it again after preemption)."""

    request_id: str
    token_ids: list[int]  # every token known so far (prompt + generated)
    # One block table per cache group (WorkerCapabilities.cache_groups), all of one length:
    # entry i holds positions [i * block_size, (i + 1) * block_size). NULL_BLOCK: a block
    # outside a sliding window, never read.
    block_ids: list[list[int]]
    num_computed_tokens: int
    sampling: SamplingSpec


# In a block table: no block (the positions lie wholly before a sliding window: the
# scheduler freed it, or never gave one). A worker never reads such an entry.
NULL_BLOCK = -1

# In new_token_ids: "the token you sampled for this request in the previous step", which
# the scheduler does not know yet when it plans a step while the previous one runs.
PENDING = -1


class CachedRequestData(msgspec.Struct, array_like=True):
    """A request the rank already holds: only what changed since the last step."""

    request_id: str
    new_token_ids: list[int]  # tokens sampled since the rank last saw it (last may be PENDING)
    new_block_ids: list[list[int]]  # per cache group: the entries appended to its table
    num_computed_tokens: int


class StepPlan(_Msg):
    """scheduler -> every rank: what to compute in one forward step.

    ``num_scheduled_tokens[i]`` belongs to the i-th request of
    ``new_requests + cached_requests``. A request samples a token when its
    scheduled tokens reach the end of its known tokens.
    """

    step_id: int
    new_requests: list[NewRequestData] = []
    cached_requests: list[CachedRequestData] = []
    num_scheduled_tokens: list[int] = []
    finished_request_ids: list[str] = []  # ranks drop their state for these
    # The scheduler sends the next plan without waiting for this step's result: launch it
    # before returning this step's tokens (its inputs may be PENDING tokens sampled here).
    next_follows: bool = False
    # Constrained decoding: one bitmask row per listed request, each of which samples in this
    # step; rows are packed int32 words (bit j of word w allows token 32*w + j, xgrammar's
    # layout), ceil(vocab_size / 32) words per row. Empty when no request is structured.
    structured_request_ids: list[str] = []
    structured_bitmask: bytes = b""
    # Recurrent-state snapshots (a "state" cache group; pocketllm/scheduler/kv_groups.py).
    # state_copies_before: [group, source slot, destination slot] copies of every layer's
    # states in that group, done before this step's forward (a prefix hit's snapshot into
    # its request's slot). state_snapshots: [group, slot, snapshot slot, position]: the
    # states of the request computing in `slot` once its positions below `position` are
    # in (a block boundary inside or at the end of its chunk in this step), copied into
    # the snapshot slot during the forward, so a snapshot never cuts a prompt's chunk.
    state_copies_before: list[list[int]] = []
    state_snapshots: list[list[int]] = []
    # Speculative decoding: per request of the plan (its order), the draft tokens it
    # verifies in this step ([] for most). Drafts follow the request's known tokens: they
    # are counted in num_scheduled_tokens, computed at the positions after its last known
    # token, and sample there too; the worker keeps none of them (the next plan carries
    # the tokens that were accepted).
    draft_token_ids: list[list[int]] = []
    # Drafts the worker proposes (a draft model it runs): per request of the plan, how many
    # tokens to propose after this step's tokens (0 for most), for the next step to verify.
    # The scheduler gave the request blocks for the positions the proposing writes.
    propose_token_counts: list[int] = []


class TokenLogprobs(msgspec.Struct, array_like=True):
    """Log probability of the sampled token and the top alternatives, raw logits."""

    logprob: float
    top_token_ids: list[int] = []
    top_logprobs: list[float] = []


class StepResult(_Msg):
    """rank 0 -> scheduler: one sampled token per request that reached its end; a request
    that verified drafts may add more (``extra_token_ids``: its accepted drafts after the
    first, then the token sampled after the last accepted one)."""

    step_id: int
    request_ids: list[str] = []
    token_ids: list[int] = []
    logprobs: list[Optional[TokenLogprobs]] = []
    # per request id, the tokens after token_ids[i] and their logprobs (empty: none)
    extra_token_ids: list[list[int]] = []
    extra_logprobs: list[list[Optional[TokenLogprobs]]] = []
    # per request id, the drafts proposed to follow its tokens (StepPlan.propose_token_counts)
    proposed_token_ids: list[list[int]] = []
    error: Optional[str] = None  # a failed forward: the scheduler fails the step
    path: str = ""  # how the forward ran: one of STEP_PATHS ("": nothing to compute)
    launch_ms: float = 0.0  # host time to queue the step (on the CPU: to compute it)
    # CUDA, by path: from the first kernel to the last of this step and of earlier ones
    # that sampled nothing (not waited for then), gaps included
    device_ms: dict[str, float] = {}


# A step's forward replayed a decode CUDA graph, replayed piecewise graphs around eager
# attention, or ran eagerly.
STEP_PATHS = ("graph", "piecewise", "eager")


class CacheSpec(msgspec.Struct, frozen=True, omit_defaults=True):
    """What one attention layer keeps per token, as the scheduler must manage it.

    ``kind``: "full" (every position, for the whole sequence) or "sliding" (only the last
    ``window`` positions are ever read: blocks wholly before them can be freed) or "mla"
    (multi-head latent attention: one compressed latent + rope key per position, a pool
    of its own width with full attention's block rules) or "state" (a recurrent state of
    fixed size per sequence, not per position: one slot of the group's pool per request,
    pocketllm/scheduler/kv_groups.py)."""

    kind: str = "full"
    window: int = 0  # sliding: the positions one query attends to (its own included)


class CacheGroup(msgspec.Struct, omit_defaults=True):
    """Layers of one ``CacheSpec`` share a block pool and a block table per request."""

    spec: CacheSpec
    num_blocks: int  # this group's pool (each block holds block_size positions of each layer)
    num_layers: int = 0


class WorkerCapabilities(msgspec.Struct, omit_defaults=True):
    """What the data plane declares once, at the handshake."""

    device: str
    dtype: str
    architecture: str
    block_size: int
    num_kv_blocks: int  # the first cache group's (full attention's when there is one)
    max_num_seqs: int
    max_model_len: int
    vocab_size: int
    tensor_parallel_size: int = 1
    chunked_prefill: bool = True
    paged_kv: bool = True
    prefix_caching: bool = True
    continuous_batching: bool = True
    max_logprobs: int = 20
    load_seconds: float = 0.0
    attention_backend: str = "TorchAttention"  # or "TritonAttention" (CUDA)
    cuda_graph_batch_sizes: list[int] = []  # decode batches replayed as CUDA graphs
    batch_invariant: bool = False  # logits independent of the rest of the batch (CUDA)
    weight_bytes: int = 0  # rank 0's weights one decode step reads (CausalLM.step_read_bytes)
    # a sequence's recurrent state (linear-attention layers) a decode step reads and writes
    state_step_bytes: int = 0
    # The KV cache groups, full attention first; empty: one full group of num_kv_blocks.
    cache_groups: list[CacheGroup] = []
    # Speculative decoding the worker verifies: its method ("" none) and the most drafts a
    # request may bring to one step.
    speculative_method: str = ""
    num_speculative_tokens: int = 0
    # the most rows a step that verifies drafts may hold (0: any): the CPU worker's rows
    # computed exactly as alone, the GPU worker's verification graphs' (docs/speculative.md)
    speculative_max_rows: int = 0


class WorkerReady(_Msg):
    rank: int
    capabilities: WorkerCapabilities
    protocol_version: int = PROTOCOL_VERSION


# ---------------------------------------------------------------- detokenizer


class TokenDelta(msgspec.Struct, array_like=True):
    request_id: str
    token_ids: list[int]
    logprobs: list[Optional[TokenLogprobs]] = []
    finish_reason: Optional[str] = None  # "stop" | "length" | "abort" | "error"
    num_cached_tokens: int = 0
    error: Optional[ErrorDetail] = None  # finish_reason "error": why
    # An EOS or stop token that ended the request: generated (counted in usage), never shown.
    num_hidden_tokens: int = 0


class TokenBatch(_Msg):
    """scheduler -> detokenizer: every token produced in one step."""

    new_requests: list[DetokRequest] = []
    deltas: list[TokenDelta] = []


# ---------------------------------------------------------------- frontend


class LogprobEntry(msgspec.Struct, array_like=True):
    token_id: int
    token: str
    bytes: list[int]
    logprob: float
    top: list["LogprobEntry"] = []


class Usage(msgspec.Struct):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens

    def as_dict(self) -> dict:
        """The OpenAI ``usage`` object."""
        return {"prompt_tokens": self.prompt_tokens,
                "completion_tokens": self.completion_tokens,
                "total_tokens": self.total_tokens,
                "prompt_tokens_details": {"cached_tokens": self.cached_tokens}}


class ToolCallOut(msgspec.Struct, array_like=True):
    id: str
    name: str
    arguments: str  # a JSON object, serialized


class RequestOutput(_Msg):
    """detokenizer -> frontend: the text and tokens one request gained.

    ``text`` is the answer (content); ``reasoning_text`` the thinking block's
    part of this delta; ``tool_calls`` whole parsed calls (finish_reason
    "tool_calls").
    """

    request_id: str
    text: str
    token_ids: list[int]
    finished: bool = False
    finish_reason: Optional[str] = None
    usage: Optional[Usage] = None
    logprobs: list[LogprobEntry] = []
    reasoning_text: str = ""
    tool_calls: list[ToolCallOut] = []
    # the reasoning block's tokens' entries (``logprobs`` covers the answer's tokens only)
    reasoning_logprobs: list[LogprobEntry] = []
    error: Optional[ErrorDetail] = None  # finish_reason "error": why (the frontend raises it)


class RequestError(_Msg):
    """any stage -> frontend: the request was refused or failed before its first output."""

    request_id: str
    message: str
    kind: ErrorKind = ErrorKind.invalid_request
    param: Optional[str] = None


class SchedulerStats(_Msg):
    """scheduler -> frontend after steps (rate-limited) and whenever it goes idle."""

    running: int = 0
    waiting: int = 0
    kv_blocks_used: int = 0  # summed over the KV cache groups' pools
    kv_blocks_total: int = 0
    kv_blocks_cached_free: int = 0  # free, but still holding a reusable cached prefix
    prefix_cache_queries: int = 0  # cumulative, in tokens
    prefix_cache_hits: int = 0  # cumulative, in tokens
    preemptions: int = 0  # cumulative
    overlapped_steps: int = 0  # cumulative: steps planned while the previous one ran
    steps_by_path: dict[str, int] = {}  # cumulative: computed steps by StepResult.path
    step_launch_ms_by_path: dict[str, float] = {}  # cumulative StepResult.launch_ms, by path
    step_device_ms_by_path: dict[str, float] = {}  # cumulative StepResult.device_ms, by path
    spec_draft_tokens: int = 0  # cumulative: draft tokens verified
    spec_accepted_tokens: int = 0  # cumulative: of those, accepted


# ---------------------------------------------------------------- lifecycle


class StageReady(_Msg):
    """each stage -> supervisor once it can serve."""

    stage: str
    pid: int
    protocol_version: int = PROTOCOL_VERSION
    capabilities: Optional[WorkerCapabilities] = None
    info: dict = {}


class StageFailed(_Msg):
    """a stage that could not start says why before exiting."""

    stage: str
    message: str
    kind: str = "startup"  # "startup" | "checkpoint" | "unsupported"


class Shutdown(_Msg):
    reason: str = "shutdown"


class Ping(_Msg):
    """A heartbeat: remote ranks and the scheduler trade empty ones; the frontend numbers
    its own (``seq`` > 0), and each local stage's main loop answers them with a Pong."""

    seq: int = 0


class Pong(_Msg):
    """stage -> frontend: the answer to Ping ``seq``, from the stage's main loop.

    The scheduler adds its oldest step in flight: how long it has run and how long a step
    of its size has taken lately, so a worker busy with one long step is not called hung."""

    stage: str
    seq: int
    step_age_s: float = 0.0  # 0: no step in flight
    step_expected_s: float = 0.0  # 0: no history yet


FrontendInbound = Union[RequestOutput, RequestError, SchedulerStats, Pong]
TokenizerInbound = Union[GenerateRequest, Shutdown, Ping]
SchedulerInbound = Union[TokenizedRequest, Abort, StopMatched, StepResult, WorkerReady,
                         Shutdown, Ping]
WorkerInbound = Union[StepPlan, Shutdown, Ping]
DetokenizerInbound = Union[TokenBatch, Shutdown, Ping]
SupervisorInbound = Union[StageReady, StageFailed]
