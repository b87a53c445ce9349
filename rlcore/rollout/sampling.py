"""Sampling pieces every engine shares: the sampling parameters, top-k / top-p filtering, one-draw-per-row sampling,
and the de-duplication of prompts that a group's ``n`` rows share."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch


@dataclass(frozen=True)
class SamplingParams:
    max_new_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    greedy: bool = False


def filter_logits(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Mask (to -inf) tokens outside the top-k and outside the top-p nucleus; ``[batch, vocab]``."""
    if top_k > 0:
        kth = torch.topk(logits, min(top_k, logits.shape[-1]), dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True, dim=-1)
        probs = sorted_logits.softmax(-1)
        # drop a token when the mass before it already reaches top_p (the first always stays)
        drop_sorted = probs.cumsum(-1) - probs >= top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits


def sample_from(probs: torch.Tensor, generator: torch.Generator | None = None, *,
                u: torch.Tensor | None = None) -> torch.Tensor:
    """One token per row of ``probs`` (``[batch, vocab]``, non-negative), drawn with probability
    ``probs / probs.sum(-1)``: the first token whose cumulative sum exceeds a uniform draw (inverse
    CDF). One random number per row, where ``torch.multinomial`` draws one per vocabulary entry
    (ten times slower on a CPU at vocabulary 102). Float64 sums keep ``u * total < total``, so the
    index stays in range and a token of probability 0 is never drawn. ``u`` (``[batch, 1]`` float64 in
    [0, 1)): draws made by the caller instead of from ``generator``."""
    cdf = probs.double().cumsum(-1)
    if u is None:
        u = torch.rand((probs.shape[0], 1), generator=generator, device=probs.device, dtype=torch.float64)
    return (cdf <= u * cdf[:, -1:]).sum(-1)


def row_uniforms(seeds: Sequence[int], steps: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """``[len(seeds), steps]`` float64 uniforms in [0, 1): row ``i``'s from a generator seeded with ``seeds[i]``
    alone, so a row's draws depend on its seed and nothing else (not on the other rows of its call, nor on their
    number): what a generation call with per-row seeds samples each position with (:func:`sample_from`'s ``u``)."""
    out = torch.empty((len(seeds), steps), dtype=torch.float64)
    for i, seed in enumerate(seeds):
        out[i] = torch.rand(steps, generator=torch.Generator().manual_seed(int(seed)), dtype=torch.float64)
    return out.to(device)


def distinct_rows(input_ids: torch.Tensor, attention_mask: torch.Tensor
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The distinct (ids, mask) rows and, for every row, the index of its distinct row."""
    keyed = torch.where(attention_mask.bool(), input_ids, -1)
    distinct, index = torch.unique(keyed, dim=0, return_inverse=True)
    mask = (distinct >= 0).to(attention_mask.dtype)
    return torch.where(distinct >= 0, distinct, input_ids.new_zeros(())), mask, index
