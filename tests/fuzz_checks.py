"""What the fuzzer asserts about one answer, and the live server it asserts it against.

`LiveServer` restarts the server when an example killed it, so the next example (and
hypothesis's shrinking) runs against a fresh one instead of hanging or failing for a
reason that is not its own.
"""

from __future__ import annotations

import json
import re
import socket
import threading
import time
from dataclasses import dataclass, field
from typing import Optional

import httpx

from server_process import ServerProcess

FINISH_REASONS = {"stop", "length", "tool_calls", "abort"}
CANARY = {"prompt": "The capital of France is", "max_tokens": 4, "temperature": 0,
          "stream": True}


@dataclass
class Answer:
    status: int  # 0: no HTTP answer (connection closed or timed out)
    headers: dict = field(default_factory=dict)
    body: bytes = b""
    note: str = ""  # why there is no answer, or that the client gave up on purpose

    def show(self) -> str:
        text = self.body[:600].decode("utf-8", "replace")
        return f"{self.status} {self.note} {text}".strip()


# ------------------------------------------------------------------ answer checks


def error_shape_problem(body: bytes) -> Optional[str]:
    """None when body is {"error": {"message": str, "type": str, "param", "code"}}."""
    try:
        doc = json.loads(body)
    except ValueError:
        return "the error body is not JSON"
    err = doc.get("error") if isinstance(doc, dict) else None
    if not isinstance(err, dict):
        return 'the error body has no "error" object'
    if not isinstance(err.get("message"), str) or not isinstance(err.get("type"), str):
        return '"error.message" and "error.type" must be strings'
    if "param" not in err or "code" not in err:
        return '"error.param" and "error.code" must be present (null allowed)'
    if not (err["param"] is None or isinstance(err["param"], str)):
        return '"error.param" must be a string or null'
    return None


def _choice_problem(kind: str, c: dict, stream: bool) -> Optional[str]:
    if not isinstance(c, dict) or not isinstance(c.get("index"), int):
        return f"a choice without an integer index: {c!r:.200}"
    fr = c.get("finish_reason")
    if not stream and fr not in FINISH_REASONS:
        return f"finish_reason {fr!r} is not one of {sorted(FINISH_REASONS)}"
    if stream and fr is not None and fr not in FINISH_REASONS:
        return f"finish_reason {fr!r} is not one of {sorted(FINISH_REASONS)}"
    if kind == "completion":
        if not isinstance(c.get("text"), str):
            return "a completion choice without a string text"
    elif stream:
        if not isinstance(c.get("delta"), dict):
            return "a chat chunk choice without a delta object"
    else:
        msg = c.get("message")
        if not isinstance(msg, dict) or msg.get("role") != "assistant":
            return "a chat choice without an assistant message"
        if not (msg.get("content") is None or isinstance(msg["content"], str)):
            return "message.content is neither a string nor null"
    return None


def completion_problem(kind: str, body: bytes, choices: Optional[int]) -> Optional[str]:
    """None when body is a well-formed non-streamed answer with `choices` choices."""
    try:
        doc = json.loads(body)
    except ValueError:
        return "a 2xx answer that is not JSON"
    want = "chat.completion" if kind == "chat" else "text_completion"
    if not isinstance(doc, dict) or doc.get("object") != want:
        return f"a 2xx answer whose object is not {want!r}"
    got = doc.get("choices")
    if not isinstance(got, list) or not got:
        return "a 2xx answer without choices"
    if choices is not None and len(got) != choices:
        return f"{len(got)} choices, expected {choices}"
    if sorted(c.get("index") for c in got if isinstance(c, dict)) != list(range(len(got))):
        return "choice indexes are not 0..n-1"
    for c in got:
        if (p := _choice_problem(kind, c, False)) is not None:
            return p
    usage = doc.get("usage")
    if not isinstance(usage, dict) or not all(isinstance(usage.get(k), int) for k in (
            "prompt_tokens", "completion_tokens", "total_tokens")):
        return "usage is missing or not integers"
    return None


