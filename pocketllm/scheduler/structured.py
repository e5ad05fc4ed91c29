"""The scheduler's side of structured output: requests waiting on their grammar's compile,
and each step's bitmask rows. (Compiling and matching themselves live in grammar.py.)"""

from __future__ import annotations

from typing import TYPE_CHECKING, Iterable, Optional

from pocketllm.proto.messages import ErrorDetail, ErrorKind, RequestError, TokenizedRequest

from .request import Request

if TYPE_CHECKING:
    from .grammar import Grammars


class StructuredRequests:
    def __init__(self, grammars: Optional["Grammars"]):
        # Constrained decoding (grammar.py); None: structured requests are refused.
        self.grammars = grammars
        self.compiling: dict[Request, None] = {}  # waiting on their grammar, in arrival order
        self.errors: list[tuple[str, str, str]] = []  # (id, why, param): the loop reports them

    def attach(self, request: Request, req: TokenizedRequest) -> Optional[RequestError]:
        """Start compiling the request's grammar, if it has one; or why it cannot have one."""
        spec = req.sampling.structured
        if spec is None:
            return None
        if self.grammars is None:
            return RequestError(req.request_id, "structured output is not available in "
                                "this engine", kind=ErrorKind.unsupported, param=spec.param)
        from .grammar import RequestGrammar

        # Stop ids: what ends the request once the grammar is complete.
        request.grammar = RequestGrammar(self.grammars, spec,
                                         list(req.eos_token_ids) + list(req.sampling.stop_token_ids))
        self.compiling[request] = None
        return None

    def poll(self, now: float) -> list[Request]:
        """Ready the matchers of finished compiles; return the requests whose grammar failed
        or compiled too long (their errors are recorded for the loop to report)."""
        failed = []
        for req in list(self.compiling):
            why = req.grammar.poll(now)
            if why is not None:
                del self.compiling[req]
                self.errors.append((req.request_id, why, req.grammar.spec.param))
                failed.append(req)
            elif req.grammar.ready:
                del self.compiling[req]
        return failed

    def next_admissible(self, waiting: Iterable[Request]) -> Optional[Request]:
        """The first waiting request whose grammar (if any) is compiled: a compiling
        request is passed over, never waited for."""
        return next((r for r in waiting if r not in self.compiling), None)

    def wait_s(self, now: float) -> Optional[float]:
        """How long the loop may sleep before a compiling grammar's time limit passes
        (None: nothing compiles, or no clock runs yet; a finished compile wakes it anyway)."""
        waits = [w for w in (r.grammar.deadline(now) for r in self.compiling) if w is not None]
        return max(0.0, min(waits)) if waits else None

    def rows(self, scheduled: dict[Request, int], drafts: dict[Request, list[int]]
             ) -> tuple[dict, list[tuple[Request, ErrorDetail]]]:
        """The plan's bitmask rows: one per structured request that samples in this step,
        and one more per draft it verifies; and the requests whose grammar cannot fill a
        row, or allows no token at all (an empty row would make the worker sample an
        arbitrary token)."""
        rows = [(req, drafts.get(req, [])) for req, n in scheduled.items()
                if req.grammar is not None
                and req.num_computed_tokens + n - len(drafts.get(req, ())) == req.num_tokens]
        if not rows:
            return {}, []
        return self.grammars.bitmask_rows(rows)
