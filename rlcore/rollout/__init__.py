"""Generation engines behind one interface (:class:`RolloutEngine`), selected by ``rollout.engine``."""

from rlcore.registry import Registry
from rlcore.rollout.base import RolloutEngine, SamplingParams

# name -> factory(model, eos_token_id=..., pad_token_id=...) -> RolloutEngine
ENGINES: Registry = Registry("rollout engine")


@ENGINES.register("hf")
def _hf_engine(model, *, eos_token_id: int, pad_token_id: int) -> RolloutEngine:
    from rlcore.rollout.hf import HFRolloutEngine

    return HFRolloutEngine(model, eos_token_id=eos_token_id, pad_token_id=pad_token_id)


__all__ = ["ENGINES", "RolloutEngine", "SamplingParams"]
