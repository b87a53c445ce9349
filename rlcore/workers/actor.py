"""The colocated actor / rollout / reference worker of a PPO round (one rank).

* actor: the policy with its optimizer, replicated or FSDP2-sharded (``resources.strategy``,
  ``rlcore.engine.strategy``), every parameter trained or a LoRA adapter (``actor.lora``);
* rollout: a rollout engine over an unsharded copy of the policy; it takes the actor's weights (with LoRA:
  the adapters' only) before the first generation after every update; each sync's tensors are checked, and
  its computation with a probe batch at the first sync and every tenth (``rlcore.engine.sync_check``). Where the
  engine can run on the actor's own tensors (a replicated float32 policy, the static engine) there is no copy and
  nothing to sync;
* ref: the frozen initial policy, wrapped like the actor, for KL terms (optional). With LoRA there is no
  second model: the reference is the actor with its adapter disabled (or switched to a frozen copy of the
  adapter the round started from, ``rlcore.engine.lora``).

Every method takes a Batch of tensors and a typed, frozen settings object, and returns a Batch
or :data:`~rlcore.protocol.Metrics`.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from rlcore.algos.aggregation import AggScale, agg_loss
from rlcore.algos.kl import kl_penalty
from rlcore.algos.losses import POLICY_LOSSES, policy_loss
from rlcore.config import OffPolicyConfig, PolicyLossConfig
from rlcore.controller.decorator import Dispatch, RankPlacement, register
from rlcore.engine import distributed, peak_memory, sync_check
from rlcore.engine.lora import reference_weights
from rlcore.engine.model import ModelSpec, load_policy, load_tokenizer, save_pretrained
from rlcore.engine.sequence import SequenceModel, sequences
from rlcore.engine.weights import WeightsPayload, pack_state
from rlcore.protocol import Batch, Metrics
from rlcore.registry import options_from
from rlcore.rollout.base import EngineSpec
from rlcore.workers.log_probs import LogProbSpec, response_log_probs
from rlcore.workers.minibatch import MicroResult, minibatch_updates
from rlcore.workers.optim import OptimSpec, clipped_step, make_optimizer, update_metrics
from rlcore.workers.proximal import ProximalMeasures, ProximalSource, RolloutLogProbs
from rlcore.workers.rank import RankWorker
from rlcore.workers.rollout import AgentRunners, GenerateSpec, generate_on, make_trainer_engine
from rlcore.workers.state import TrainedModelState


@dataclass(frozen=True)
class KLLossSpec:
    """The KL(actor || reference) term of the actor loss."""

    estimator: str
    """``rlcore.algos.kl.KL_ESTIMATORS`` name."""
    coef: float


@dataclass(frozen=True)
class ActorUpdateSpec:
    """One PPO actor update (params.yaml ``actor``)."""

    epochs: int
    mini_batch_size: int
    """Rows of this rank per optimizer step."""
    micro_batch_size: int
    grad_clip: float
    temperature: float
    loss: PolicyLossConfig
    """params.yaml ``actor.loss`` as it is, its nulls resolved: the policy loss (each loss reads the options it
    declares) and the aggregation of every term of the actor loss."""
    entropy_coeff: float
    kl: KLLossSpec | None
    """None: no KL loss term."""
    seed: int
    """Seeds the mini-batch shuffle."""
    proximal: ProximalSource = RolloutLogProbs()
    """Where the old log-probs come from (``rlcore.workers.proximal``): the rollout's own, a trainer forward before
    the update, or the update's own first forward."""
    off_policy: OffPolicyConfig | None = None
    """params.yaml ``actor.off_policy``: the correction of the proximal policy over the behaviour (rollout) one,
    importance weights on each token's loss (None: no correction)."""


