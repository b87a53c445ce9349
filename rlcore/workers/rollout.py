"""The rollout worker (one rank): generation only, for scoring and evaluation.

The PPO worker (``rlcore.workers.actor``) generates with the same :func:`generate_on`, from a
rollout copy it refreshes with the actor's weights after every update.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from rlcore.agents.batch import trajectory_batch
from rlcore.agents.loop import AgentRuntime
from rlcore.agents.spec import AgentSpec, EndpointAgentSpec
from rlcore.controller.decorator import Dispatch, RankPlacement, register
from rlcore.engine.model import ModelSpec, load_rollout_model, load_tokenizer
from rlcore.protocol import Batch
from rlcore.rollout import EngineSpec, RolloutEngine, SamplingParams, reads_weights_in_place
from rlcore.rollout.base import WeightRefresh
from rlcore.rollout import make_engine as build_engine
from rlcore.workers.rank import RankWorker

if TYPE_CHECKING:
    from rlcore.agents.openai_loop import EndpointRuntime


@dataclass(frozen=True)
class GenerateSpec:
    """One generation call: how to sample, the call's seed, rows generated at once on a rank."""

    sampling: SamplingParams
    seed: int
    micro_batch_size: int
    agent: AgentSpec | EndpointAgentSpec | None = None
    """The agent loop of ``rollout.agent`` (rlcore.agents: the tool loop, or the openai loop's agent program); None:
    one response per prompt. ``sampling.max_new_tokens`` is then the token budget of a trajectory (of each of its
    rows, with the openai loop)."""


class AgentRunners:
    """A worker's agent runtime for the spec of its calls: the tool loop's (tool processes, parser, chat template) or
    the openai loop's (agent processes, endpoint): started on the first call that has one, kept across calls,
    replaced when the spec changes."""

    def __init__(self, model_path: str):
        self.model_path = model_path
        self.spec: AgentSpec | EndpointAgentSpec | None = None
        self.runtime: AgentRuntime | EndpointRuntime | None = None

    def get(self, spec: AgentSpec | EndpointAgentSpec) -> AgentRuntime | EndpointRuntime:
        if spec != self.spec or self.runtime is None:
            self.close()
            tokenizer = load_tokenizer(self.model_path)
            if isinstance(spec, EndpointAgentSpec):
                from rlcore.agents.openai_loop import EndpointRuntime  # fastapi and uvicorn: only where agents run

                self.runtime = EndpointRuntime(spec, tokenizer)
            else:
                self.runtime = AgentRuntime(spec, tokenizer)
            self.spec = spec
        return self.runtime

    def batch(self, spec: AgentSpec | EndpointAgentSpec, engine: RolloutEngine, part: Batch, sampling: SamplingParams,
              generator: torch.Generator, device: torch.device) -> Batch:
        """One micro-batch of trajectories of ``spec``'s loop on ``engine``."""
        runtime = self.get(spec)
        if isinstance(runtime, AgentRuntime):
            return trajectory_batch(runtime, engine, part, sampling, generator, device)
        return runtime.batch(engine, part, sampling, generator, device)

    def close(self) -> None:
        if self.runtime is not None:
            self.runtime.close()
        self.runtime = self.spec = None


def make_engine(spec: EngineSpec, model: ModelSpec, device: torch.device) -> RolloutEngine:
    """The rollout engine ``spec`` names over a plain copy of the model at ``model.path`` (with LoRA on, its adapter
    layers unmerged: ``load_rollout_model``)."""
    tok = load_tokenizer(model.path)
    return build_engine(load_rollout_model(model, device), spec, eos_token_id=tok.eos_token_id,
                        pad_token_id=tok.pad_token_id)


def make_trainer_engine(spec: EngineSpec, model: ModelSpec, device: torch.device, trainer: torch.nn.Module,
                        *, shards: bool) -> tuple[RolloutEngine, bool]:
    """The rollout engine of a worker that also trains ``trainer`` (the unwrapped module), and whether it runs on
    the trainer's own tensors. It does where that costs nothing: a replicated (not sharded) model whose weights are
    already in the compute dtype, and an engine that only reads tensors (``reads_weights_in_place``). Then there is
    no rollout copy (one model's memory less per rank) and no weight sync; otherwise a copy that takes the
    trainer's weights after every update (only the adapters' with LoRA)."""
    if not shards and model.compute_dtype is None and reads_weights_in_place(trainer, spec):
        tok = load_tokenizer(model.path)
        return build_engine(trainer, spec, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id), True
    return make_engine(spec, model, device), False


