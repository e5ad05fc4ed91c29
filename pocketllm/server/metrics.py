"""Prometheus metrics for /metrics, in a private registry (one per server)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily

from ..proto.messages import STEP_PATHS, SchedulerStats

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.1, 0.25, 0.5, 1, 2.5)


class Metrics:
    """Every series carries `model_name`. Figures the scheduler counts up (preemptions, prefix
    cache, steps) are Prometheus counters (`_total`), read from its latest stats at scrape."""

    def __init__(self, model_name: str = "") -> None:
        r = self.registry = CollectorRegistry()
        p = "pocketllm_"
        m = ["model_name"]
        self.model_name = model_name
        self.requests = Counter(p + "requests", "Finished requests (choices) by finish reason",
                                m + ["finish_reason"], registry=r)

        def series(kind, name: str, doc: str, **kwargs):
            return kind(p + name, doc, m, registry=r, **kwargs).labels(model_name)

        self.running = series(Gauge, "requests_running", "Requests in the running batch")
        self.waiting = series(Gauge, "requests_waiting", "Requests waiting to be scheduled")
        pools = "(every cache group's pool)"
        self.kv_used = series(Gauge, "kv_blocks_used", f"KV-cache blocks in use {pools}")
        self.kv_total = series(Gauge, "kv_blocks_total", f"KV-cache blocks in all {pools}")
        self.prompt_tokens = series(Counter, "prompt_tokens", "Prompt tokens processed")
        self.generation_tokens = series(Counter, "generation_tokens", "Tokens generated")
        self.ttft = series(Histogram, "time_to_first_token_seconds", "Time to first token",
                           buckets=LATENCY_BUCKETS)
        self.itl = series(Histogram, "inter_token_latency_seconds", "Time between output deltas",
                          buckets=ITL_BUCKETS)
        self.e2e = series(Histogram, "e2e_request_latency_seconds", "Request latency, end to end",
                          buckets=LATENCY_BUCKETS)
        self.engine_counters = _EngineCounters(model_name)
        r.register(self.engine_counters)

    def render(self, stats: SchedulerStats) -> bytes:
        self.running.set(stats.running)
        self.waiting.set(stats.waiting)
        self.kv_used.set(stats.kv_blocks_used)
        self.kv_total.set(stats.kv_blocks_total)
        self.engine_counters.stats = stats
        return generate_latest(self.registry)

    def count_finish(self, finish_reason: str) -> None:
        self.requests.labels(model_name=self.model_name, finish_reason=finish_reason).inc()


class _EngineCounters:
    """The scheduler's cumulative figures as counters (it keeps the totals; we expose them)."""

    def __init__(self, model_name: str):
        self.model_name = model_name
        self.stats = SchedulerStats()

    def collect(self):
        s, p = self.stats, "pocketllm_"

        for name, doc, value in (
                ("prefix_cache_queries_tokens", "Prompt tokens looked up in the prefix cache",
                 s.prefix_cache_queries),
                ("prefix_cache_hits_tokens", "Prompt tokens found in the prefix cache",
                 s.prefix_cache_hits),
                ("preemptions", "Requests preempted", s.preemptions),
                ("overlapped_steps", "Steps planned while the previous one ran",
                 s.overlapped_steps),
                ("spec_draft_tokens", "Speculative draft tokens verified", s.spec_draft_tokens),
                ("spec_accepted_tokens", "Speculative draft tokens accepted",
                 s.spec_accepted_tokens)):
            c = CounterMetricFamily(p + name, doc, labels=["model_name"])
            c.add_metric([self.model_name], value)
            yield c
        for name, doc, values, scale in (
                ("steps", "Computed steps by how the forward ran: graph (a decode CUDA graph), "
                 "piecewise (graphs around eager attention), eager", s.steps_by_path, 1),
                ("step_launch_seconds", "Host time spent queueing the steps of each path; on "
                 "the CPU, computing them", s.step_launch_ms_by_path, 1e3),
                ("step_device_seconds", "CUDA: the steps' span on the device, first kernel to "
                 "last", s.step_device_ms_by_path, 1e3)):
            c = CounterMetricFamily(p + name, doc, labels=["model_name", "path"])
            for path in STEP_PATHS:
                c.add_metric([self.model_name, path], values.get(path, 0) / scale)
            yield c


class RequestTimer:
    """Observes TTFT, inter-token latency and end-to-end latency of one choice."""

    def __init__(self, metrics: Metrics, start: float):
        self.m = metrics
        self.start = start
        self.first: float | None = None  # when the first token arrived (the access log's TTFT)
        self.last: float | None = None

    def on_delta(self, now: float, num_tokens: int) -> None:
        if num_tokens <= 0:
            return
        if self.last is None:
            self.first = now
            self.m.ttft.observe(now - self.start)
        else:
            self.m.itl.observe(now - self.last)
        self.last = now

    def on_finish(self, now: float, finish_reason: str, prompt_tokens: int,
                  completion_tokens: int) -> None:
        self.m.e2e.observe(now - self.start)
        self.m.count_finish(finish_reason)
        self.m.prompt_tokens.inc(prompt_tokens)
        self.m.generation_tokens.inc(completion_tokens)
