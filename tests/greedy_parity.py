"""Greedy parity of the CPU block kernels' path with a float32 transformers reference.

The block kernels multiply activations quantized to 16 bits per block of 32, so their
logits differ from a float32 product by a little, and where the reference's top two
tokens are nearly tied greedy decoding may pick the other one (llama.cpp, with 8-bit
activations, departs from transformers at such positions on these prompts:
docs/cpu_kernels.md, "Accuracy"). What must hold is that every token
we chose is the reference's argmax given our own prefix, or within ``NEAR_TIE`` of its
largest logit: checked teacher-forced along our sequence, so a departure cannot hide the
positions after it.
"""

from __future__ import annotations

NEAR_TIE = 0.05  # logits; the smallest top-2 margin on the tests' prompts is 0.0136


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
