"""Greedy parity of the CPU block kernels' path with a float32 transformers reference.

The block kernels multiply 8-bit activations (as llama.cpp does), so their logits differ
from a float32 product by a little, and where the reference's top two tokens are nearly
tied greedy decoding may pick the other one; llama.cpp departs from transformers at such
positions too (docs/cpu_kernels.md, "Greedy parity"). What must hold is that every token
we chose is the reference's argmax given our own prefix, or within ``NEAR_TIE`` of its
largest logit: checked teacher-forced along our sequence, so a departure cannot hide the
positions after it.
"""

from __future__ import annotations

NEAR_TIE = 0.25  # logits; the block path's error on these models stays well inside it


def near_tie_departures(hf_model, prompt_ids: list[int], ours: list[int]) -> list[tuple[int, float]]:
    """(position, reference max logit - logit of our token) where ours is not the argmax.
    Raises AssertionError if any of those gaps reaches ``NEAR_TIE``."""
    import torch

    with torch.inference_mode():
        logits = hf_model(torch.tensor([prompt_ids + ours])).logits[0, len(prompt_ids) - 1:-1]
    gaps = logits.max(dim=-1).values - logits[torch.arange(len(ours)), torch.tensor(ours)]
    departures = [(i, float(g)) for i, g in enumerate(gaps) if g > 0]
    assert all(g < NEAR_TIE for _, g in departures), departures
    return departures
