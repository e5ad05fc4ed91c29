"""One request as the scheduler tracks it: tokens, KV blocks, and what the workers hold."""

from __future__ import annotations

import enum
from typing import Optional

from pocketllm.proto.messages import ErrorKind, RequestError, TokenizedRequest

from .block_manager import hash_block


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class Request:
    """Mutable scheduler-side state of one request (identity matters: never copied)."""

    def __init__(self, req: TokenizedRequest):
        self.request_id = req.request_id
        self.sampling = req.sampling
        self.queued_at = 0.0  # scheduler clock when it joined the waiting queue
        self.eos_token_ids = frozenset(req.eos_token_ids)
        self.stop_token_ids = frozenset(req.sampling.stop_token_ids)
        self.num_prompt_tokens = len(req.prompt_token_ids)
        self.token_ids: list[int] = list(req.prompt_token_ids)  # prompt + generated
        self.status = RequestStatus.WAITING
        self.finish_reason: Optional[str] = None
        # KV state: tokens[:num_computed_tokens] have KV in block_ids, one table per cache
        # group (kv_groups.py), each of blocks_for(num_computed_tokens) entries.
        self.num_computed_tokens = 0  # including the tokens of steps still in flight
        self.num_verified_tokens = 0  # of those, confirmed by a step's result
        self.block_ids: list[list[int]] = []
        self.num_dropped: list[int] = []  # per group: leading entries freed (NULL_BLOCK)
        self.num_cached_blocks = 0  # leading blocks already published in the prefix cache
        self.block_hashes: list[bytes] = []  # chained hashes of the full blocks of token_ids
        # [group, snapshot slot, its own slot]: a prefix hit's recurrent state to copy in
        # before its first step (kv_groups.py); the snapshot is held until the plan is built
        self.state_restores: list[list[int]] = []
        # A block boundary where this prompt's match in the KV prefix cache ended beyond
        # any state snapshot (0: none): its prefill leaves one there, so the next prompt
        # sharing that prefix resumes from it (kv_groups.py, ``snapshots_in``).
        self.snapshot_hint = 0
        self.num_cached_tokens: Optional[int] = None  # prefix-cache hit at first admission
        # What the workers hold: None = nothing (never sent, or dropped after preemption).
        self.worker_num_tokens: Optional[int] = None
        self.worker_num_blocks = 0
        self.announced = False  # DetokRequest sent to the detokenizer
        self.grammar = None  # a RequestGrammar (grammar.py) when the output is constrained
        self.detok = req.detok  # handed on to the detokenizer unread
        self.client = req.client  # fair_queue.py orders the waiting queue across clients
        self.fair_tag = 0

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    def update_block_hashes(self, block_size: int, num_tokens: Optional[int] = None) -> None:
        """Extend the hash chain over every full block of the first ``num_tokens`` tokens
        (default: all; tokens only grow). A caller whose last tokens may still be PENDING
        placeholders passes how many are real."""
        end = len(self.token_ids) if num_tokens is None else num_tokens
        for i in range(len(self.block_hashes), end // block_size):
            parent = self.block_hashes[i - 1] if i else None
            self.block_hashes.append(
                hash_block(parent, self.token_ids[i * block_size:(i + 1) * block_size]))

    def __repr__(self) -> str:
        return (f"Request({self.request_id!r}, {self.status.value}, tokens={self.num_tokens}, "
                f"computed={self.num_computed_tokens}, blocks={self.block_ids})")


def refusal(req: TokenizedRequest, cfg, groups, in_use: bool) -> Optional[RequestError]:
    """Why the scheduler (``cfg``: its SchedulerConfig, ``groups``: its CacheGroups) can
    never serve ``req``, each refusal with its own kind and field; None when it can."""
    n = len(req.prompt_token_ids)

    def refuse(kind: ErrorKind, param: str, why: str) -> RequestError:
        return RequestError(req.request_id, why, kind=kind, param=param)

    if in_use:
        return refuse(ErrorKind.conflict, "request_id",
                      f"request id {req.request_id!r} is already in use")
    if n == 0:
        return refuse(ErrorKind.invalid_request, "prompt",
                      "the prompt is empty: at least one token is needed")
    if req.sampling.max_tokens < 1:
        return refuse(ErrorKind.invalid_request, "max_tokens",
                      f"max_tokens must be at least 1, got {req.sampling.max_tokens}")
    if n >= cfg.max_model_len:
        return refuse(ErrorKind.too_long, "prompt",
                      f"the prompt has {n} tokens but max_model_len is {cfg.max_model_len}: "
                      "it leaves no room for a generated token")
    limit = min(n + req.sampling.max_tokens, cfg.max_model_len)
    chunk = cfg.max_num_batched_tokens if cfg.enable_chunked_prefill else limit
    why = groups.refusal(limit, chunk)
    if why is not None:
        return refuse(ErrorKind.too_long, "max_tokens",
                      f"the request may grow to {limit} tokens ({n} prompt + up to "
                      f"{limit - n} generated), {why}; lower max_tokens or shorten the prompt")
    return None
