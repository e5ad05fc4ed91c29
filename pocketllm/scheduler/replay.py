"""Replayed drafts, for benchmarks only (``pocketllm bench latency --speculative-replay``):
each request whose prompt was recorded proposes the recorded output that follows its
verified tokens.

The bench records the target's own greedy output in a run without speculation, then
replays it as drafts: as recorded, every draft is accepted (speculation's best case); each
token shifted to another id, none is (its worst case). No model's quality is measured,
only the cost of verifying k tokens a step, at either end.
"""

from __future__ import annotations

import json
from typing import Optional

from pocketllm.errors import InvalidRequestError

from .drafter import Drafter


def load_runs(path: str) -> list[tuple[list[int], list[int]]]:
    """The (prompt ids, output ids) pairs of a replay file: ``{"runs": [{"prompt": [...],
    "output": [...]}, ...]}``."""
    try:
        with open(path) as f:
            runs = json.load(f)["runs"]
        pairs = [(list(map(int, r["prompt"])), list(map(int, r["output"]))) for r in runs]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise InvalidRequestError(f"speculative_replay {path!r} is not a replay file: {e}",
                                  "speculative_replay") from e
    return pairs


class ReplayDrafter(Drafter):
    def __init__(self, k: int, runs: list[tuple[list[int], list[int]]]):
        super().__init__(k)
        self.runs = runs
        self._matched: dict[str, Optional[tuple[int, list[int]]]] = {}

    def _match(self, tokens: list[int]) -> Optional[tuple[int, list[int]]]:
        """(prompt length, output) of the longest recorded prompt that begins ``tokens``."""
        best = None
        for prompt, output in self.runs:
            if len(prompt) < len(tokens) and tokens[:len(prompt)] == prompt and (
                    best is None or len(prompt) > best[0]):
                best = (len(prompt), output)
        return best

    def candidates(self, request_id: str, tokens: list[int], want: int) -> list[int]:
        if request_id not in self._matched:
            self._matched[request_id] = self._match(tokens)
        match = self._matched[request_id]
        if match is None:
            return []
        n = len(tokens) - match[0]  # outputs verified so far
        return match[1][n:n + want]

    def forget(self, request_id: str) -> None:
        super().forget(request_id)
        self._matched.pop(request_id, None)
