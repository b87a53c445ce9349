"""Generation with a plain transformers model and a KV cache (CPU or a single GPU).

A token loop instead of ``model.generate``: one prefill, then one cached forward per
new token, with sampling, EOS tracking and the sampled tokens' log-probs computed in
the same pass (so the trainer need not recompute them). The prefill runs each distinct
prompt once (a group's ``n`` rows share one prompt) and copies its KV cache to the rows.
"""

from __future__ import annotations

import torch
from transformers import DynamicCache

from rlcore.engine.sequence import position_ids, trim_left_padding
from rlcore.rollout.base import SamplingParams


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


def sample_from(probs: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """One token per row of ``probs`` (``[batch, vocab]``, non-negative), drawn with probability
    ``probs / probs.sum(-1)``: the first token whose cumulative sum exceeds a uniform draw (inverse
    CDF). One random number per row, where ``torch.multinomial`` draws one per vocabulary entry
    (ten times slower on a CPU at vocabulary 102). Float64 sums keep ``u * total < total``, so the
    index stays in range and a token of probability 0 is never drawn."""
    cdf = probs.double().cumsum(-1)
    u = torch.rand((probs.shape[0], 1), generator=generator, device=probs.device, dtype=torch.float64)
    return (cdf <= u * cdf[:, -1:]).sum(-1)


def distinct_rows(input_ids: torch.Tensor, attention_mask: torch.Tensor
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The distinct (ids, mask) rows and, for every row, the index of its distinct row."""
    keyed = torch.where(attention_mask.bool(), input_ids, -1)
    distinct, index = torch.unique(keyed, dim=0, return_inverse=True)
    mask = (distinct >= 0).to(attention_mask.dtype)
    return torch.where(distinct >= 0, distinct, input_ids.new_zeros(())), mask, index


class HFRolloutEngine:
    """Generates with its own unsharded copy of the policy, refreshed by ``load_weights``."""

    def __init__(self, model, *, eos_token_id: int, pad_token_id: int):
        self.model = model.eval()
        self.eos_token_id = eos_token_id
        self.pad_token_id = pad_token_id

    def load_weights(self, state_dict: dict[str, torch.Tensor]) -> None:
        self.model.load_state_dict(state_dict)

    @torch.inference_mode()  # no autograd bookkeeping at all (a few % of each small decode op on a CPU)
    def generate(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, params: SamplingParams,
                 generator: torch.Generator | None = None) -> dict[str, torch.Tensor]:
        input_ids, attention_mask = trim_left_padding(input_ids, attention_mask)
        batch = input_ids.shape[0]
        device = input_ids.device
        mask = attention_mask.clone()
        pos = position_ids(mask)
        cache = DynamicCache()
        tokens = torch.full((batch, params.max_new_tokens), self.pad_token_id, dtype=torch.long, device=device)
        log_probs = torch.zeros((batch, params.max_new_tokens), dtype=torch.float32, device=device)
        resp_mask = torch.zeros((batch, params.max_new_tokens), dtype=torch.long, device=device)
        alive = torch.ones(batch, dtype=torch.bool, device=device)
        # prefill: each distinct prompt once, then every row gets its prompt's cache and logits
        uniq_ids, uniq_mask, row_of = distinct_rows(input_ids, attention_mask)
        out = self.model(input_ids=uniq_ids, attention_mask=uniq_mask, position_ids=position_ids(uniq_mask),
                         past_key_values=cache, use_cache=True, logits_to_keep=1)
        cache.reorder_cache(row_of)
        logits = out.logits[row_of, -1].float()
        step_pos = pos[:, -1:]
        for t in range(params.max_new_tokens):
            if t > 0:
                out = self.model(input_ids=tokens[:, t - 1 : t], attention_mask=mask, position_ids=step_pos,
                                 past_key_values=cache, use_cache=True)
                logits = out.logits[:, -1].float()
            scaled = logits / params.temperature
            if params.greedy:
                next_tok = logits.argmax(-1)
            else:
                probs = filter_logits(scaled, params.top_k, params.top_p).softmax(-1)
                next_tok = sample_from(probs, generator)
            logp = scaled.log_softmax(-1).gather(-1, next_tok[:, None]).squeeze(-1)
            tokens[:, t] = torch.where(alive, next_tok, self.pad_token_id)
            log_probs[:, t] = torch.where(alive, logp, 0.0)
            resp_mask[:, t] = alive.long()
            alive &= next_tok != self.eos_token_id
            if not alive.any():
                break
            mask = torch.cat([mask, torch.ones((batch, 1), dtype=mask.dtype, device=device)], dim=1)
            step_pos = step_pos + 1
        return {"responses": tokens, "response_mask": resp_mask, "log_probs": log_probs}
