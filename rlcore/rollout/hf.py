"""Generation with a plain transformers model and a KV cache (CPU or a single GPU).

A token loop instead of ``model.generate``: one prefill, then one cached forward per
new token, with sampling, EOS tracking and the sampled tokens' log-probs computed in
the same pass (so the trainer need not recompute them). The prefill runs each distinct
prompt once (a group's ``n`` rows share one prompt) and copies its KV cache to the rows.
"""

from __future__ import annotations

from typing import Sequence

import torch
from transformers import DynamicCache

from rlcore.engine.sequence import position_ids, trim_left_padding
from rlcore.rollout.base import SamplingParams, load_into
from rlcore.rollout.sampling import distinct_rows, filter_logits, row_uniforms, sample_from
from rlcore.rollout.turns import Trajectories


class HFRolloutEngine:
    """Generates with its own unsharded copy of the policy, refreshed by ``load_weights``."""

    def __init__(self, model, *, eos_token_id: int, pad_token_id: int):
        self.model = model.eval()
        self.eos_token_id = eos_token_id
        self.pad_token_id = pad_token_id

    def load_weights(self, state_dict: dict[str, torch.Tensor]) -> None:
        load_into(self.model, state_dict)

    @torch.inference_mode()
    def log_probs(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, responses: torch.Tensor
                  ) -> torch.Tensor:
        ids = torch.cat([input_ids, responses], dim=1)
        mask = torch.cat([attention_mask, torch.ones_like(responses, dtype=attention_mask.dtype)], dim=1)
        out = self.model(input_ids=ids, attention_mask=mask, position_ids=position_ids(mask), use_cache=False)
        logits = out.logits[:, input_ids.shape[1] - 1 : -1].float()
        return logits.log_softmax(-1).gather(-1, responses[..., None]).squeeze(-1)

    def open_rows(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, params: SamplingParams, *,
                  budget: int, generator: torch.Generator | None = None, deterministic: bool = False) -> Trajectories:
        """Rows that generate turn by turn (:mod:`rlcore.rollout.turns`) over one dynamic KV cache (see
        :class:`_HFRows`); ``budget``: response columns per row. ``deterministic``: observations fed token by token
        (the cache still grows with every forward, so a row's numbers can still vary in their last bits with the
        others' schedule: the static engine is the deterministic one)."""
        with torch.inference_mode():
            input_ids, attention_mask = trim_left_padding(input_ids, attention_mask)
            cache = DynamicCache()
            uniq_ids, uniq_mask, row_of = distinct_rows(input_ids, attention_mask)
            out = self.model(input_ids=uniq_ids, attention_mask=uniq_mask, position_ids=position_ids(uniq_mask),
                             past_key_values=cache, use_cache=True, logits_to_keep=1)
            cache.reorder_cache(row_of)
            logits = out.logits[row_of, -1].float()
        rows = _HFRows(self.model, cache, attention_mask, self.pad_token_id)
        return Trajectories(rows, logits, params, budget=budget, eos_token_id=self.eos_token_id,
                            pad_token_id=self.pad_token_id, generator=generator, token_by_token=deterministic)

    @torch.inference_mode()  # no autograd bookkeeping at all (a few % of each small decode op on a CPU)
    def generate(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, params: SamplingParams,
                 generator: torch.Generator | None = None, *, seeds: Sequence[int] | None = None
                 ) -> dict[str, torch.Tensor]:
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
        own = None if seeds is None or params.greedy else row_uniforms(seeds, params.max_new_tokens, device)
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
                next_tok = sample_from(probs, generator, u=None if own is None else own[:, t:t + 1])
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


class _HFRows:
    """The HF engine's side of :class:`~rlcore.rollout.turns.Trajectories`: one dynamic cache for every row. A
    forward appends as many columns as the longest pending run to every row; a row's own tokens sit at the right
    of its new columns and the rest of its columns are masked out (a row with nothing pending gets only masked
    columns), positions counting each row's real tokens only. Any causal LM; the cache grows by the widest run
    each forward and finished rows keep their place (the static engine is the fast one)."""

    def __init__(self, model, cache: DynamicCache, mask: torch.Tensor, pad_token_id: int):
        self.model, self.cache, self.pad = model, cache, pad_token_id
        self.mask = mask.clone()  # [batch, cache columns]
        self.pos = mask.long().sum(-1)  # [batch] each row's next position

    def release(self, row: int) -> None:
        pass

    @torch.inference_mode()
    def forward(self, rows: list[int], pending: list[list[int]]) -> torch.Tensor:
        batch, device = self.mask.shape[0], self.mask.device
        width = max(len(p) for p in pending)
        ids = torch.full((batch, width), self.pad, dtype=torch.long, device=device)
        new_mask = torch.zeros((batch, width), dtype=self.mask.dtype, device=device)
        pos = torch.zeros((batch, width), dtype=torch.long, device=device)
        for r, p in zip(rows, pending):
            ids[r, width - len(p):] = torch.tensor(p, device=device)
            new_mask[r, width - len(p):] = 1
            pos[r, width - len(p):] = int(self.pos[r]) + torch.arange(len(p), device=device)
            self.pos[r] += len(p)
        self.mask = torch.cat([self.mask, new_mask], dim=1)
        out = self.model(input_ids=ids, attention_mask=self.mask, position_ids=pos, past_key_values=self.cache,
                         use_cache=True, logits_to_keep=1)
        return out.logits[torch.tensor(rows, device=device), -1].float()
