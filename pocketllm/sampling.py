"""SamplingParams: the public, validated per-request sampling and termination settings.
How the workers apply them: workers/sampler/rules.py."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Union

from .errors import InvalidRequestError
from .proto.messages import SamplingSpec
from .protocol import limits as L
from .protocol.limits import DEFAULT_LIMITS, RequestLimits
from .protocol.response_format import parse_response_format

MAX_LOGPROBS = 20
MAX_LOGIT_BIAS = 300  # entries; the OpenAI API's own cap, and it bounds the per-step work


@dataclass
class SamplingParams:
    max_tokens: Optional[int] = 16  # None: until max_model_len
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1 = off
    min_p: float = 0.0
    seed: Optional[int] = None
    stop: Optional[Union[str, list[str]]] = None
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: Optional[int] = None  # None: not asked; k: the sampled token and k alternatives
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    # OpenAI penalties, over the generated tokens: logit -= f * count + p * (count > 0)
    frequency_penalty: float = 0.0  # in [-2, 2]
    presence_penalty: float = 0.0  # in [-2, 2]
    # HF/CTRL rule over prompt + generated tokens: logit / r if logit > 0 else logit * r
    repetition_penalty: float = 1.0  # > 0; 1 = off
    logit_bias: Optional[dict[int, float]] = None  # token id -> bias in [-100, 100]
    # Constrained decoding, in the chat API's shape (protocol/response_format.py), e.g.
    # {"type": "json_schema", "json_schema": {"name": "x", "schema": {...}}}; None = free text.
    response_format: Optional[dict] = None

    def __post_init__(self) -> None:
        self.validate(L.FIXED_LIMITS)  # the engine it is sent to checks its own settings

    def validate(self, limits: RequestLimits = DEFAULT_LIMITS) -> None:
        """Ranges, and the edge's limits (protocol/limits.py): the engine's and, once the
        model is known (the LLM's and the server's limits carry it), its vocabulary and
        context."""
        def bad(param: str, why: str) -> InvalidRequestError:
            return InvalidRequestError(f"{param} = {L.shown(getattr(self, param))} is invalid: "
                                       f"{why}", param)

        if self.max_tokens is not None and (not _is_int(self.max_tokens) or self.max_tokens < 1):
            raise bad("max_tokens", "it must be an integer >= 1")
        if self.max_tokens is not None:
            L.check_max_tokens("max_tokens", self.max_tokens, limits)
        if not _is_num(self.temperature) or self.temperature < 0:
            raise bad("temperature", "it must be a number >= 0")
        if not _is_num(self.top_p) or not 0 < self.top_p <= 1:
            raise bad("top_p", "it must be in (0, 1]")
        if not _is_int(self.top_k) or self.top_k < -1:
            raise bad("top_k", "it must be an integer >= 0 (0 or -1 turn it off)")
        L.check_int("top_k", self.top_k)
        if not _is_num(self.min_p) or not 0 <= self.min_p <= 1:
            raise bad("min_p", "it must be in [0, 1]")
        if self.seed is not None and not _is_int(self.seed):
            raise bad("seed", "it must be an integer")
        if self.seed is not None:
            L.check_int("seed", self.seed)
        if self.stop is not None and not isinstance(self.stop, str) and not (
                isinstance(self.stop, list) and all(isinstance(s, str) for s in self.stop)):
            raise bad("stop", "it must be a string or a list of strings")
        L.check_stop(self.stop, limits)
        if not isinstance(self.stop_token_ids, list) or not all(
                _is_int(t) and t >= 0 for t in self.stop_token_ids[:L.MAX_STOP_TOKEN_IDS + 1]):
            raise bad("stop_token_ids", "it must be a list of token ids")
        L.at_most("stop_token_ids", len(self.stop_token_ids), L.MAX_STOP_TOKEN_IDS,
                  "stop_token_ids has", "entries")
        L.check_token_ids("stop_token_ids", self.stop_token_ids, limits)
        if self.logprobs is not None and (not _is_int(self.logprobs)
                                          or not 0 <= self.logprobs <= MAX_LOGPROBS):
            raise bad("logprobs", f"it must be an integer in 0..{MAX_LOGPROBS}")
        for param in ("frequency_penalty", "presence_penalty"):
            value = getattr(self, param)
            if not _is_num(value) or not -2 <= value <= 2:
                raise bad(param, "it must be a number in [-2, 2]")
        if (not _is_num(self.repetition_penalty) or not self.repetition_penalty > 0
                or self.repetition_penalty == float("inf")):
            raise bad("repetition_penalty", "it must be a number > 0 (1 turns it off)")
        self._validate_logit_bias(limits)
        parse_response_format(self.response_format)

    def _validate_logit_bias(self, limits: RequestLimits) -> None:
        bias = self.logit_bias
        if bias is None:
            return
        if not isinstance(bias, dict):
            raise InvalidRequestError(
                f"logit_bias must map token ids to numbers, not {type(bias).__name__}",
                "logit_bias")
        L.at_most("logit_bias", len(bias), MAX_LOGIT_BIAS, "logit_bias has", "entries")
        for token, value in bias.items():
            if not _is_int(token) or token < 0:
                raise InvalidRequestError(f"logit_bias key {L.shown(token)} is not a token id "
                                          "(an integer >= 0)", "logit_bias")
            L.check_token_ids("logit_bias", (token,), limits, "logit_bias key")
            if not _is_num(value) or not -100 <= value <= 100:
                raise InvalidRequestError(f"logit_bias[{token}] = {L.shown(value)} is invalid: it "
                                          "must be a number in [-100, 100]", "logit_bias")

    def to_spec(self, max_tokens: Optional[int] = None) -> SamplingSpec:
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        return SamplingSpec(
            max_tokens=max_tokens if max_tokens is not None else (self.max_tokens or 0),
            temperature=float(self.temperature), top_p=float(self.top_p),
            top_k=max(int(self.top_k), 0), min_p=float(self.min_p), seed=self.seed,
            ignore_eos=self.ignore_eos, stop=[s for s in stop if s],
            stop_token_ids=list(self.stop_token_ids), logprobs=self.logprobs,
            skip_special_tokens=self.skip_special_tokens,
            include_stop_str_in_output=self.include_stop_str_in_output,
            frequency_penalty=float(self.frequency_penalty),
            presence_penalty=float(self.presence_penalty),
            repetition_penalty=float(self.repetition_penalty),
            logit_bias={t: float(b) for t, b in (self.logit_bias or {}).items()},
            structured=parse_response_format(self.response_format))


def uses_penalties(spec: SamplingSpec) -> bool:
    """Whether sampling this request needs its token history (penalties or bias)."""
    return (spec.frequency_penalty != 0.0 or spec.presence_penalty != 0.0
            or spec.repetition_penalty != 1.0 or bool(spec.logit_bias))


def check_token_ids_in_vocab(spec: SamplingSpec, vocab_size: int) -> None:
    """Refuse logit_bias ids the model cannot produce (needs the vocabulary: tokenizer stage)."""
    bad = sorted(t for t in spec.logit_bias if t >= vocab_size)
    if bad:
        raise InvalidRequestError(f"logit_bias token id {bad[0]} is outside the vocabulary "
                                  f"(0..{vocab_size - 1})", "logit_bias")


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_num(v: object) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and v == v
