"""The OpenAI request-field contract: implemented, refused (400) or accepted and inert.

One function per endpoint turns a JSON body into the scheduler requests that
serve it (one per choice). Every field is in exactly one table below; a field
in none of them is refused, so nothing a client sends is silently ignored.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Optional

from ..errors import InvalidRequestError
from ..proto.messages import GenerateRequest
from ..sampling import MAX_LOGIT_BIAS, MAX_LOGPROBS, SamplingParams
from . import limits as L
from .chat import normalize_messages
from .limits import DEFAULT_LIMITS, RequestLimits
from .tool_choice import tool_options

MAX_N = 128

# Cannot change the generated text; accepted and ignored.
INERT = {"model", "user", "store", "metadata", "service_tier"}

COMMON = {"max_tokens", "temperature", "top_p", "top_k", "min_p", "seed", "stream",
          "stream_options", "n", "stop", "logprobs", "ignore_eos", "stop_token_ids",
          "skip_special_tokens", "frequency_penalty", "presence_penalty", "logit_bias",
          "repetition_penalty", "request_id",
          "response_format"}  # on completions too: a PocketLLM extension
CHAT_ONLY = {"messages", "max_completion_tokens", "top_logprobs", "tools",
             "tool_choice", "parallel_tool_calls", "thinking_mode", "reasoning_effort",
             "add_generation_prompt", "drop_thinking", "chat_template_kwargs"}
COMPLETION_ONLY = {"prompt", "best_of", "suffix", "echo", "top_logprobs"}


@dataclass
class ParsedRequest:
    request_id: str
    choices: list[GenerateRequest]  # index i is choice i (completions: prompt-major)
    stream: bool = False
    include_usage: bool = False
    logprobs: bool = False
    prompt_count: int = 1
    extra: dict = field(default_factory=dict)
    # completions best_of > n: `choices` holds best_of candidates per prompt (prompt-major);
    # the server answers with the n of highest cumulative logprob.
    n: int = 1
    best_of: int = 1


def refuse(param: str, value: Any, why: str, instead: str) -> InvalidRequestError:
    return InvalidRequestError(
        f"{_show(param, value)} is not supported by this server: {why}. {instead}", param)


def _show(param: str, value: Any) -> str:
    import json

    try:
        shown = json.dumps(value)
    except (TypeError, ValueError):
        shown = repr(value)
    if len(shown) > 60:
        shown = shown[:57] + "..."
    return f'"{param}" = {shown}'


def _check_known(body: dict, allowed: set) -> None:
    for key in body:
        if key not in allowed and key not in INERT:
            shown = key if len(key) <= 60 else key[:57] + "..."
            raise InvalidRequestError(
                f'unknown field "{shown}": this server acts on every field it accepts, and does '
                f"not know this one. Remove it from the request.", shown)


def _typed(body: dict, key: str, check: Callable[[Any], bool], what: str) -> Any:
    value = body.get(key)
    if value is not None and not check(value):
        raise InvalidRequestError(f'"{key}" must be {what}, not {_show(key, value)}', key)
    return value


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_num(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _common(body: dict, limits: RequestLimits) -> tuple[SamplingParams, int, bool, bool]:
    """Sampling fields both endpoints share; returns (params, n, stream, include_usage).
    The caller validates the params against its limits once the endpoint's fields are in."""
    n = _typed(body, "n", _is_int, "an integer")
    n = 1 if n is None else n
    if not 1 <= n <= MAX_N:
        raise InvalidRequestError(f'"n" must be between 1 and {MAX_N}, not {L.shown(n)}', "n")
    stream = _typed(body, "stream", lambda v: isinstance(v, bool), "a boolean") or False
    opts = _typed(body, "stream_options", lambda v: isinstance(v, dict), "an object") or {}
    unknown = set(opts) - {"include_usage"}
    if unknown:
        raise InvalidRequestError(f'unknown stream_options field "{sorted(unknown)[0]}"',
                                  "stream_options")
    include_usage = _typed(opts, "include_usage", lambda v: isinstance(v, bool), "a boolean")
    if include_usage and not stream:
        raise InvalidRequestError('"stream_options" is only allowed when "stream" is true',
                                  "stream_options")
    stop = body.get("stop")
    if stop is not None and not isinstance(stop, str) and not (
            isinstance(stop, list) and all(isinstance(s, str) for s in stop)):
        raise refuse("stop", stop, "a stop sequence is a string, or a list of strings, and this "
                     "value is neither", 'Send "stop" as a string or an array of strings.')
    params = dict(
        temperature=_typed(body, "temperature", _is_num, "a number"),
        top_p=_typed(body, "top_p", _is_num, "a number"),
        top_k=_typed(body, "top_k", _is_int, "an integer"),
        min_p=_typed(body, "min_p", _is_num, "a number"),
        seed=_typed(body, "seed", _is_int, "an integer"),
        stop=stop,
        ignore_eos=_typed(body, "ignore_eos", lambda v: isinstance(v, bool), "a boolean"),
        stop_token_ids=_typed(body, "stop_token_ids",
                              lambda v: isinstance(v, list) and all(map(_is_int, v)),
                              "an array of token ids"),
        skip_special_tokens=_typed(body, "skip_special_tokens", lambda v: isinstance(v, bool),
                                   "a boolean"),
        frequency_penalty=_typed(body, "frequency_penalty", _is_num, "a number"),
        presence_penalty=_typed(body, "presence_penalty", _is_num, "a number"),
        repetition_penalty=_typed(body, "repetition_penalty", _is_num, "a number"),
        logit_bias=_logit_bias(body),
        response_format=body.get("response_format"),  # shape checked by SamplingParams
    )
    if params["temperature"] is not None and params["temperature"] > 2:
        raise InvalidRequestError('"temperature" must be between 0 and 2', "temperature")
    sp = SamplingParams(**{k: v for k, v in params.items() if v is not None})
    return sp, n, stream, bool(include_usage)


