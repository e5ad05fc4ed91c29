"""Prometheus metrics for /metrics, in a private registry (one per server)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from ..proto.messages import STEP_PATHS, SchedulerStats

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.1, 0.25, 0.5, 1, 2.5)


class Metrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        p = "pocketllm_"
        self.requests = Counter(p + "requests", "Finished requests (choices) by finish reason",
                                ["finish_reason"], registry=r)
        self.running = Gauge(p + "requests_running", "Requests in the running batch", registry=r)
        self.waiting = Gauge(p + "requests_waiting", "Requests waiting to be scheduled",
                             registry=r)
        self.kv_used = Gauge(p + "kv_blocks_used", "KV-cache blocks in use", registry=r)
        self.kv_total = Gauge(p + "kv_blocks_total", "KV-cache blocks in all", registry=r)
        self.prefix_queries = Gauge(p + "prefix_cache_queries_tokens",
                                    "Prompt tokens looked up in the prefix cache (cumulative)",
                                    registry=r)
        self.prefix_hits = Gauge(p + "prefix_cache_hits_tokens",
                                 "Prompt tokens found in the prefix cache (cumulative)",
                                 registry=r)
        self.preemptions = Gauge(p + "preemptions", "Requests preempted (cumulative)", registry=r)
        self.overlapped = Gauge(p + "overlapped_steps", "Steps planned while the previous one "
                                "ran (cumulative)", registry=r)
        self.steps = Gauge(p + "steps", "Computed steps by how the forward ran: graph (a "
                           "decode CUDA graph), piecewise (graphs around eager attention), "
                           "eager (cumulative)", ["path"], registry=r)
        self.step_launch = Gauge(p + "step_launch_seconds", "Host time spent queueing the "
                                 "steps of each path; on the CPU, computing them (cumulative)",
                                 ["path"], registry=r)
        self.step_device = Gauge(p + "step_device_seconds", "CUDA: the steps' span on the "
                                 "device, first kernel to last (cumulative)", ["path"],
                                 registry=r)
        self.prompt_tokens = Counter(p + "prompt_tokens", "Prompt tokens processed", registry=r)
        self.generation_tokens = Counter(p + "generation_tokens", "Tokens generated", registry=r)
        self.ttft = Histogram(p + "time_to_first_token_seconds", "Time to first token",
                              buckets=LATENCY_BUCKETS, registry=r)
        self.itl = Histogram(p + "inter_token_latency_seconds", "Time between output deltas",
                             buckets=ITL_BUCKETS, registry=r)
        self.e2e = Histogram(p + "e2e_request_latency_seconds", "Request latency, end to end",
                             buckets=LATENCY_BUCKETS, registry=r)

    def update_engine(self, stats: SchedulerStats) -> None:
        self.running.set(stats.running)
        self.waiting.set(stats.waiting)
        self.kv_used.set(stats.kv_blocks_used)
        self.kv_total.set(stats.kv_blocks_total)
        self.prefix_queries.set(stats.prefix_cache_queries)
        self.prefix_hits.set(stats.prefix_cache_hits)
        self.preemptions.set(stats.preemptions)
        self.overlapped.set(stats.overlapped_steps)
        for path in STEP_PATHS:
            self.steps.labels(path=path).set(stats.steps_by_path.get(path, 0))
            self.step_launch.labels(path=path).set(
                stats.step_launch_ms_by_path.get(path, 0.0) / 1e3)
            self.step_device.labels(path=path).set(
                stats.step_device_ms_by_path.get(path, 0.0) / 1e3)

    def render(self, stats: SchedulerStats) -> bytes:
        self.update_engine(stats)
        return generate_latest(self.registry)


class RequestTimer:
    """Observes TTFT, inter-token latency and end-to-end latency of one choice."""

    def __init__(self, metrics: Metrics, start: float):
        self.m = metrics
        self.start = start
        self.last: float | None = None

    def on_delta(self, now: float, num_tokens: int) -> None:
        if num_tokens <= 0:
            return
        if self.last is None:
            self.m.ttft.observe(now - self.start)
        else:
            self.m.itl.observe(now - self.last)
        self.last = now

    def on_finish(self, now: float, finish_reason: str, prompt_tokens: int,
                  completion_tokens: int) -> None:
        self.m.e2e.observe(now - self.start)
        self.m.requests.labels(finish_reason=finish_reason).inc()
        self.m.prompt_tokens.inc(prompt_tokens)
        self.m.generation_tokens.inc(completion_tokens)
