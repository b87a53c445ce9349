"""The interface every generation engine implements."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch

if TYPE_CHECKING:
    from rlcore.config import RolloutConfig


@dataclass(frozen=True)
class SamplingParams:
    max_new_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    greedy: bool = False


@dataclass(frozen=True)
class EngineSpec:
    """Which engine a worker builds and how (params.yaml ``rollout``)."""

    name: str = "static"
    """``rlcore.rollout.ENGINES`` name."""
    compile: bool = False
    """static: ``torch.compile`` the decode step (costs a compilation per process and batch bucket)."""
    cuda_graphs: bool = True
    """static, on a GPU: capture each decode step in a CUDA graph and replay it."""


def engine_spec(rollout: RolloutConfig) -> EngineSpec:
    """The engine params.yaml ``rollout`` names, as the workers, the generators and ``rlcore serve`` build it."""
    return EngineSpec(name=rollout.engine, compile=rollout.compile, cuda_graphs=rollout.cuda_graphs)


class RolloutEngine(Protocol):
    def load_weights(self, state_dict: dict[str, torch.Tensor]) -> None:
        """Take the trainer's current (unsharded) weights before generating."""

    def generate(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, params: SamplingParams,
                 generator: torch.Generator | None = None) -> dict[str, torch.Tensor]:
        """Sample responses for left-padded prompts ``[batch, prompt_len]``.

        Returns ``responses`` ``[batch, max_new_tokens]`` (pad after EOS),
        ``response_mask`` (1 up to and including EOS) and ``log_probs`` of the sampled
        tokens under ``softmax(logits / temperature)``.
        """