def sse_events(body: bytes) -> list[str]:
    return [block[len("data: "):] for block in body.decode("utf-8").split("\n\n")
            if block.startswith("data: ")]


def stream_problem(kind: str, body: bytes, choices: Optional[int]) -> Optional[str]:
    """None when body is an SSE stream of chunks, each choice finishing once, then [DONE]."""
    try:
        events = sse_events(body)
    except UnicodeDecodeError:
        return "the stream is not UTF-8"
    if not events or events[-1] != "[DONE]":
        return "the stream does not end with data: [DONE]"
    finished: dict[int, int] = {}
    for ev in events[:-1]:
        try:
            chunk = json.loads(ev)
        except ValueError:
            return f"a stream event that is not JSON: {ev[:100]!r}"
        if isinstance(chunk, dict) and "error" in chunk:
            return f"an error event inside a 200 stream: {ev[:300]}"
        if not isinstance(chunk, dict) or not isinstance(chunk.get("choices"), list):
            return f"a chunk without choices: {ev[:100]!r}"
        for c in chunk["choices"]:
            if (p := _choice_problem(kind, c, True)) is not None:
                return p
            if c.get("finish_reason") is not None:
                finished[c["index"]] = finished.get(c["index"], 0) + 1
    if any(v != 1 for v in finished.values()):
        return "a choice finished more than once"
    if choices is not None and sorted(finished) != list(range(choices)):
        return f"choices {sorted(finished)} finished, expected 0..{choices - 1}"
    return None


def answer_problem(kind: str, ans: Answer, stream: bool, choices: Optional[int],
                   given_up_ok: bool) -> Optional[str]:
    """The property every answer must have; None when it holds."""
    if ans.status == 0:
        return None if given_up_ok and ans.note == "client gave up" else (
            f"no HTTP answer ({ans.note})")
    if ans.status >= 500:
        return f"a {ans.status} answer"
    ctype = ans.headers.get("content-type", "")
    if not 200 <= ans.status < 300:
        return error_shape_problem(ans.body)
    if ans.note == "client gave up":
        return None  # a long generation we stopped reading on purpose
    if stream and "text/event-stream" in ctype:
        return stream_problem(kind, ans.body, choices)
    return completion_problem(kind, ans.body, choices)


# ------------------------------------------------------------------ sending


def send_json(url: str, path: str, payload: bytes, headers: dict, timeout: float,
              give_up_after: Optional[float]) -> Answer:
    """POST payload; read the whole answer, or stop reading after give_up_after seconds
    (then the connection is closed: the server must abort the request)."""
    hdrs = {"Content-Type": "application/json", **headers}
    start = time.monotonic()
    try:
        with httpx.Client(timeout=timeout) as client:
            with client.stream("POST", url + path, content=payload, headers=hdrs) as r:
                chunks = []
                for chunk in r.iter_raw():
                    chunks.append(chunk)
                    if give_up_after and time.monotonic() - start > give_up_after:
                        return Answer(r.status_code, dict(r.headers), b"".join(chunks),
                                      "client gave up")
                return Answer(r.status_code, dict(r.headers), b"".join(chunks))
    except httpx.TimeoutException:
        return Answer(0, note="client gave up" if give_up_after else "timed out")
    except httpx.HTTPError as e:
        return Answer(0, note=f"{type(e).__name__}: {e}")


