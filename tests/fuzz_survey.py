"""Run the fuzzer's examples without stopping, and print each failure class once with
its smallest reproducer (top-level fields removed while it still fails the same way).

    python tests/fuzz_survey.py [--examples 150] [--random] [--out findings.md]

The pytest fuzzer (tests/test_fuzz_server.py) stops at the first failure and shrinks it;
this lists them all, which is what one wants on a server with many.
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import sys

sys.path.insert(0, os.path.dirname(__file__))

from hypothesis import HealthCheck, Phase, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from fuzz_checks import LiveServer  # noqa: E402
from fuzz_run import EngineNotReady, run_body, run_raw  # noqa: E402
from fuzz_strategies import (chat_bodies, completion_bodies, encode, headers,  # noqa: E402
                             raw_requests)


def class_key(kind: str, problems) -> str:
    """A failure class: the failure's type, status and message with numbers blanked."""
    cls, msg = problems[0]
    msg = re.sub(r"[0-9a-f]{32}|\d+", "#", msg)
    if '"message": "' in msg:  # an OpenAI-shaped body: its message says what failed
        msg = re.sub(r"answer: .*?(\"message\": \"[^\"]{0,50}).*", r"\1", msg, flags=re.S)
    else:  # aiohttp's own text, or a note
        msg = re.sub(r"(answer: .{0,80}).*", r"\1", msg, flags=re.S).replace("\n", " ")
    return f"{kind}/{cls.__name__}: {msg[:120]}"


def minimize(live: LiveServer, kind: str, spec: dict, hdrs: dict, problems):
    """Drop top-level fields and headers one at a time while the failure class holds."""
    key = class_key(kind, problems)

    def same(s, h) -> bool:
        live.ensure()
        got = run_body(live, kind, s, h)
        return bool(got) and class_key(kind, got) == key

    for name in list(spec):
        trial = {k: v for k, v in spec.items() if k != name}
        if trial and same(trial, hdrs):
            spec = trial
    for name in list(hdrs):
        trial = {k: v for k, v in hdrs.items() if k != name}
        if same(spec, trial):
            hdrs = trial
    return spec, hdrs


def report(found: dict, live: LiveServer, out) -> str:
    lines = [f"{len(found)} failure classes, server restarts: {live.restarts}", ""]
    for key, (_size, kind, spec, hdrs, problems) in sorted(found.items()):
        shown = repr(spec[:400]) if kind == "raw" else encode(spec)[:600]
        lines += [f"## {key}", f"- endpoint: {kind}", f"- body: `{shown}`"]
        if hdrs:
            lines.append(f"- headers: `{hdrs}`")
        lines += [f"- {cls.__name__}: {msg[:500]}" for cls, msg in problems] + [""]
    text = "\n".join(lines)
    if out:
        with open(out, "w") as f:
            f.write(text)
    return text


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--examples", type=int, default=150)
    ap.add_argument("--random", action="store_true")
    ap.add_argument("--out", default=None)
    ap.add_argument("--no-canary", action="store_true",
                    help="skip the canary (several times faster on a busy CPU)")
    ap.add_argument("--known", action="store_true",
                    help="only the known reproducers (tests/fuzz_known.py), each reported")
    ap.add_argument("--only", choices=["chat", "completion", "raw"], default=None)
    ns = ap.parse_args()
    live = LiveServer(use_canary=not ns.no_canary)

    def on_term(*_):  # stop the server too, then leave at once
        live.srv.proc.terminate()
        os._exit(1)
    signal.signal(signal.SIGTERM, on_term)
    try:
        return survey(ns, live)
    finally:
        live.stop()


def survey(ns, live: LiveServer) -> int:
    seen = [0]
    found: dict[str, tuple] = {}  # class -> (size, kind, spec, headers, problems)
    cfg = settings(max_examples=ns.examples, derandomize=not ns.random, database=None,
                   deadline=None, phases=(Phase.generate,),
                   suppress_health_check=list(HealthCheck))

    def record(kind, spec, hdrs, problems):
        seen[0] += 1
        if seen[0] % 25 == 0:
            print(f"[{seen[0]} examples, {len(found)} classes]", flush=True)
        if not problems:
            return
        key = class_key(kind, problems)
        if kind != "raw":  # the class is the failure and the fields that still cause it
            spec, hdrs = minimize(live, kind, spec, hdrs, problems)
            key += f" [fields: {', '.join(sorted(spec))}; headers: {', '.join(sorted(hdrs))}]"
        size = len(spec) if isinstance(spec, bytes) else len(encode(spec)) + len(str(hdrs))
        if key not in found or size < found[key][0]:
            found[key] = (size, kind, spec, hdrs, problems)
            print(f"[{len(found)} classes] {key}", flush=True)
            report(found, live, ns.out)

    def late(note):  # a death noticed only at the next example
        if note is not None:
            found[f"late death: {note[:200]}"] = (0, "late", {}, {}, [(EngineNotReady, note)])
            print(f"[late death] {note[:300]}", flush=True)

    def bodies(kind, strat):
        @cfg
        @given(spec=strat, hdrs=st.one_of(st.just({}), headers))
        def run(spec, hdrs):
            late(live.ensure())
            record(kind, spec, hdrs, run_body(live, kind, spec, hdrs))
        return run

    if ns.known:
        from fuzz_known import KNOWN
        for kind, spec, hdrs in KNOWN:
            late(live.ensure())
            problems = run_body(live, kind, spec, hdrs)
            print(f"{'FAIL' if problems else 'ok  '} {kind} {repr(spec)[:150]} {hdrs and list(hdrs)}",
                  flush=True)
            for cls, msg in problems:
                print(f"     {cls.__name__}: {msg[:300]}", flush=True)
        return 0
    if ns.only in (None, "raw"):
        @cfg
        @given(data=raw_requests())
        def run_raws(data):
            late(live.ensure())
            record("raw", data, {}, run_raw(live, data))
        run_raws()
    for kind, strat in (("completion", completion_bodies), ("chat", chat_bodies)):
        if ns.only in (None, kind):
            bodies(kind, strat)()

    print(report(found, live, ns.out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