def _logit_bias(body: dict) -> Optional[dict[int, float]]:
    """OpenAI spells token ids as the object's keys ("50256"); values are numbers.
    Ranges and the entry cap are checked by SamplingParams, the vocabulary by the tokenizer."""
    bias = _typed(body, "logit_bias", lambda v: isinstance(v, dict), "an object")
    if bias is None:
        return None
    out: dict[int, float] = {}
    # The entry cap before parsing any key.
    L.at_most("logit_bias", len(bias), MAX_LOGIT_BIAS, "logit_bias has", "entries")
    for key, value in bias.items():
        if not (isinstance(key, str) and key.isascii() and key.isdigit()):
            raise InvalidRequestError(f'invalid key in "logit_bias": {L.shown(key)}; keys are '
                                      "token ids, written as non-negative integers", "logit_bias")
        if len(key) > 19:  # INT64_MAX has 19 digits; int() of a long string is slow
            raise InvalidRequestError(f'"logit_bias" key {L.shown(key)} is out of range (a '
                                      "token id)", "logit_bias")
        if not _is_num(value):
            raise InvalidRequestError(f'"logit_bias" values must be numbers, not '
                                      f"{_show('logit_bias.' + key, value)}", "logit_bias")
        out[int(key)] = value
    return out


def _max_tokens(body: dict, limits: RequestLimits, *keys: str) -> Optional[int]:
    value = None
    for key in keys:  # the later key wins (max_completion_tokens over max_tokens)
        v = _typed(body, key, _is_int, "an integer")
        if v is not None:
            if v < 1:
                raise InvalidRequestError(f'"{key}" must be at least 1, not {L.shown(v)}', key)
            L.check_max_tokens(key, v, limits)
            value = v
    return value


def _choices(base: GenerateRequest, rid: str, n: int, seed: Optional[int],
             offset: int = 0) -> list[GenerateRequest]:
    """One scheduler request per choice, each with its own seed derived from the request's."""
    import msgspec

    out = []
    for i in range(n):
        spec = base.sampling
        if seed is not None and i > 0:
            spec = msgspec.structs.replace(spec, seed=(seed + i) & 0x7FFFFFFFFFFFFFFF)
        out.append(msgspec.structs.replace(base, request_id=f"{rid}-{offset + i}", sampling=spec))
    return out


def parse_chat(body: dict, request_id: str,
               limits: RequestLimits = DEFAULT_LIMITS) -> ParsedRequest:
    """limits: the engine's, with the model's bounds once it is loaded (the body itself
    was checked by limits.parse_body)."""
    _check_known(body, COMMON | CHAT_ONLY)
    sp, n, stream, include_usage = _common(body, limits)
    lp = body.get("logprobs")
    if lp is not None and not isinstance(lp, bool):
        raise refuse("logprobs", lp, "on chat, logprobs is a boolean; a count is the completions "
                     "endpoint's spelling", 'Send "logprobs": true with "top_logprobs": N.')
    top = _typed(body, "top_logprobs", _is_int, "an integer")
    if top is not None and not 0 <= top <= MAX_LOGPROBS:
        raise InvalidRequestError(f'"top_logprobs" must be in 0..{MAX_LOGPROBS}', "top_logprobs")
    if top and not lp:
        raise InvalidRequestError('"top_logprobs" needs "logprobs": true', "top_logprobs")
    if lp:
        sp.logprobs = top or 0
    sp.max_tokens = _max_tokens(body, limits, "max_tokens", "max_completion_tokens")
    L.check_messages(body.get("messages"), limits)
    messages = normalize_messages(body.get("messages"))
    L.check_message_chars(messages, limits)
    opts: dict[str, Any] = {}
    agp = _typed(body, "add_generation_prompt", lambda v: isinstance(v, bool), "a boolean")
    opts["add_generation_prompt"] = True if agp is None else agp
    effort = _typed(body, "reasoning_effort", lambda v: isinstance(v, str), "a string")
    if effort is not None:
        opts["reasoning_effort"] = effort
    thinking = _typed(body, "thinking_mode", lambda v: isinstance(v, bool), "a boolean")
    if thinking is not None:
        opts["enable_thinking"] = thinking
    if _typed(body, "drop_thinking", lambda v: isinstance(v, bool), "a boolean"):
        opts["drop_thinking"] = True  # read by the tokenizer stage (protocol/reasoning.py)
    kwargs = _typed(body, "chat_template_kwargs", lambda v: isinstance(v, dict), "an object")
    L.check_template_kwargs(kwargs)
    L.check_tools(body.get("tools"))
    opts = {**(kwargs or {}), **opts}
    opts.update(tool_options(body.get("tools"), body.get("tool_choice"),  # tool_choice.py
                             body.get("parallel_tool_calls"),
                             response_format=body.get("response_format"), template_kwargs=kwargs))
    sp.validate(limits)
    base = GenerateRequest(request_id, sp.to_spec(), messages=messages, chat_options=opts)
    return ParsedRequest(request_id, _choices(base, request_id, n, sp.seed), stream,
                         include_usage, logprobs=bool(lp))