def generate_on(engine: RolloutEngine, batch: Batch, spec: GenerateSpec, *, rank: int, device: torch.device,
                agents: AgentRunners | None = None, refresh: WeightRefresh | None = None) -> Batch:
    """``responses``, ``response_mask`` and ``rollout_log_probs`` for ``prompts``/``prompt_mask``, in
    micro-batches. The sampling generator is seeded by the call's seed and the rank, so a call is
    reproducible and the ranks draw different samples. With ``spec.agent``, each row is a tool-loop trajectory
    (:func:`rlcore.agents.batch.trajectory_batch`: ``response_attention_mask`` and the ``agent_*`` fields too), run
    by ``agents``. With ``refresh`` (partial rollouts; the static engine), newer weights are taken between decode
    steps, and ``token_versions`` says which policy version sampled each token."""
    gen = torch.Generator(device=device).manual_seed(spec.seed * 1009 + rank)
    outs = []
    for part in batch.split(spec.micro_batch_size):
        if spec.agent is not None:
            assert agents is not None, "an agent generation call needs the worker's AgentRunners"
            outs.append(agents.batch(spec.agent, engine, part, spec.sampling, gen, device))
            continue
        extra: dict[str, Any] = {} if refresh is None else {"refresh": refresh}  # only engines that take it
        out = engine.generate(part["prompts"].to(device), part["prompt_mask"].to(device), spec.sampling,
                              generator=gen, **extra)
        outs.append(Batch({"responses": out["responses"].cpu(), "response_mask": out["response_mask"].cpu(),
                           "rollout_log_probs": out["log_probs"].cpu(),
                           **({} if refresh is None else {"token_versions": out["token_versions"].cpu()})}))
    return Batch.concat(outs)


def generate_sharded(engine: RolloutEngine, batch: Batch, spec: GenerateSpec, *, shards: int,
                     device: torch.device, agents: AgentRunners | None = None,
                     refresh: WeightRefresh | None = None) -> Batch:
    """:func:`generate_on` for a batch as a worker group of ``shards`` ranks would generate it: padded with copies
    of its first rows to a multiple of ``shards``, split into equal chunks, chunk ``r`` sampled with rank ``r``'s
    generator, trimmed back. One engine then draws exactly the tokens the group would (an asynchronous round's
    generator reproduces a synchronous round's rollouts this way)."""
    padded, pad = batch.pad_to_multiple(shards)
    parts = [generate_on(engine, chunk, spec, rank=r, device=device, agents=agents, refresh=refresh)
             for r, chunk in enumerate(padded.chunk(shards))]
    return Batch.concat(parts).slice(0, len(padded) - pad)


class RolloutWorker(RankWorker):
    """Holds a rollout engine over the model at ``model.path``; nothing trains here."""

    def __init__(self, placement: RankPlacement, *, model: ModelSpec, engine: EngineSpec, seed: int = 0):
        super().__init__(placement, seed)
        self.model_spec = model
        self.engine_spec = engine

    @register(Dispatch.ONE_TO_ALL)
    def init_model(self) -> None:
        self.engine = make_engine(self.engine_spec, self.model_spec, self.device)
        self.agents = AgentRunners(self.model_spec.path)

    @register(Dispatch.ONE_TO_ALL)
    def load_model(self, model: ModelSpec) -> None:
        """Generate with the model at ``model.path`` from now on, in this process: what ``init_model`` of a new
        group over it gives (a new engine; the tool runtimes, which hold the old folder's tokenizer, closed), without
        starting new processes (several CPU-seconds of imports each)."""
        self.agents.close()
        del self.engine  # the old model's memory goes before the new one loads
        self.model_spec = model
        self.init_model()

    @register(Dispatch.DP_COMPUTE)
    def generate(self, batch: Batch, spec: GenerateSpec) -> Batch:
        """Sample responses for this rank's ``prompts``/``prompt_mask``."""
        return generate_on(self.engine, batch, spec, rank=self.rank, device=self.device, agents=self.agents)
