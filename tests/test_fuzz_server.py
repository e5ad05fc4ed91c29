"""Property-based fuzzing of `pocketllm serve` (the embedded default model, on CPU).

For every generated request — bodies over every field of /v1/chat/completions and
/v1/completions (tests/fuzz_strategies.py: valid, boundary and hostile values, odd
text, deep nesting, unknown fields, odd headers) and raw HTTP bytes — the test asserts:

- the answer is not a 5xx; a non-2xx answer is OpenAI-shaped
  ({"error": {"message", "type", "param", "code"}}); a 2xx answer is a well-formed
  completion, or an SSE stream where every choice finishes once, then [DONE];
- /ready still says 200 afterwards;
- a greedy streamed canary sent beside it gets exactly its reference text;
- its request id (body or X-Request-Id) can be used again once it has ended.

The requests known to have broken the server (tests/fuzz_known.py) are tried first.

A server killed by an example is restarted before the next one (tests/fuzz_checks.py),
so the failure is reported with its reproducer instead of hanging the run.

CI runs a fixed, reproducible set (hypothesis `derandomize`): 100 chat bodies, 100
completion bodies, 60 raw requests, about 3 minutes on 2 CPU cores. Flags (environment):

- POCKETLLM_FUZZ_EXAMPLES=5000   examples per test instead of the CI counts;
- POCKETLLM_FUZZ_RANDOM=1        a random search (new examples each run; failures are
                                 saved in .hypothesis/ and replayed first next time).

Only the fuzzer: `python -m pytest -q tests/test_fuzz_server.py`. To list every
failure class at once instead of stopping at the first: `python tests/fuzz_survey.py`.
"""

from __future__ import annotations

import os

import pytest
from hypothesis import HealthCheck, Phase, example, given, note, settings
from hypothesis import strategies as st

from fuzz_checks import LiveServer
from fuzz_known import KNOWN
from fuzz_run import EngineNotReady, run_body, run_raw
from fuzz_strategies import chat_bodies, completion_bodies, headers, raw_requests

RANDOM = os.environ.get("POCKETLLM_FUZZ_RANDOM") == "1"
EXAMPLES = int(os.environ.get("POCKETLLM_FUZZ_EXAMPLES", "0"))


def fuzz_settings(ci_examples: int) -> settings:
    return settings(
        max_examples=EXAMPLES or ci_examples,
        derandomize=not RANDOM,  # CI: the same examples every run
        database=None if not RANDOM else settings.default.database,
        deadline=None,  # a CPU decode is slow and uneven; the canary checks starvation
        phases=(Phase.explicit, Phase.reuse, Phase.generate, Phase.shrink),
        suppress_health_check=list(HealthCheck),  # big bodies and slow examples are the point
        print_blob=True,
    )


def known(kind: str):
    """Try the requests known to have broken the server first (tests/fuzz_known.py)."""
    def decorate(test):
        for k, spec, hdrs in reversed(KNOWN):
            if k == kind:
                test = example(spec=spec, hdrs=hdrs)(test)
        return test
    return decorate


@pytest.fixture(scope="module")
def live(default_model_path):
    server = LiveServer()
    yield server
    server.stop()


def _ensure(live: LiveServer) -> None:
    late = live.ensure()
    if late is not None:
        raise EngineNotReady(late)


def _assert_none(problems) -> None:
    for kind, message in problems:
        note(f"{kind.__name__}: {message}")
    if problems:
        kind, message = problems[0]
        raise kind("; ".join(f"{k.__name__}: {m}" for k, m in problems))


@pytest.mark.slow
@fuzz_settings(100)
@given(spec=chat_bodies, hdrs=st.one_of(st.just({}), headers))
@known("chat")
def test_chat_bodies(live, spec, hdrs):
    _ensure(live)
    _assert_none(run_body(live, "chat", spec, hdrs))


@pytest.mark.slow
@fuzz_settings(100)
@given(spec=completion_bodies, hdrs=st.one_of(st.just({}), headers))
@known("completion")
def test_completion_bodies(live, spec, hdrs):
    _ensure(live)
    _assert_none(run_body(live, "completion", spec, hdrs))


@pytest.mark.slow
@fuzz_settings(60)
@given(data=raw_requests())
def test_raw_requests(live, data):
    _ensure(live)
    note(f"raw request ({len(data)} bytes): {data[:300]!r}")
    _assert_none(run_raw(live, data))
