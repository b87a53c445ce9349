"""Generation engines behind one interface (:class:`RolloutEngine`), selected by ``rollout.engine``.

Engines that exist: ``hf`` (the transformers model in a token loop with a dynamic KV cache; any
causal LM) and ``static`` (``rlcore.rollout.static``: a preallocated KV cache, compacted batches,
CUDA graphs on a GPU; Llama and Qwen2 layouts, other architectures fall back to ``hf`` with a
warning) and ``vllm`` (``rlcore.rollout.vllm_engine``: vLLM's offline engine in the worker's process, weights
moved in memory; an optional install, ``make setup-vllm``).
"""

from __future__ import annotations

import sys

from rlcore.registry import Registry
from rlcore.rollout.base import EngineSpec, RolloutEngine, SamplingParams, engine_spec

# name -> factory(model, spec, eos_token_id=..., pad_token_id=...) -> RolloutEngine
ENGINES: Registry = Registry("rollout engine")


@ENGINES.register("hf")
def _hf_engine(model, spec: EngineSpec, *, eos_token_id: int, pad_token_id: int) -> RolloutEngine:
    from rlcore.rollout.hf import HFRolloutEngine

    return HFRolloutEngine(model, eos_token_id=eos_token_id, pad_token_id=pad_token_id)


@ENGINES.register("static")
def _static_engine(model, spec: EngineSpec, *, eos_token_id: int, pad_token_id: int) -> RolloutEngine:
    # an engine's module loads when it is chosen (hf: transformers' generation; vllm: its own package)
    from rlcore.rollout.static import StaticRolloutEngine, adapter_reason, unsupported_reason

    reason = unsupported_reason(model.config) or adapter_reason(model)
    if reason:
        print(f"rollout.engine static: {reason}; generating with hf", file=sys.stderr, flush=True)
        return _hf_engine(model, spec, eos_token_id=eos_token_id, pad_token_id=pad_token_id)
    return StaticRolloutEngine(model, eos_token_id=eos_token_id, pad_token_id=pad_token_id, compile=spec.compile,
                               cuda_graphs=spec.cuda_graphs)


@ENGINES.register("vllm")
def _vllm_engine(model, spec: EngineSpec, *, eos_token_id: int, pad_token_id: int) -> RolloutEngine:
    from rlcore.rollout.vllm_engine import VllmRolloutEngine  # imports vLLM (tens of seconds): only when chosen

    return VllmRolloutEngine(model, spec, eos_token_id=eos_token_id, pad_token_id=pad_token_id)


def reads_weights_in_place(model, spec: EngineSpec) -> bool:
    """Whether the engine ``spec`` names, over ``model``, only reads its tensors (never calls its forward or changes its
    mode): then it can run on the very model a trainer updates, with no copy and no sync (the static engine, where it
    supports the model)."""
    if spec.name != "static":
        return False
    from rlcore.rollout.static import adapter_reason, unsupported_reason  # as in _static_engine

    return unsupported_reason(model.config) is None and adapter_reason(model) is None


def make_engine(model, spec: EngineSpec, *, eos_token_id: int, pad_token_id: int) -> RolloutEngine:
    """The engine ``spec`` names, over ``model`` (a plain causal LM on its device, in its compute dtype)."""
    return ENGINES.get(spec.name)(model, spec, eos_token_id=eos_token_id, pad_token_id=pad_token_id)


__all__ = ["ENGINES", "EngineSpec", "RolloutEngine", "SamplingParams", "engine_spec", "make_engine",
           "reads_weights_in_place"]
