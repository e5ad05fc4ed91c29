"""What one request's penalties need, kept up to date token by token: numpy arrays on the
host, which both samplers read (``layers/sampler.py`` through ``torch.from_numpy``,
``lite/sampler.py`` as they are). No torch here."""

from __future__ import annotations

import collections
import logging
from typing import Iterable, Sequence

import numpy as np

from pocketllm.proto.messages import SamplingSpec
from pocketllm.sampling import uses_output_counts

logger = logging.getLogger("pocketllm.worker")
F32 = np.float32


class TokenHistory:
    """What one request's penalties need, kept up to date token by token (never recounted).

    ``count_ids``/``counts``: distinct generated tokens and how often each came
    (frequency/presence only; never the prompt). ``seen_ids``: distinct tokens of
    prompt + output (repetition only). ``bias_ids``/``bias_values``: logit_bias, once.
    """

    def __init__(self, spec: SamplingSpec, prompt_ids: Sequence[int], output_ids: Sequence[int],
                 vocab_size: int):
        self.prompt_len = len(prompt_ids)
        self.count_ids = self.counts = None
        self._slots: dict[int, int] = {}  # token -> its index in count_ids
        if uses_output_counts(spec):
            self.count_ids = np.empty(0, dtype=np.int64)
            self.counts = np.empty(0, dtype=F32)
        self.seen_ids = None
        self._seen: set[int] = set()
        if spec.repetition_penalty != 1.0:
            self._seen = set(prompt_ids)
            self.seen_ids = np.array(sorted(self._seen), dtype=np.int64)
        self.bias_ids = self.bias_values = None
        if spec.logit_bias:
            # The control plane refuses out-of-vocabulary ids; never index past the logits.
            bias = {t: b for t, b in spec.logit_bias.items() if 0 <= t < vocab_size}
            if len(bias) != len(spec.logit_bias):
                logger.warning("logit_bias ids outside the vocabulary (%d) dropped", vocab_size)
            self.bias_ids = np.array(list(bias), dtype=np.int64)
            self.bias_values = np.array(list(bias.values()), dtype=F32)
        self.add_output(output_ids)

    def add_output(self, token_ids: Iterable[int]) -> None:
        token_ids = list(token_ids)
        if not token_ids:
            return
        if self.count_ids is not None:
            new_ids, new_counts = [], []
            for token, n in collections.Counter(token_ids).items():
                slot = self._slots.get(token)
                if slot is None:
                    self._slots[token] = len(self._slots)
                    new_ids.append(token)
                    new_counts.append(n)
                else:
                    self.counts[slot] += n
            if new_ids:
                self.count_ids = np.concatenate([self.count_ids, np.array(new_ids, np.int64)])
                self.counts = np.concatenate([self.counts, np.array(new_counts, F32)])
        if self.seen_ids is not None:
            new = [t for t in dict.fromkeys(token_ids) if t not in self._seen]
            if new:
                self._seen.update(new)
                self.seen_ids = np.concatenate([self.seen_ids, np.array(new, np.int64)])

    def output_counts(self) -> dict[int, int]:
        """token -> times generated (for tests and debugging; not on the hot path)."""
        if self.count_ids is None:
            return {}
        return dict(zip(self.count_ids.tolist(), map(int, self.counts.tolist())))
