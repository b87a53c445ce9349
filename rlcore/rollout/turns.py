"""Rows that generate turn by turn, each at its own pace: what the agent loop drives (``rlcore.agents.loop``).

    rows = engine.open_rows(input_ids, attention_mask, params, budget=96, generator=g)
    while rows.running():
        for r in rows.step():          # one token for every running row; the rows whose turn just ended
            ...                        # (EOS, or the budget is used up): parse, call tools, then either
        rows.append(r, observation)    # queue the observation's token ids (the row runs again), or
        rows.finish(r)                 # end the row (its cache slot is released)

:class:`Trajectories` keeps what every engine shares: the response tensors ``[batch, budget]`` of a whole
trajectory (the model's tokens with ``response_mask`` 1 and their log-probs; observation tokens with mask 0;
``attention`` 1 on both), the sampling, and each row's state. The model's side is a :class:`RowModel` of the
engine: it feeds each row the tokens it has not seen yet (the last sampled token, then an observation's) and
returns the next-token logits: the static engine appends them to the row's own KV cache (prefilling only the new
tokens), the HF engine to its dynamic cache.

Sampling is a function of each row alone: the row's token at response column ``c`` is drawn with the uniform
``u[row, c]``, all drawn from the call's generator up front (``u`` ``[batch, budget]``). So a row's tokens do not
depend on when its tools answered or on which other rows shared its forward passes, and engines that compute the
same logits give the same tokens.

The logits themselves can differ in their last bits with the company a row keeps: an observation prefilled with
others of a different size, a decode step over a different set of rows. Those depend on when tools answer, so two
runs agree up to float rounding (and a rare token where two were all but tied). With ``token_by_token`` (params
``rollout.agent.deterministic``) an observation is fed one token per step, inside the same decode steps as the
other rows, and the engine keeps every step's shape fixed (the static engine: all slots, attention over the whole
cache, no compaction): each row's numbers are then those of its own tokens alone, and runs repeat exactly.
"""

from __future__ import annotations

from typing import Protocol

import torch

from rlcore.rollout.sampling import SamplingParams, filter_logits, sample_from

RUNNING, WAITING, DONE = 0, 1, 2


class RowModel(Protocol):
    def forward(self, rows: list[int], pending: list[list[int]]) -> torch.Tensor:
        """Feed row ``rows[i]`` the tokens ``pending[i]`` (after everything it was fed before); the logits after
        each row's last token, ``[len(rows), vocab]`` float32."""

    def release(self, row: int) -> None:
        """``row`` is finished: its cache may be reused."""