class ActorRolloutRefWorker(TrainedModelState, RankWorker):
    # step checkpoints hold the actor only: the reference is the round's initial model, the rollout copy follows
    state_name, state_model = "actor", "actor"

    def __init__(self, placement: RankPlacement, *, model: ModelSpec, engine: EngineSpec, optim: OptimSpec,
                 with_ref: bool, seed: int = 0):
        super().__init__(placement, seed)
        self.model_spec = model
        self.engine_spec = engine
        self.optim_spec = optim
        self.with_ref = with_ref
        self.rollout_stale = True
        self.peaks: Metrics = {}  # perf/peak_mem_*_mib of the phases since the last update (reported by it)

    @register(Dispatch.ONE_TO_ALL)
    def init_model(self) -> None:
        self.tokenizer = load_tokenizer(self.model_spec.path)
        lora = self.model_spec.lora.on
        # with LoRA the reference is the actor itself (adapter disabled, or a frozen copy of the starting adapter)
        self.actor = load_policy(self.model_spec, self.device, with_reference=self.with_ref and lora)
        self.opt, self.sched = make_optimizer(self.actor.module, self.optim_spec)
        self.engine, self.engine_shares = make_trainer_engine(self.engine_spec, self.model_spec, self.device,
                                                              self.actor.module, shards=self.actor.strategy.shards)
        self.ref = load_policy(self.model_spec, self.device, frozen=True) if self.with_ref and not lora else None
        self.probe = sync_check.probe_batch(self.tokenizer, self.actor.module.config.max_position_embeddings)
        self.syncs = 0
        self.agents = AgentRunners(self.model_spec.path)

    # ---------------------------------------------------------------- rollout
    def _rollout_state(self) -> dict[str, torch.Tensor]:
        """What the rollout engine loads after an update: every weight, or with LoRA the adapters only (unsharded,
        in the compute dtype). A collective under fsdp."""
        strategy, module = self.actor.strategy, self.actor.module
        if self.model_spec.lora.on:
            return strategy.trainable_state_dict(module, compute_dtype=True)
        return strategy.rollout_state_dict(module)

    def probe_log_probs(self) -> torch.Tensor:
        """The actor's log-probs of the sync-check probe batch (a collective under fsdp)."""
        return response_log_probs(self.actor, self.probe, LogProbSpec(len(self.probe)), self.device)["log_probs"]

    def _sync_rollout(self) -> None:
        """Give the engine the policy's weights (unless it reads the actor's own), check the tensors it now holds,
        and on the syncs :func:`~rlcore.engine.sync_check.probes` names that it computes the trainer's log-probs
        (``rlcore.engine.sync_check``); every rank on the same call (collectives under fsdp)."""
        self.syncs += 1
        if not self.engine_shares:
            state = self._rollout_state()
            self.engine.load_weights(state)
            sync_check.check_loaded(self.engine.model, state, sync_check.fingerprint(state.values()),
                                    what=f"rank {self.rank}, weight sync {self.syncs}")
        if sync_check.probes(self.syncs):
            sync_check.check(sync_check.engine_log_probs(self.engine, self.probe, self.device), self.probe_log_probs(),
                             dtype=self.model_spec.dtype, what=f"rank {self.rank}, weight sync {self.syncs}")
        self.rollout_stale = False

    @register(Dispatch.DP_COMPUTE)
    def generate(self, batch: Batch, spec: GenerateSpec) -> Batch:
        """Sample responses for ``prompts``/``prompt_mask`` with the current policy."""
        with peak_memory.phase(self.peaks, "gen", self.device):
            if self.rollout_stale:  # a collective under fsdp: every rank reaches it on the same call
                self._sync_rollout()
            return generate_on(self.engine, batch, spec, rank=self.rank, device=self.device, agents=self.agents)

    @register(Dispatch.ONE_TO_ALL)
    def rollout_weights(self) -> list | None:
        """The policy's weights as a rollout engine loads them (unsharded, compute dtype; with LoRA the adapters only),
        with the sync-check probe and the trainer's log-probs of it, put into the Ray object store by rank 0 as raw
        bytes (:class:`~rlcore.engine.weights.WeightsPayload`): ``[ref]`` there (a list, so the reference travels
        unresolved; the object lives while this rank does and someone holds the reference), None on the other
        ranks. A collective under fsdp."""
        import ray  # a worker only ever runs this inside Ray

        state, probe_lp = self._rollout_state(), self.probe_log_probs()
        if self.rank != 0:
            return None
        return [ray.put(WeightsPayload(pack_state(state), sync_check.fingerprint(state.values()), self.probe, probe_lp,
                                       self.model_spec.dtype))]

    # -------------------------------------------------------------- log-probs
    @register(Dispatch.DP_COMPUTE)
    def compute_log_prob(self, batch: Batch, spec: LogProbSpec) -> Batch:
        """``old_log_probs`` of the responses under the actor (a training forward; the update computes the
        entropy it logs itself), and ``sum_pi_squared`` with ``spec.sum_pi_squared``."""
        with peak_memory.phase(self.peaks, "old_log_prob", self.device):
            out = response_log_probs(self.actor, batch, spec, self.device)
        renamed = {"old_log_probs": out["log_probs"]}
        if spec.sum_pi_squared:
            renamed["sum_pi_squared"] = out["sum_pi_squared"]
        return Batch(renamed)

    @register(Dispatch.DP_COMPUTE)
    def compute_ref_log_prob(self, batch: Batch, spec: LogProbSpec) -> Batch:
        """``ref_log_probs`` of the responses under the frozen reference."""
        with peak_memory.phase(self.peaks, "ref", self.device):
            return self._ref_log_probs(batch, spec)

    def _ref_log_probs(self, batch: Batch, spec: LogProbSpec) -> Batch:
        if self.ref is not None:
            return Batch({"ref_log_probs": response_log_probs(self.ref, batch, spec, self.device)["log_probs"]})
        if not (self.with_ref and self.model_spec.lora.on):
            raise RuntimeError("compute_ref_log_prob: this worker group was started without a reference model")
        with reference_weights(self.actor.module):
            return Batch({"ref_log_probs": response_log_probs(self.actor, batch, spec, self.device)["log_probs"]})

    # ---------------------------------------------------------------- update
    def _actor_loss(self, part: Batch, spec: ActorUpdateSpec, scale: AggScale, first_minibatch: bool,
                    measures: ProximalMeasures) -> MicroResult:
        """The micro-batch's share of ``pg - entropy_coeff * H + kl_coef * KL``, each term aggregated
        with its own mode over the global mini-batch (``scale``); the old log-probs from ``spec.proximal``, the
        importance weights and what is measured against them into ``measures`` (``rlcore.workers.proximal``)."""
        ids, mask = sequences(part)
        rmask = part["response_mask"].to(self.device)
        lp, ent = self.actor.response_log_probs(ids.to(self.device), mask.to(self.device),
                                                part["responses"].to(self.device), temperature=spec.temperature,
                                                with_entropy=True, entropy_grad=spec.entropy_coeff != 0)
        options = options_from(spec.loss, POLICY_LOSSES.get(spec.loss.name).options)
        old = spec.proximal.old(part, lp, first_minibatch, measures, self.device)
        weights = measures.weights(old, part, self.device)
        if weights is not None:
            options["is_weights"] = weights
        pg, m = policy_loss(spec.loss.name, old_log_prob=old, log_prob=lp,
                            advantages=part["advantages"].to(self.device), response_mask=rmask, agg_scale=scale,
                            **options)
        mode, factor = spec.loss.loss_agg_mode, spec.loss.loss_scale_factor
        entropy = agg_loss(ent, rmask, mode, loss_scale_factor=factor, scale=scale)
        loss = pg - spec.entropy_coeff * entropy
        sums = {"actor/pg_loss": float(pg.detach()), "actor/entropy": float(entropy.detach())}
        if spec.kl is not None:
            kl = agg_loss(kl_penalty(lp, part["ref_log_probs"].to(self.device), spec.kl.estimator), rmask, mode,
                          loss_scale_factor=factor, scale=scale)
            loss = loss + spec.kl.coef * kl
            sums["actor/kl_loss"] = float(kl.detach())
        return MicroResult(loss, sums, {f"actor/{k}": float(v) for k, v in m.items()})

    @register(Dispatch.DP_UPDATE)
    def update_actor(self, batch: Batch, spec: ActorUpdateSpec) -> Metrics:
        """PPO epochs over mini-batches of this rank's shard.

        With the KL loss on and no ``ref_log_probs`` in the batch (the controller only fetches them
        when it needs them itself, for a KL penalty in the reward), the colocated reference model
        computes them here first: one worker call per step fewer, and nothing sent back and forth. The old
        log-probs come from ``spec.proximal``, which measures the rollout mismatch and the KL to the reference into a
        :class:`~rlcore.workers.proximal.ProximalMeasures` of this call, with the importance weights."""
        extra: Metrics = {}
        if spec.kl is not None and "ref_log_probs" not in batch:
            start = time.perf_counter()
            ref = self.compute_ref_log_prob(batch, LogProbSpec(spec.micro_batch_size, spec.temperature))
            batch = batch.union(ref)
            extra["perf/ref_in_update_s"] = time.perf_counter() - start
        measures = spec.proximal.measures(batch, spec.off_policy, epochs=spec.epochs,
                                          mini_batch_size=spec.mini_batch_size)

        def optimizer_step(loss: float) -> Metrics:
            lr = self.sched.get_last_lr()[0]
            norm, skipped = clipped_step(self.actor, self.opt, self.sched, spec.grad_clip, loss,
                                         offload=self.optim_spec.offload)
            return {"actor/grad_norm": norm, "actor/lr": lr, "actor/nonfinite_steps": float(skipped)}

        with peak_memory.phase(self.peaks, "update", self.device):
            rows = minibatch_updates(
                batch, epochs=spec.epochs, mini_batch_size=spec.mini_batch_size,
                micro_batch_size=spec.micro_batch_size,
                generator=torch.Generator().manual_seed(spec.seed * 7919 + self.rank), device=self.device,
                micro_loss=lambda part, scale, first: self._actor_loss(part, spec, scale, first, measures),
                optimizer_step=optimizer_step)
        self.rollout_stale = True
        metrics = distributed.all_reduce_mean({**update_metrics(rows, "actor"), **extra}, self.device)
        metrics.update(measures.metrics(self.device))
        # the largest rank's peak of each phase since the last update (every rank ran the same phases)
        metrics.update({k: distributed.all_reduce_max(v, self.device) for k, v in sorted(self.peaks.items())})
        self.peaks = {}
        return metrics

    # ------------------------------------------------------------ checkpoints
    @register(Dispatch.ONE_TO_ALL)
    def save(self, path: str) -> str:
        """Write a Hugging Face folder (weights + tokenizer; with LoRA an adapter folder over the base) from rank 0."""
        save_pretrained(self.actor, path, rank=self.rank, tokenizer=self.tokenizer, base=self.model_spec.base)
        return path

    def state_loaded(self) -> None:
        """After a step checkpoint's weights are loaded: the rollout copy takes them before it generates."""
        self.rollout_stale = True
