"""A scripted policy behind the engines' turn-by-turn interface (rlcore.rollout.turns), for exact tests of the agent
loop: row ``r`` writes ``script[r][k]`` (its characters, then EOS) as its ``k``-th turn, and EOS once its turns run
out. Logits put all the mass on the scripted token, so greedy and sampled decoding both follow the script."""

from __future__ import annotations

import time

import torch

from rlcore.rollout.base import SamplingParams
from rlcore.rollout.turns import Trajectories


class ScriptedRows:
    def __init__(self, tokenizer, script: list[list[str]]):
        self.tok, self.eos, self.vocab = tokenizer, tokenizer.eos_token_id, len(tokenizer)
        self.turns = [[tokenizer(t, add_special_tokens=False)["input_ids"] for t in rows] for rows in script]
        self.turn = [0] * len(script)  # each row's turn
        self.pos = [0] * len(script)  # tokens written in it
        self.fed: list[list[int]] = [[] for _ in script]  # every token the rows were fed
        self.released: dict[int, float] = {}  # row -> when the loop finished it (time.monotonic)

    def next_logits(self, row: int) -> torch.Tensor:
        turns, k, i = self.turns[row], self.turn[row], self.pos[row]
        token = turns[k][i] if k < len(turns) and i < len(turns[k]) else self.eos
        logits = torch.full((self.vocab,), -50.0)
        logits[token] = 50.0
        return logits

    def forward(self, rows: list[int], pending: list[list[int]]) -> torch.Tensor:
        for r, p in zip(rows, pending):
            self.fed[r] += p
            if len(p) > 1:  # an observation: the next turn starts
                self.turn[r] += 1
                self.pos[r] = 0
            else:
                self.pos[r] += 1
        return torch.stack([self.next_logits(r) for r in rows])

    def release(self, row: int) -> None:
        self.released[row] = time.monotonic()


class ScriptedEngine:
    """``open_rows`` over :class:`ScriptedRows` (the prompts are ignored)."""

    def __init__(self, tokenizer, script: list[list[str]]):
        self.tok, self.script = tokenizer, script
        self.rows: ScriptedRows | None = None

    def open_rows(self, input_ids, attention_mask, params: SamplingParams, *, budget: int, generator=None,
                  deterministic: bool = False):
        assert not deterministic, "the script reads an observation as one pending run"
        self.rows = ScriptedRows(self.tok, self.script)
        logits = torch.stack([self.rows.next_logits(r) for r in range(len(self.script))])
        return Trajectories(self.rows, logits, params, budget=budget, eos_token_id=self.tok.eos_token_id,
                            pad_token_id=self.tok.pad_token_id, generator=generator)


class ScriptedChatEngine:
    """A policy behind the engines' ``generate`` whose completion is ``reply(prompt_text)`` (its characters, then EOS;
    cut at ``max_new_tokens``), for exact tests of the openai loop: the log-prob of the token at response position
    ``j`` is ``-(j + 1) / 100``. ``calls`` keeps every engine call's prompts (token ids) and ``seeds``."""

    def __init__(self, tokenizer, reply, *, context: int = 512):
        from types import SimpleNamespace

        self.tok, self.reply = tokenizer, reply
        self.model = SimpleNamespace(config=SimpleNamespace(max_position_embeddings=context,
                                                            vocab_size=len(tokenizer)))
        self.calls: list[tuple[list[list[int]], list[int] | None]] = []

    def generate(self, input_ids, attention_mask, params: SamplingParams, generator=None, *, seeds=None):
        prompts = [ids[m.bool()].tolist() for ids, m in zip(input_ids, attention_mask)]
        self.calls.append((prompts, None if seeds is None else list(seeds)))
        width = params.max_new_tokens
        out = torch.full((len(prompts), width), self.tok.pad_token_id, dtype=torch.long)
        mask = torch.zeros((len(prompts), width), dtype=torch.long)
        for i, p in enumerate(prompts):
            text = self.reply(self.tok.decode(p, skip_special_tokens=False))
            ids = (self.tok(text, add_special_tokens=False)["input_ids"] + [self.tok.eos_token_id])[:width]
            out[i, :len(ids)] = torch.tensor(ids)
            mask[i, :len(ids)] = 1
        log_probs = -(torch.arange(width, dtype=torch.float32) + 1)[None, :].expand(len(prompts), -1) / 100 * mask
        return {"responses": out, "response_mask": mask, "log_probs": log_probs}