def parse_completion(body: dict, request_id: str,
                     limits: RequestLimits = DEFAULT_LIMITS) -> ParsedRequest:
    _check_known(body, COMMON | COMPLETION_ONLY)
    sp, n, stream, include_usage = _common(body, limits)
    lp = body.get("logprobs")
    if lp is not None and (not _is_int(lp) or not 0 <= lp <= MAX_LOGPROBS):
        raise refuse("logprobs", lp, f"on completions, logprobs is the number of alternatives, a "
                     f"whole number in 0..{MAX_LOGPROBS}", 'Send an integer, or leave it out.')
    if body.get("top_logprobs") is not None:
        raise refuse("top_logprobs", body["top_logprobs"], "the completions endpoint names the "
                     "count in logprobs itself", 'Send "logprobs": N instead.')
    echo = _typed(body, "echo", lambda v: isinstance(v, bool), "a boolean") or False
    if echo and lp is not None:
        raise refuse("logprobs", lp, "with echo, the prompt's tokens would need log "
                     "probabilities too, and this server does not compute prompt log "
                     "probabilities", 'Send "echo" or "logprobs", not both.')
    if body.get("suffix"):
        raise refuse("suffix", body["suffix"], "no suffix is appended", 'Leave "suffix" out.')
    best_of = _typed(body, "best_of", _is_int, "an integer")
    best_of = n if best_of is None else best_of
    if not n <= best_of <= MAX_N:
        raise InvalidRequestError(f'"best_of" must be between "n" ({n}) and {MAX_N}, not '
                                  f"{best_of}", "best_of")
    if stream and best_of > n:
        raise refuse("best_of", best_of, "the best candidates are known only once all have "
                     "finished, so they cannot be streamed", 'Send "best_of" equal to "n", or '
                     '"stream": false.')
    sp.logprobs = lp
    if best_of > n and lp is None:
        sp.logprobs = 0  # candidates are ranked by their cumulative logprob
    sp.max_tokens = _max_tokens(body, limits, "max_tokens")
    if "max_tokens" not in body:
        sp.max_tokens = 16  # OpenAI's completions default
    sp.validate(limits)
    prompts = _prompts(body.get("prompt"), limits)
    choices: list[GenerateRequest] = []
    for p, prompt in enumerate(prompts):
        base = GenerateRequest(request_id, sp.to_spec(),
                               prompt=prompt if isinstance(prompt, str) else None,
                               prompt_token_ids=prompt if isinstance(prompt, list) else None,
                               echo=echo)
        choices += _choices(base, request_id, best_of, sp.seed, offset=p * best_of)
    if len(choices) > MAX_N:
        param = "best_of" if best_of > n else "n"
        raise InvalidRequestError(f"{len(prompts)} prompts x {param}={best_of} is {len(choices)} "
                                  f"choices; this server serves at most {MAX_N} per request",
                                  param)
    return ParsedRequest(request_id, choices, stream, include_usage, logprobs=lp is not None,
                         prompt_count=len(prompts), n=n, best_of=best_of)


def _prompts(prompt: Any, limits: RequestLimits) -> list:
    prompts = _prompt_list(prompt)
    if len(prompts) > MAX_N:
        raise InvalidRequestError(f'"prompt" holds {len(prompts)} prompts; this server serves at '
                                  f"most {MAX_N} choices per request", "prompt")
    if isinstance(prompts[0], str):
        L.check_prompt_chars(sum(map(len, prompts)), limits, "prompt")
    else:
        for ids in prompts:
            L.check_prompt_ids(ids, limits)
    return prompts


def _prompt_list(prompt: Any) -> list:
    if isinstance(prompt, str):
        if not prompt:
            raise InvalidRequestError('"prompt" is empty', "prompt")
        return [prompt]
    if isinstance(prompt, list) and prompt:
        if all(_is_int(t) for t in prompt):
            return [prompt]
        if all(isinstance(p, str) and p for p in prompt):
            return list(prompt)
        if all(isinstance(p, list) and p and all(map(_is_int, p)) for p in prompt):
            return list(prompt)
    raise InvalidRequestError('"prompt" must be a non-empty string, an array of strings, or '
                              "token ids", "prompt")
