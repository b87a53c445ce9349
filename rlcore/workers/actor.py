"""The colocated actor / rollout / reference worker (one rank).

* actor: the policy with its optimizer (SFT and PPO updates), FSDP2-sharded or replicated
  (``resources.strategy``, see ``rlcore.engine.distributed``)
* rollout: an unsharded copy of the policy behind a RolloutEngine; it takes the
  actor's full weights before the first generation after every update
* ref: the frozen initial policy, wrapped like the actor, for KL terms
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import torch

from rlcore.algos.losses import agg_loss, kl_penalty, policy_loss
from rlcore.controller import Dispatch, register
from rlcore.engine import distributed
from rlcore.engine.logprob import response_log_probs, trim_left_padding
from rlcore.engine.model import DTYPES, load_causal_lm, load_tokenizer
from rlcore.protocol import Batch
from rlcore.rollout import ENGINES, SamplingParams
from rlcore.workers.optim import clipped_step, make_optimizer, micro_weight, minibatch_updates
from rlcore.workers.rank import RankWorker


def sequences(batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
    """(prompt ; response) ids and attention mask, ``[batch, prompt_len + response_len]``, less the
    prompt columns that are padding in every row (``trim_left_padding``)."""
    ids = torch.cat([batch["prompts"], batch["responses"]], dim=1)
    mask = torch.cat([batch["prompt_mask"], batch["response_mask"]], dim=1)
    return trim_left_padding(ids, mask)


def mean_metrics(rows: list[dict[str, float]]) -> dict[str, float]:
    keys = {k for r in rows for k in r}
    return {k: sum(float(r[k]) for r in rows if k in r) / sum(1 for r in rows if k in r) for k in keys}


class ActorRolloutRefWorker(RankWorker):
    def __init__(self, rank: int, world_size: int, num_threads: int, *, model_path: str, roles: tuple[str, ...],
                 dtype: str = "float32", attn_implementation: str = "sdpa", packed_forward: bool = False,
                 rollout_engine: str | None = None,
                 optim: dict[str, Any] | None = None, seed: int = 0, strategy: str = "ddp",
                 reshard_after_forward: bool = False, ref_reshard_after_forward: bool = False):
        super().__init__(rank, world_size, num_threads, seed)
        self.model_path = model_path
        self.roles = roles
        self.dtype = dtype
        self.attn = attn_implementation
        self.packed_forward = packed_forward
        self.engine_name = rollout_engine
        self.optim = optim or {}
        self.strategy = strategy
        self.reshard_after_forward = reshard_after_forward
        self.ref_reshard_after_forward = ref_reshard_after_forward
        self.rollout_stale = True

    def _load(self) -> torch.nn.Module:
        return load_causal_lm(self.model_path, dtype="float32", attn_implementation=self.attn,
                              packed_forward=self.packed_forward).to(self.device)

    @register(Dispatch.ONE_TO_ALL)
    def init_model(self) -> None:
        mp = DTYPES[self.dtype] if self.dtype != "float32" else None
        tok = load_tokenizer(self.model_path)
        self.tokenizer = tok
        self.actor = distributed.wrap(self.strategy, self._load(), self.device, mp,
                                      reshard_after_forward=self.reshard_after_forward)
        if "actor" in self.roles:
            self.actor.train()
            self.opt, self.sched = make_optimizer(self.actor, **self.optim)
        if "rollout" in self.roles:
            plain = self._load().to(DTYPES[self.dtype])
            self.engine = ENGINES.get(self.engine_name)(plain, eos_token_id=tok.eos_token_id,
                                                        pad_token_id=tok.pad_token_id)
        if "ref" in self.roles:
            self.ref = distributed.wrap(self.strategy, self._load().eval().requires_grad_(False), self.device, mp,
                                        reshard_after_forward=self.ref_reshard_after_forward)

    # ---------------------------------------------------------------- rollout
    @register(Dispatch.DP_COMPUTE)
    def generate(self, batch: Batch) -> Batch:
        """Sample responses for ``prompts``/``prompt_mask``; meta carries sampling and ``seed``."""
        if self.rollout_stale:  # collective: every rank reaches it on the same call
            self.engine.load_weights(distributed.full_state_dict(self.actor))
            self.rollout_stale = False
        params = SamplingParams(**batch.meta["sampling"])
        gen = torch.Generator(device=self.device).manual_seed(int(batch.meta["seed"]) * 1009 + self.rank)
        micro = int(batch.meta.get("micro_batch_size", len(batch)))
        outs = []
        for part in batch.split(micro):
            out = self.engine.generate(part["prompts"].to(self.device), part["prompt_mask"].to(self.device),
                                       params, generator=gen)
            outs.append(Batch({"responses": out["responses"].cpu(), "response_mask": out["response_mask"].cpu(),
                               "rollout_log_probs": out["log_probs"].cpu()}))
        return Batch.concat(outs)

    # -------------------------------------------------------------- log-probs
    def _log_probs(self, model, batch: Batch, micro: int, temperature: float, with_entropy: bool) -> Batch:
        logps, ents = [], []
        with torch.no_grad():
            for part in batch.split(micro):
                ids, mask = sequences(part)
                lp, ent = response_log_probs(model, ids.to(self.device), mask.to(self.device),
                                             part["responses"].to(self.device), temperature=temperature,
                                             with_entropy=with_entropy)
                logps.append(lp.cpu())
                ents.append(ent.cpu() if ent is not None else None)
        out = {"log_probs": torch.cat(logps)}
        if with_entropy:
            out["entropy"] = torch.cat(ents)
        return Batch(out)

    @register(Dispatch.DP_COMPUTE)
    def compute_log_prob(self, batch: Batch) -> Batch:
        out = self._log_probs(self.actor, batch, batch.meta["micro_batch_size"], batch.meta["temperature"], True)
        return Batch({"old_log_probs": out["log_probs"], "entropy": out["entropy"]})

    @register(Dispatch.DP_COMPUTE)
    def compute_ref_log_prob(self, batch: Batch) -> Batch:
        out = self._log_probs(self.ref, batch, batch.meta["micro_batch_size"], batch.meta["temperature"], False)
        return Batch({"ref_log_probs": out["log_probs"]})

    # ---------------------------------------------------------------- updates
    @register(Dispatch.DP_COMPUTE)
    def train_sft(self, batch: Batch) -> Batch:
        """One SFT optimizer step: mean negative log-likelihood of response tokens."""
        micro = int(batch.meta["micro_batch_size"])
        global_tokens = distributed.all_reduce_sum(float(batch["response_mask"].sum()), self.device)
        total = 0.0
        for part in batch.split(micro):
            ids, mask = sequences(part)
            lp, _ = response_log_probs(self.actor, ids.to(self.device), mask.to(self.device),
                                       part["responses"].to(self.device))
            rmask = part["response_mask"].to(self.device).float()
            nll = -(lp * rmask).sum() / rmask.sum().clamp(min=1)
            (nll * micro_weight(float(rmask.sum()), len(part), len(batch), global_tokens, "token-mean",
                                self.world_size)).backward()
            total += float(nll.detach()) * float(rmask.sum())
        lr = self.sched.get_last_lr()[0]
        grad_norm = clipped_step(self.actor, self.opt, self.sched, float(batch.meta["grad_clip"]))
        self.rollout_stale = True
        loss = distributed.all_reduce_sum(total, self.device) / max(global_tokens, 1.0)
        return Batch(meta={"metrics": {"sft/loss": loss, "sft/grad_norm": grad_norm, "sft/lr": lr}})

    def _actor_loss(self, part: Batch, cfg: dict[str, Any]) -> tuple[torch.Tensor, dict[str, float]]:
        ids, mask = sequences(part)
        rmask = part["response_mask"].to(self.device)
        lp, ent = response_log_probs(self.actor, ids.to(self.device), mask.to(self.device),
                                     part["responses"].to(self.device), temperature=cfg["temperature"],
                                     with_entropy=True, entropy_grad=cfg["entropy_coeff"] != 0)
        agg = cfg["loss_agg_mode"]
        pg, m = policy_loss(cfg["policy_loss"], old_log_prob=part["old_log_probs"].to(self.device), log_prob=lp,
                            advantages=part["advantages"].to(self.device), response_mask=rmask,
                            loss_agg_mode=agg, clip_ratio=cfg["clip_ratio"], clip_ratio_low=cfg["clip_ratio_low"],
                            clip_ratio_high=cfg["clip_ratio_high"], clip_ratio_c=cfg["clip_ratio_c"])
        entropy = agg_loss(ent, rmask, agg)
        loss = pg - cfg["entropy_coeff"] * entropy
        metrics = {f"actor/{k}": float(v) for k, v in m.items()}
        metrics.update({"actor/pg_loss": float(pg.detach()), "actor/entropy": float(entropy.detach())})
        if cfg["use_kl_loss"]:
            kl = agg_loss(kl_penalty(lp, part["ref_log_probs"].to(self.device), cfg["kl_loss_type"]), rmask, agg)
            loss = loss + cfg["kl_loss_coef"] * kl
            metrics["actor/kl_loss"] = float(kl.detach())
        return loss, metrics

    def _kl_to_ref(self, batch: Batch) -> dict[str, float]:
        """Summed ``old_log_probs - ref_log_probs`` over this rank's response tokens, and their count
        (summed over ranks and divided afterwards, this is the global token mean)."""
        mask = batch["response_mask"]
        kl = kl_penalty(batch["old_log_probs"], batch["ref_log_probs"], "kl") * mask
        return {"kl_ref_sum": float(kl.sum()), "kl_ref_tokens": float(mask.sum())}

    @register(Dispatch.DP_COMPUTE)
    def update_actor(self, batch: Batch) -> Batch:
        """PPO epochs over mini-batches of this rank's shard; meta['actor'] holds the loss settings.

        With the KL loss on and no ``ref_log_probs`` in the batch (the controller only fetches them
        when it needs them itself, for a KL penalty in the reward), the colocated reference model
        computes them here first: one worker call per step fewer, and nothing sent back and forth."""
        cfg = batch.meta["actor"]
        extra: dict[str, float] = {}
        if cfg["use_kl_loss"] and "ref_log_probs" not in batch:
            start = time.perf_counter()
            batch = batch.union(Batch(
                {"ref_log_probs": self._log_probs(self.ref, batch, cfg["micro_batch_size"], cfg["temperature"],
                                                  False)["log_probs"]}))
            extra["perf/ref_in_update_s"] = time.perf_counter() - start
        if "ref_log_probs" in batch:
            extra.update(self._kl_to_ref(batch))

        def optimizer_step() -> dict[str, float]:
            lr = self.sched.get_last_lr()[0]
            return {"actor/grad_norm": clipped_step(self.actor, self.opt, self.sched, cfg["grad_clip"]), "actor/lr": lr}

        rows = minibatch_updates(
            batch, epochs=cfg["ppo_epochs"], mini_batch_size=cfg["mini_batch_size"],
            micro_batch_size=cfg["micro_batch_size"], agg_mode=cfg["loss_agg_mode"],
            generator=torch.Generator().manual_seed(int(batch.meta["seed"]) * 7919 + self.rank),
            world_size=self.world_size, global_sum=lambda x: distributed.all_reduce_sum(x, self.device),
            micro_loss=lambda part: self._actor_loss(part, cfg), optimizer_step=optimizer_step)
        self.rollout_stale = True
        metrics = distributed.all_reduce_mean({**mean_metrics(rows), **extra}, self.device)
        if "kl_ref_sum" in metrics:
            metrics["actor/kl_ref"] = metrics.pop("kl_ref_sum") / max(metrics.pop("kl_ref_tokens"), 1.0)
        return Batch(meta={"metrics": metrics})

    # ------------------------------------------------------------ checkpoints
    @register(Dispatch.ONE_TO_ALL)
    def save(self, path: str) -> str:
        """Write a Hugging Face folder (weights + tokenizer) from rank 0."""
        state = distributed.checkpoint_state_dict(self.actor)  # collective
        if self.rank == 0:
            out = Path(path)
            out.mkdir(parents=True, exist_ok=True)
            self.actor.save_pretrained(out, state_dict={k: v.cpu().contiguous() for k, v in state.items()},
                                       safe_serialization=True)
            self.tokenizer.save_pretrained(out)
        return path
