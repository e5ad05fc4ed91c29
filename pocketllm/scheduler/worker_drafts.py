"""Drafts the worker proposes: a draft model it runs beside the target, the checkpoint's
MTP layer (and later a block drafter: anything that needs a model's own forward).

The scheduler asks a request's step for up to ``k`` proposals
(``StepPlan.propose_token_counts``) when the next step may draft, having given it blocks
for the positions the proposing writes; the worker returns them with the step's tokens
(``StepResult.proposed_token_ids``); the next step verifies those that still follow the
request's verified tokens, as any drafter's (``Drafter.propose``: pace and pause).

For benchmarks only, ``replay`` (``replay.py``) puts a recorded output in place of each
proposal's tokens, as many as the worker proposed: the worker's drafter does all its work,
and acceptance is the recording's (full or none). That is how a drafter with dummy
weights, which agrees with nothing, is measured at full acceptance.
"""

from __future__ import annotations

from typing import Optional

from .drafter import Drafter
from .replay import ReplayDrafter


class WorkerDrafter(Drafter):
    in_worker = True

    def __init__(self, k: int, replay: Optional[ReplayDrafter] = None):
        super().__init__(k)
        self._offers: dict[str, tuple[int, list[int]]] = {}  # (tokens they follow, drafts)
        self.replay = replay

    def offer(self, request_id: str, num_tokens: int, drafts: list[int]) -> None:
        """The worker's proposal to follow the request's first ``num_tokens`` tokens."""
        self._offers[request_id] = (num_tokens, list(drafts))

    def candidates(self, request_id: str, tokens: list[int], want: int) -> list[int]:
        at, drafts = self._offers.pop(request_id, (-1, []))
        drafts = drafts[:want] if at == len(tokens) else []
        if self.replay is not None and drafts:
            return self.replay.candidates(request_id, tokens, len(drafts))
        return drafts

    def forget(self, request_id: str) -> None:
        super().forget(request_id)
        self._offers.pop(request_id, None)
        if self.replay is not None:
            self.replay.forget(request_id)