def send_raw(port: int, data: bytes, timeout: float) -> Answer:
    """Write raw bytes to the port and parse what comes back as HTTP (by hand: the server
    may answer in the request's own odd version, which http.client refuses)."""
    got = b""
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=timeout) as sock:
            try:
                sock.sendall(data)
            except OSError:
                pass  # the server may refuse before reading it all; its answer still counts
            while chunk := sock.recv(1 << 16):  # the request says Connection: close,
                got += chunk  # but an odd HTTP version may keep it open: stop at the length
                head, sep, body = got.partition(b"\r\n\r\n")
                length = re.search(rb"\r\ncontent-length: *(\d+)", head, re.I)
                if sep and length and len(body) >= int(length.group(1)):
                    break
    except OSError as e:
        if not got:
            return Answer(0, note=f"{type(e).__name__}: {e}")
    head, _, body = got.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    status = lines[0].split(" ")
    if len(status) < 2 or not status[0].startswith("HTTP/") or not status[1].isdigit():
        return Answer(0, note=f"not an HTTP answer: {got[:100]!r}")
    headers = {k.strip().lower(): v.strip() for k, _, v in (ln.partition(":") for ln in lines[1:])}
    if "chunked" in headers.get("transfer-encoding", ""):
        body = _dechunk(body)
    return Answer(int(status[1]), headers, body)


def _dechunk(body: bytes) -> bytes:
    out = b""
    while body:
        size, _, rest = body.partition(b"\r\n")
        try:
            n = int(size.split(b";")[0], 16)
        except ValueError:
            break
        if n == 0:
            break
        out += rest[:n]
        body = rest[n + 2:]
    return out


def canary(url: str, timeout: float = 120.0) -> str:
    """A greedy streamed completion: its text and finish reason, which must never change."""
    ans = send_json(url, "/v1/completions", json.dumps(CANARY).encode(), {}, timeout, None)
    if ans.status != 200:
        return f"<canary failed: {ans.show()}>"
    if (p := stream_problem("completion", ans.body, 1)) is not None:
        return f"<canary stream malformed: {p}>"
    text, finish = "", None
    for ev in sse_events(ans.body)[:-1]:
        for c in json.loads(ev)["choices"]:
            text += c["text"]
            finish = c["finish_reason"] or finish
    return json.dumps({"text": text, "finish_reason": finish})


def beside(fn, *args):
    """Run fn(*args) in a thread; returns a join() that gives its result."""
    box: list = []
    t = threading.Thread(target=lambda: box.append(fn(*args)), daemon=True)
    t.start()

    def join(timeout: float = 600):
        t.join(timeout)
        return box[0] if box else Answer(0, note="sender thread did not finish")
    return join


# ------------------------------------------------------------------ the live server


class LiveServer:
    """The embedded default model behind `pocketllm serve`, restarted after a death."""

    def __init__(self, *args: str, use_canary: bool = True):
        self.args = args
        self.use_canary = use_canary  # False: faster surveys, deaths still seen by /ready
        self.srv: Optional[ServerProcess] = None
        self.reference: Optional[str] = None
        self.restarts = 0
        self.last = ""  # the last example sent, shortly (to blame a late death on it)
        self.blamed = False  # whether the last example already failed for not being ready
        self.start()

    def start(self) -> None:
        self.srv = ServerProcess(*self.args)
        canary(self.srv.url)  # warm-up: the first request compiles and allocates
        ref = canary(self.srv.url)
        assert not ref.startswith("<"), ref
        assert self.reference in (None, ref), "the canary changed across a restart"
        self.reference = ref

    @property
    def url(self) -> str:
        return self.srv.url

    @property
    def port(self) -> int:
        return self.srv.port

    def ready(self) -> Optional[str]:
        """None when /ready says 200; else what it said."""
        if self.srv.proc.poll() is not None:
            return f"the server exited with status {self.srv.proc.returncode}"
        try:
            r = httpx.get(self.url + "/ready", timeout=10)
        except httpx.HTTPError as e:
            return f"/ready did not answer: {e}"
        return None if r.status_code == 200 else f"/ready said {r.status_code} {r.text[:200]}"

    def ensure(self) -> Optional[str]:
        """Before an example: a dead or unready server is replaced by a fresh one. Returns
        what was wrong when the last example had not already been blamed for it (it died
        after that example's checks passed), else None."""
        not_ready = self.ready()
        if not_ready is None:
            return None
        self.srv.stop()
        self.restarts += 1
        self.start()
        blamed, self.blamed = self.blamed, False
        return None if blamed else f"{not_ready}, after the previous example: {self.last}"

    def stop(self) -> int:
        return self.srv.stop()