class Trajectories:
    """The response tensors and per-row state of rows generating turn by turn (module docstring). ``logits``
    ``[batch, vocab]``: the prompts' next-token logits, from the engine's prefill."""

    def __init__(self, model: RowModel, logits: torch.Tensor, params: SamplingParams, *, budget: int, eos_token_id: int,
                 pad_token_id: int, generator: torch.Generator | None = None, token_by_token: bool = False):
        batch, device = logits.shape[0], logits.device
        self.model, self.params, self.budget, self.eos = model, params, budget, eos_token_id
        self.token_by_token = token_by_token
        self.responses = torch.full((batch, budget), pad_token_id, dtype=torch.long, device=device)
        self.response_mask = torch.zeros((batch, budget), dtype=torch.long, device=device)
        self.attention = torch.zeros((batch, budget), dtype=torch.long, device=device)
        self.log_probs = torch.zeros((batch, budget), dtype=torch.float32, device=device)
        self.u = None if params.greedy else torch.rand((batch, budget), generator=generator, device=device,
                                                       dtype=torch.float64)
        self.logits = logits.float().clone()
        self.col = [0] * batch  # the response column a row writes next
        self.turn_start = [0] * batch  # where the row's current turn began
        self.state = [RUNNING] * batch
        self.pending: list[list[int]] = [[] for _ in range(batch)]  # tokens the model has not been fed yet
        self.stats = {"forwards": 0, "observation_tokens": 0}

    def __len__(self) -> int:
        return len(self.state)

    def running(self) -> list[int]:
        return [r for r, s in enumerate(self.state) if s == RUNNING]

    def active(self) -> bool:
        """Some row is not finished."""
        return any(s != DONE for s in self.state)

    def step(self) -> list[int]:
        """One token for every running row (after feeding the model what they have pending); returns the rows
        whose turn ended with it: at EOS, or with the budget used up. Those wait for :meth:`append` or
        :meth:`finish`."""
        running = self.running()
        if not running:
            return []
        device = self.logits.device
        fed = [r for r in running if self.pending[r]]
        if fed:
            take = 1 if self.token_by_token else None
            fed_index = torch.tensor(fed, device=device)
            self.logits[fed_index] = self.model.forward(fed, [self.pending[r][:take] for r in fed]).float()
            for r in fed:
                self.pending[r] = self.pending[r][1:] if take else []
            self.stats["forwards"] += 1
        rows = [r for r in running if not self.pending[r]]  # (token by token: rows still reading an observation wait)
        if not rows:
            return []
        index = fed_index if rows == fed else torch.tensor(rows, device=device)
        cols = torch.tensor([self.col[r] for r in rows], device=device)
        tokens, logp = self._sample(self.logits[index], index, cols)
        self.responses[index, cols] = tokens
        self.log_probs[index, cols] = logp
        self.response_mask[index, cols] = 1
        self.attention[index, cols] = 1
        ended = []
        for r, tok in zip(rows, tokens.tolist()):
            self.col[r] += 1
            self.pending[r] = [tok]
            if tok == self.eos or self.col[r] == self.budget:
                self.state[r] = WAITING
                ended.append(r)
        return ended

    def _sample(self, logits: torch.Tensor, index: torch.Tensor, cols: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
        p = self.params
        scaled = logits / p.temperature
        if p.greedy:
            tokens = logits.argmax(-1)
        else:
            assert self.u is not None
            probs = filter_logits(scaled, p.top_k, p.top_p).softmax(-1)
            tokens = sample_from(probs, u=self.u[index, cols][:, None])
        return tokens, scaled.log_softmax(-1).gather(-1, tokens[:, None]).squeeze(-1)

    def turn_tokens(self, row: int) -> list[int]:
        """The tokens the model sampled in ``row``'s current turn (its EOS included)."""
        return self.responses[row, self.turn_start[row]:self.col[row]].tolist()

    def turns(self, rows: list[int]) -> list[list[int]]:
        """:meth:`turn_tokens` of each of ``rows``, read in one transfer."""
        if not rows:
            return []
        lo, hi = min(self.turn_start[r] for r in rows), max(self.col[r] for r in rows)
        block = self.responses[rows, lo:hi].tolist()
        return [b[self.turn_start[r] - lo:self.col[r] - lo] for r, b in zip(rows, block)]

    def stopped_at_eos(self, row: int) -> bool:
        return self.col[row] > self.turn_start[row] and int(self.responses[row, self.col[row] - 1]) == self.eos

    def room(self, row: int) -> int:
        """Response columns ``row`` has left."""
        return self.budget - self.col[row]

    def append(self, row: int, ids: list[int]) -> None:
        """Observation tokens after ``row``'s ended turn (out of the loss: ``response_mask`` 0); the row runs
        again. They must leave room for at least one model token."""
        self.append_many([row], [ids])

    def append_many(self, rows: list[int], observations: list[list[int]]) -> None:
        """:meth:`append` of ``observations[i]`` to ``rows[i]`` for every ``i``, written in one go."""
        for row, ids in zip(rows, observations):
            if self.state[row] != WAITING:
                raise ValueError(f"row {row} is not waiting for an observation")
            c = self.col[row]
            if not ids or c + len(ids) >= self.budget:
                raise ValueError(f"row {row}: {len(ids)} observation tokens at column {c} leave no room in "
                                 f"{self.budget}")
        if not rows:
            return
        at = [(row, self.col[row] + j) for row, ids in zip(rows, observations) for j in range(len(ids))]
        index = torch.tensor(at, dtype=torch.long, device=self.responses.device).T
        self.responses[index[0], index[1]] = torch.tensor([i for ids in observations for i in ids], dtype=torch.long,
                                                          device=self.responses.device)
        self.attention[index[0], index[1]] = 1
        for row, ids in zip(rows, observations):
            self.col[row] += len(ids)
            self.turn_start[row] = self.col[row]
            self.pending[row] = self.pending[row] + list(ids)
            self.stats["observation_tokens"] += len(ids)
            self.state[row] = RUNNING

    def finish(self, row: int) -> None:
        if self.state[row] != DONE:
            self.state[row] = DONE
            self.model.release(row)

    def result(self) -> dict[str, torch.Tensor]:
        """``responses``, ``response_mask`` (the model's tokens), ``log_probs`` and ``attention`` (every trajectory
        token), each ``[batch, budget]``."""
        return {"responses": self.responses, "response_mask": self.response_mask, "log_probs": self.log_probs,
                "attention": self.attention}
