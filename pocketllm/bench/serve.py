"""`pocketllm bench serve`: drive a running OpenAI-compatible server with streaming requests.

Closed loop (a fixed number of requests in flight) or open loop (Poisson arrivals
at a fixed rate). Each request times its first content chunk (TTFT), the gaps
between content chunks (ITL) and the whole exchange (E2E). Token counts come from
the server's own usage chunk (``stream_options.include_usage``), not from our
guess at the prompt length. Failed requests are counted, never fatal.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import Callable, Optional

import aiohttp

from ..errors import InvalidRequestError

ENDPOINTS = {"chat": "/v1/chat/completions", "completions": "/v1/completions"}

# Short common words: most BPE vocabularies hold " word" as one token, so a prompt
# of L words is about L tokens (the server's usage.prompt_tokens is the exact count).
WORDS = (
    "time year people way day man thing woman life child world school state family student "
    "group country problem hand part place case week company system program question work "
    "government number night point home water room mother area money story fact month lot "
    "right study book eye job word business issue side kind head house service friend "
    "father power hour game line end member law car city name team minute idea kid body "
    "back parent face others level office door health person art war history party result "
    "change morning reason research girl guy moment air teacher force education foot boy "
    "age policy music market sense nation plan college interest death course someone effect "
    "class control care field role rate heart drug show light voice wife police mind price "
    "report"
).split()


@dataclass
class ServeBenchConfig:
    url: str = "http://127.0.0.1:8000"
    endpoint: str = "chat"  # chat | completions
    concurrency: Optional[int] = None  # closed loop (the default: 8)
    request_rate: Optional[float] = None  # open loop: Poisson arrivals, requests/s
    num_requests: int = 100
    input_len: int = 128  # words, about one token each
    output_len: int = 128
    seed: int = 0
    api_key: Optional[str] = None
    model: Optional[str] = None  # None: the first id of GET /v1/models, if any
    timeout: float = 300.0  # seconds per request
    ignore_eos: bool = True
    # Prompts as token ids (completions only): for checkpoints without a tokenizer, such
    # as dummy weights from a bare config.json. Ids below TOKEN_ID_LIMIT fit any vocabulary.
    token_ids: bool = False

    def validate(self) -> None:
        def bad(param: str, why: str) -> InvalidRequestError:
            return InvalidRequestError(f"--{param.replace('_', '-')} {why}", param)

        if self.endpoint not in ENDPOINTS:
            raise bad("endpoint", f"must be one of {sorted(ENDPOINTS)}, not {self.endpoint!r}")
        if self.concurrency is not None and self.request_rate is not None:
            raise bad("request_rate", "and --concurrency are exclusive: closed or open loop")
        for name in ("concurrency", "num_requests", "input_len", "output_len"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise bad(name, "must be at least 1")
        for name in ("request_rate", "timeout"):
            if getattr(self, name) is not None and not getattr(self, name) > 0:
                raise bad(name, "must be positive")
        if self.token_ids and self.endpoint != "completions":
            raise bad("token_ids", "needs --endpoint completions (chat messages are text)")
        if not self.url.startswith(("http://", "https://")):
            raise bad("url", f"must start with http:// or https://, not {self.url!r}")

    @property
    def mode(self) -> str:
        if self.request_rate is not None:
            return f"open loop, Poisson arrivals at {self.request_rate:g} req/s"
        return f"closed loop, concurrency {self.concurrency or 8}"

    @property
    def base_url(self) -> str:
        # Accept the OpenAI-client style base URL (".../v1") as well as the server root.
        url = self.url.rstrip("/")
        return url[:-3] if url.endswith("/v1") else url


@dataclass
class RequestRecord:
    index: int
    start_s: float  # when it was sent, from the start of the run
    ok: bool = False
    error: Optional[str] = None
    ttft_s: Optional[float] = None
    e2e_s: Optional[float] = None
    itl_s: list[float] = field(default_factory=list)
    prompt_tokens: Optional[int] = None  # the server's count; None if it sent no usage
    cached_tokens: int = 0  # of those, served from the server's prefix cache (if it says)
    completion_tokens: int = 0
    content_chunks: int = 0

    @property
    def tpot_s(self) -> Optional[float]:
        """Mean time per output token after the first."""
        if self.ttft_s is None or self.e2e_s is None or self.completion_tokens < 2:
            return None
        return (self.e2e_s - self.ttft_s) / (self.completion_tokens - 1)


TOKEN_ID_LIMIT = 32000


def make_prompts(n: int, input_len: int, seed: int, token_ids: bool = False) -> list:
    """n distinct prompts of input_len random words, or token ids (distinct, so prefix
    caching can't skip their prefill), the same for the same seed."""
    rng = random.Random(seed)
    if token_ids:
        return [[rng.randrange(100, TOKEN_ID_LIMIT) for _ in range(input_len)]
                for _ in range(n)]
    return [" ".join(rng.choice(WORDS) for _ in range(input_len)) for _ in range(n)]


def inter_token_latencies(times: list[float], chunk_tokens: list[Optional[int]],
                          completion_tokens: int) -> list[float]:
    """The gap before each content chunk after the first, divided by the tokens it holds.

    A chunk may carry several tokens; where the server does not say how many (per-chunk
    usage), the request's tokens are taken to be spread evenly over its content chunks.
    """
    even = max(1.0, completion_tokens / len(times)) if times else 1.0
    out = []
    for i in range(1, len(times)):
        k = chunk_tokens[i] if chunk_tokens[i] is not None else even
        out.append((times[i] - times[i - 1]) / max(k, 1))
    return out


def percentile(values: list[float], q: float) -> Optional[float]:
    """Linear interpolation between closest ranks (numpy's default); None when empty."""
    if not values:
        return None
    s = sorted(values)
    pos = (len(s) - 1) * q / 100.0
    lo = int(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def _stats(values: list[float]) -> dict:
    return {"mean": sum(values) / len(values) if values else None,
            "p50": percentile(values, 50), "p90": percentile(values, 90),
            "p99": percentile(values, 99), "count": len(values)}


class _RequestError(Exception):
    """One request failed; the message is what the error table groups by."""


@dataclass
class ServeBenchResult:
    config: ServeBenchConfig
    records: list[RequestRecord]
    wall_s: float
    errors: dict[str, int]  # distinct message -> count
    notes: list[str]
    ignore_eos_sent: bool
    model: Optional[str]

    def summary(self) -> dict:
        ok = [r for r in self.records if r.ok]
        out_tokens = sum(r.completion_tokens for r in ok)
        prompt_tokens = sum(r.prompt_tokens or 0 for r in ok)
        wall = self.wall_s if self.wall_s > 0 else float("nan")
        return {
            "completed": len(ok), "failed": len(self.records) - len(ok),
            "wall_s": self.wall_s,
            "request_throughput": len(ok) / wall,
            "output_throughput": out_tokens / wall,
            "total_token_throughput": (prompt_tokens + out_tokens) / wall,
            "total_prompt_tokens": prompt_tokens, "total_output_tokens": out_tokens,
            "total_cached_prompt_tokens": sum(r.cached_tokens for r in ok),
            "ttft_s": _stats([r.ttft_s for r in ok if r.ttft_s is not None]),
            "tpot_s": _stats([r.tpot_s for r in ok if r.tpot_s is not None]),
            "itl_s": _stats([x for r in ok for x in r.itl_s]),
            "e2e_s": _stats([r.e2e_s for r in ok if r.e2e_s is not None]),
        }

    def as_dict(self) -> dict:
        return {"config": asdict(self.config) | {"api_key": bool(self.config.api_key)},
                "mode": self.config.mode, "model": self.model,
                "ignore_eos_sent": self.ignore_eos_sent, "summary": self.summary(),
                "errors": self.errors, "notes": self.notes,
                "requests": [asdict(r) | {"tpot_s": r.tpot_s} for r in self.records]}

    def table(self) -> str:
        s, c = self.summary(), self.config
        lines = [f"endpoint            {c.endpoint} at {c.base_url} (model {self.model or '-'})",
                 f"mode                {c.mode}",
                 f"requests            {s['completed']} ok, {s['failed']} failed "
                 f"(input {c.input_len} words, max_tokens {c.output_len}"
                 f"{'' if self.ignore_eos_sent else ', ignore_eos NOT sent'})",
                 f"wall time           {s['wall_s']:.2f} s",
                 f"request throughput  {s['request_throughput']:.2f} req/s",
                 f"prompt tokens       {s['total_prompt_tokens']} (server usage; "
                 f"{s['total_cached_prompt_tokens']} from its prefix cache)",
                 f"output tokens       {s['total_output_tokens']} "
                 f"({s['output_throughput']:.1f} tok/s)",
                 f"total tokens        {s['total_prompt_tokens'] + s['total_output_tokens']} "
                 f"({s['total_token_throughput']:.1f} tok/s)",
                 f"{'ms':<8}{'mean':>10}{'p50':>10}{'p90':>10}{'p99':>10}"]
        for name, key in (("TTFT", "ttft_s"), ("TPOT", "tpot_s"), ("ITL", "itl_s"),
                          ("E2E", "e2e_s")):
            st = s[key]
            cells = ["-" if st[k] is None else f"{st[k] * 1000:.1f}"
                     for k in ("mean", "p50", "p90", "p99")]
            lines.append(f"{name:<8}" + "".join(f"{x:>10}" for x in cells))
        for msg, n in self.errors.items():
            lines.append(f"error x{n}: {msg}")
        lines += [f"note: {n}" for n in self.notes]
        return "\n".join(lines)


class _Runner:
    def __init__(self, cfg: ServeBenchConfig, session: aiohttp.ClientSession,
                 say: Callable[[str], None]):
        self.cfg = cfg
        self.session = session
        self.model: Optional[str] = None
        self.say = say
        self.prompts = make_prompts(cfg.num_requests, cfg.input_len, cfg.seed, cfg.token_ids)
        self.send_ignore_eos = cfg.ignore_eos
        self.errors: dict[str, int] = {}
        self.notes: list[str] = []
        self.t0 = 0.0
        self.headers = {"Authorization": f"Bearer {cfg.api_key}"} if cfg.api_key else {}

    def note(self, text: str) -> None:
        if text not in self.notes:
            self.notes.append(text)
            self.say(f"note: {text}")

    def body(self, prompt: str) -> dict:
        body: dict = {"max_tokens": self.cfg.output_len, "stream": True,
                      "stream_options": {"include_usage": True}}
        if self.cfg.endpoint == "chat":
            body["messages"] = [{"role": "user", "content": prompt}]
        else:
            body["prompt"] = prompt
        if self.model is not None:
            body["model"] = self.model
        if self.send_ignore_eos:
            body["ignore_eos"] = True
        return body

    async def one(self, index: int) -> RequestRecord:
        rec = RequestRecord(index, time.perf_counter() - self.t0)
        try:
            await asyncio.wait_for(self._exchange(rec, self.prompts[index]), self.cfg.timeout)
            rec.ok = True
        except asyncio.TimeoutError:
            self._fail(rec, f"timed out after {self.cfg.timeout:g} s (--timeout)")
        except _RequestError as e:
            self._fail(rec, str(e))
        except Exception as e:  # connection errors, odd streams: counted, never fatal
            self._fail(rec, f"{type(e).__name__}: {e}")
        return rec

    def _fail(self, rec: RequestRecord, msg: str) -> None:
        rec.ok, rec.error = False, msg
        if msg not in self.errors:
            self.say(f"error (first of its kind, request {rec.index}): {msg}")
        self.errors[msg] = self.errors.get(msg, 0) + 1

    async def _exchange(self, rec: RequestRecord, prompt: str) -> None:
        url = self.cfg.base_url + ENDPOINTS[self.cfg.endpoint]
        while True:
            sent_ignore_eos = self.send_ignore_eos
            sent = time.perf_counter()
            async with self.session.post(url, json=self.body(prompt),
                                         headers=self.headers) as resp:
                if resp.status == 200:
                    await self._read_stream(rec, resp, sent)
                    return
                text = await resp.text()
            if resp.status == 400 and sent_ignore_eos and "ignore_eos" in text:
                # A peer server without the extension: retry plain, and say so. (Requests
                # already in flight with it come here too, and retry the same way.)
                self.send_ignore_eos = False
                self.note("the server refused ignore_eos (400); sent without it, so "
                          "requests may stop before --output-len tokens")
                continue
            raise _RequestError(f"HTTP {resp.status}: {_error_message(text)}")

    async def _read_stream(self, rec: RequestRecord, resp: aiohttp.ClientResponse,
                           sent: float) -> None:
        times: list[float] = []
        chunk_tokens: list[Optional[int]] = []  # per content chunk, when the server says
        usage: Optional[dict] = None
        done = finished = False
        async for raw in resp.content:
            now = time.perf_counter()
            line = raw.strip()
            if not line.startswith(b"data:"):
                continue
            data = line[5:].strip()
            if data == b"[DONE]":
                done = True
                break
            try:
                chunk = json.loads(data)
            except ValueError:
                raise _RequestError(f"a stream chunk is not JSON: {data[:80]!r}") from None
            if "error" in chunk:
                raise _RequestError(f"error event in the stream: {_error_message(chunk)}")
            before = usage.get("completion_tokens") if usage else None
            if chunk.get("usage"):
                usage = chunk["usage"]
            choices = chunk.get("choices") or []
            finished = finished or any(ch.get("finish_reason") for ch in choices)
            if any(_content(ch) for ch in choices):
                times.append(now)
                after = usage.get("completion_tokens") if usage and chunk.get("usage") else None
                chunk_tokens.append(None if after is None else after - (before or 0))
        end = time.perf_counter()
        if not (done or finished):
            raise _RequestError("the stream ended before a finish_reason or [DONE]")
        rec.e2e_s = end - sent
        rec.content_chunks = len(times)
        rec.ttft_s = times[0] - sent if times else None
        if usage is not None and "completion_tokens" in usage:
            rec.completion_tokens = int(usage["completion_tokens"])
            rec.prompt_tokens = usage.get("prompt_tokens")
            rec.cached_tokens = int((usage.get("prompt_tokens_details") or {})
                                    .get("cached_tokens") or 0)
        else:
            rec.completion_tokens = len(times)
            self.note("the server sent no usage; output tokens are counted as content chunks")
        rec.itl_s = inter_token_latencies(times, chunk_tokens, rec.completion_tokens)

    async def closed_loop(self, concurrency: int) -> list[RequestRecord]:
        indices = iter(range(self.cfg.num_requests))
        records: list[RequestRecord] = []

        async def worker() -> None:
            for i in indices:  # a shared iterator: each index goes to exactly one worker
                records.append(await self.one(i))

        await asyncio.gather(*(worker() for _ in range(min(concurrency,
                                                           self.cfg.num_requests))))
        return records

    async def open_loop(self, rate: float) -> list[RequestRecord]:
        rng = random.Random(self.cfg.seed + 1)  # its own stream: prompts stay the same
        tasks, due = [], 0.0
        for i in range(self.cfg.num_requests):
            delay = self.t0 + due - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.ensure_future(self.one(i)))
            due += rng.expovariate(rate)
        return list(await asyncio.gather(*tasks))


def _content(choice: dict) -> str:
    delta = choice.get("delta")
    if isinstance(delta, dict):
        return delta.get("content") or delta.get("reasoning_content") or ""
    return choice.get("text") or ""


def _error_message(body) -> str:
    """The OpenAI error message of a body (text or parsed), else the text, shortened."""
    if isinstance(body, str):
        try:
            body = json.loads(body)
        except ValueError:
            return body.strip()[:200] or "(empty body)"
    err = body.get("error") if isinstance(body, dict) else None
    if isinstance(err, dict) and err.get("message"):
        err = err["message"]
    return str(err)[:200] if err else json.dumps(body)[:200]


async def _discover_model(session: aiohttp.ClientSession, cfg: ServeBenchConfig,
                          headers: dict) -> Optional[str]:
    with contextlib.suppress(aiohttp.ClientError, asyncio.TimeoutError, ValueError):
        async with session.get(cfg.base_url + "/v1/models", headers=headers,
                               timeout=aiohttp.ClientTimeout(total=min(10.0, cfg.timeout))) as r:
            if r.status == 200:
                data = (await r.json()).get("data") or []
                if data and isinstance(data[0], dict):
                    return data[0].get("id")
    return None


async def run_serve_bench_async(cfg: ServeBenchConfig,
                                say: Callable[[str], None] | None = None) -> ServeBenchResult:
    cfg.validate()
    say = say or (lambda s: print(s, file=sys.stderr, flush=True))
    closed = cfg.request_rate is None
    concurrency = cfg.concurrency or 8
    # Closed loop: exactly `concurrency` connections. Open loop: no client-side cap, so
    # a slow server queues the requests itself and its queueing shows in the latencies.
    connector = aiohttp.TCPConnector(limit=concurrency if closed else 0)
    async with aiohttp.ClientSession(connector=connector,
                                     timeout=aiohttp.ClientTimeout(total=None)) as session:
        runner = _Runner(cfg, session, say)
        runner.model = cfg.model or await _discover_model(session, cfg, runner.headers)
        if runner.model is None:
            runner.note("no --model and GET /v1/models named none: requests carry no model")
        say(f"sending {cfg.num_requests} {cfg.endpoint} requests to {cfg.base_url} "
            f"({cfg.mode})")
        runner.t0 = time.perf_counter()
        if closed:
            records = await runner.closed_loop(concurrency)
        else:
            records = await runner.open_loop(cfg.request_rate)
        wall = time.perf_counter() - runner.t0
    records.sort(key=lambda r: r.index)
    return ServeBenchResult(cfg, records, wall, runner.errors, runner.notes,
                            runner.send_ignore_eos, runner.model)


def run_serve_bench(cfg: ServeBenchConfig,
                    say: Callable[[str], None] | None = None) -> ServeBenchResult:
    """Run the benchmark to completion (M requests, each bounded by cfg.timeout)."""
    return asyncio.run(run_serve_bench_async(cfg, say))
