"""The interface every generation engine implements."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol, Sequence

import torch

from rlcore.engine.lora import is_adapter_key
from rlcore.rollout.sampling import SamplingParams

if TYPE_CHECKING:
    from rlcore.config import RolloutConfig
    from rlcore.rollout.turns import Trajectories

__all__ = ["CachedPrefix", "EngineSpec", "RolloutEngine", "SamplingParams", "WeightRefresh", "engine_spec", "load_into"]


@dataclass(frozen=True)
class EngineSpec:
    """Which engine a worker builds and how (params.yaml ``rollout``)."""

    name: str = "static"
    """``rlcore.rollout.ENGINES`` name."""
    compile: bool = False
    """static: ``torch.compile`` the decode step (costs a compilation per process and batch bucket); vllm: its
    compiled path instead of eager mode."""
    cuda_graphs: bool = True
    """static, on a GPU: capture each decode step in a CUDA graph and replay it."""
    kv_cache_gib: float = 1.0
    """vllm: KV cache space of the engine, GiB."""
    max_batch: int = 512
    """vllm: sequences scheduled at once (``rollout.micro_batch_size``)."""


def engine_spec(rollout: RolloutConfig) -> EngineSpec:
    """The engine params.yaml ``rollout`` names, as the workers, the generators and ``rlcore serve`` build it."""
    return EngineSpec(name=rollout.engine, compile=rollout.compile, cuda_graphs=rollout.cuda_graphs,
                      kv_cache_gib=rollout.kv_cache_gib, max_batch=rollout.micro_batch_size)


@dataclass(frozen=True, eq=False)
class CachedPrefix:
    """The keys and values a generation call left for one row: its prompt and the tokens it sampled but the last
    (which was never fed). An engine that takes them (``reuses_prefixes``: the static engine) continues a later
    row whose prompt starts with the same tokens from them, computing only the rest (the openai loop's next
    request of a trajectory: its history, the model's answer, then the agent's new messages)."""

    ids: tuple[int, ...]
    """The tokens at positions ``0..len(ids)-1``."""
    keys: tuple[torch.Tensor, ...]
    """Per layer ``[kv_heads, len(ids), head_dim]``."""
    values: tuple[torch.Tensor, ...]
    weights: int
    """The engine's weight load count when they were computed: after :meth:`RolloutEngine.load_weights` they are not
    used (they belong to other weights)."""

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.keys, *self.values))

    def common_length(self, ids: Sequence[int]) -> int:
        """How many leading tokens of ``ids`` these keys and values hold."""
        n = min(len(self.ids), len(ids))
        if self.ids[:n] == tuple(ids[:n]):  # the usual case, compared in C
            return n
        for i in range(n):
            if self.ids[i] != ids[i]:
                return i
        return n


class WeightRefresh(Protocol):
    """Newer policy weights taken in the middle of a generation (partial rollouts, ``ppo.async.partial_rollout``):
    an engine that supports it (``static``) calls :meth:`poll` between decode steps."""

    @property
    def version(self) -> int:
        """The policy version of the weights the engine computes with now."""

    def poll(self) -> bool:
        """Load a newer published version into the engine's model if there is one (then :attr:`version` is it);
        True when it did, and the engine computes the running rows' KV cache again."""


class RolloutEngine(Protocol):
    model: torch.nn.Module
    """The module whose tensors the engine computes with (the weight-sync check reads them back)."""

    def load_weights(self, state_dict: dict[str, torch.Tensor]) -> None:
        """Take the trainer's current (unsharded) weights before generating."""

    def log_probs(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, responses: torch.Tensor
                  ) -> torch.Tensor:
        """Log-probs ``[batch, response_len]`` (float32, temperature 1) of given ``responses`` after left-padded
        prompts ``[batch, prompt_len]``, computed the way generation computes them (any value after a response's
        end). The weight-sync check compares them with the trainer's (``rlcore.engine.sync_check``)."""

    def generate(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, params: SamplingParams,
                 generator: torch.Generator | None = None, *, seeds: Sequence[int] | None = None
                 ) -> dict[str, torch.Tensor]:
        """Sample responses for left-padded prompts ``[batch, prompt_len]``.

        Returns ``responses`` ``[batch, max_new_tokens]`` (pad after EOS),
        ``response_mask`` (1 up to and including EOS) and ``log_probs`` of the sampled
        tokens under ``softmax(logits / temperature)``. ``seeds`` (one per row): each row sampled from its own
        random stream (:func:`~rlcore.rollout.sampling.row_uniforms`; vLLM: its per-request seed) instead of the
        call's ``generator``, so its tokens do not depend on the other rows of the call.
        """

    def open_rows(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, params: SamplingParams, *,
                  budget: int, generator: torch.Generator | None = None, deterministic: bool = False) -> Trajectories:
        """Rows that generate turn by turn from left-padded prompts ``[batch, prompt_len]`` (what the agent loop
        drives: :mod:`rlcore.rollout.turns`); ``budget``: response columns per row, model and observation tokens
        together. ``deterministic``: observations fed token by token, so that a row's numbers do not depend on the
        others' schedule where the engine can keep its step shapes fixed."""


def load_into(model: torch.nn.Module, state_dict: dict[str, torch.Tensor]) -> None:
    """Copy ``state_dict`` into ``model``'s own tensors (so compiled steps and CUDA graphs keep reading them): all of
    them, or only some (a LoRA model's adapters). A key the model lacks is a bug: ValueError naming it."""
    result = model.load_state_dict(state_dict, strict=False)
    if result.unexpected_keys:
        raise ValueError(f"rollout engine: weights for tensors the model lacks: {result.unexpected_keys[:3]}")
    adapters_only = bool(state_dict) and all(is_adapter_key(k) for k in state_dict)
    missing = [k for k in result.missing_keys if not adapters_only or is_adapter_key(k)]
    if missing:
        raise ValueError(f"rollout engine: no weights given for {missing[:3]} ({len(missing)} tensors)")
