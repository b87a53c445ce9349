"""The weight-sync check: after every weight sync, a probe batch's log-probs on the rollout engine equal the trainer's.

A rollout engine holds its own weights (a copy, or the trainer's own tensors) and gets the policy's after every
update. A sync that never happens leaves rollouts on an old policy, silently: the rewards still come in, the run
still learns a little (verl #7495: LoRA adapters never reached the engine). So syncs are checked where they
happen, two ways, and a failure raises :class:`RolloutOutOfSync` (a bug, with its traceback; the stage stops):

* the tensors, at every sync of an engine that holds a copy: a fingerprint (float64 sum and sum of squares) of what
  the trainer handed over equals that of the same tensors in the engine's model after loading
  (:func:`check_loaded`): exact, whatever the dtype;
* the computation: the trainer computes the log-probs of a fixed probe batch (:func:`probe_batch`) with the weights
  it just handed over, the engine computes them with the weights it now holds (``RolloutEngine.log_probs``), and
  they agree to float tolerance (:func:`check`). This catches an engine that computes something else with the
  right tensors (an adapter not applied, a wrong dtype or layout), or one that reads the trainer's tensors
  wrongly. The colocated worker probes at the first sync and every :data:`PROBE_EVERY`-th (:func:`probes`): the
  probe is two short rows, but a forward of each on both sides is all Python overhead on a small model (9 ms of
  a 0.12 s step on the default one, 2-core Intel Xeon), and what it catches does not come and go between syncs
  (a sync that did not reach a copy is the fingerprint's, every time). A generator probes every version it loads.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from rlcore.protocol import Batch

if TYPE_CHECKING:
    from rlcore.rollout.base import RolloutEngine

# Largest |log-prob difference| accepted, by compute dtype: the two sides compute the same thing in a different
# order (packed vs decoder forward, autocast vs cast weights). Measured on the default tiny model: 5e-7 in float32,
# 4e-3 in bfloat16 after a sync; one missed update at lr 1e-4 moves the probe by 0.04 (tests/engine/test_sync_check.py).
# bfloat16's must leave room for larger models' rounding, so there the exact fingerprint is what catches a missed sync.
TOLERANCE = {"float32": 1e-3, "bfloat16": 0.1, "float16": 0.05}
# float64 sums of the same values added in another order (a GPU engine's) differ by rounding only
FINGERPRINT_RTOL = 1e-9
PROBE_PROMPTS = ("What is 12 + 34?", "Say something.")
PROBE_RESPONSE = "The answer is 46, I think."


PROBE_EVERY = 10
"""The colocated worker checks the computation (the probe batch) at the first sync and at every ``PROBE_EVERY``-th."""


def probes(sync: int) -> bool:
    """Whether weight sync number ``sync`` (counted from 1) checks the computation with the probe batch."""
    return sync == 1 or sync % PROBE_EVERY == 0


class RolloutOutOfSync(RuntimeError):
    """The rollout engine's weights are not the policy's it was just given."""


def probe_batch(tokenizer, max_positions: int, response_tokens: int = 8) -> Batch:
    """Two rows of a chat prompt and a fixed response (``prompts``/``prompt_mask`` left-padded, ``responses``), within
    the model's context."""
    rows = [tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                          tokenize=True) for text in PROBE_PROMPTS]
    rows = [list(r["input_ids"]) if isinstance(r, dict) or hasattr(r, "keys") else list(r) for r in rows]
    response = list(tokenizer(PROBE_RESPONSE, add_special_tokens=False)["input_ids"])
    response_len = max(1, min(response_tokens, len(response), max_positions // 2))
    keep = max(1, min(max(len(r) for r in rows), max_positions - response_len))
    rows = [r[-keep:] for r in rows]
    width = max(len(r) for r in rows)
    prompts = torch.full((len(rows), width), tokenizer.pad_token_id, dtype=torch.long)
    mask = torch.zeros_like(prompts)
    for i, r in enumerate(rows):
        prompts[i, width - len(r):] = torch.tensor(r)
        mask[i, width - len(r):] = 1
    responses = torch.tensor([response[:response_len]] * len(rows), dtype=torch.long)
    return Batch({"prompts": prompts, "prompt_mask": mask, "responses": responses,
                  "response_mask": torch.ones_like(responses)})


def engine_log_probs(engine: RolloutEngine, probe: Batch, device: torch.device) -> torch.Tensor:
    """The engine's log-probs of the probe's responses ``[rows, response_len]``, on the CPU."""
    return engine.log_probs(probe["prompts"].to(device), probe["prompt_mask"].to(device),
                            probe["responses"].to(device)).float().cpu()


def fingerprint(tensors) -> tuple[float, float]:
    """(sum, sum of squares) of every value of ``tensors``, in float64."""
    total, squares = 0.0, 0.0
    for t in tensors:  # accumulated in float64 without a float64 copy of the tensor
        t = t.detach()
        total += float(t.sum(dtype=torch.float64))
        squares += float(torch.linalg.vector_norm(t, dtype=torch.float64)) ** 2
    return total, squares


def check_loaded(model: torch.nn.Module, keys, expected: tuple[float, float], *, what: str) -> None:
    """The tensors named ``keys`` in ``model`` (an engine's, after loading) have the fingerprint ``expected`` (of what
    was handed over); :class:`RolloutOutOfSync` naming ``what`` otherwise."""
    state = model.state_dict()
    got = fingerprint(state[k] for k in keys)
    for g, e in zip(got, expected):
        if not abs(g - e) <= FINGERPRINT_RTOL * max(abs(e), 1.0):
            raise RolloutOutOfSync(f"{what}: the rollout engine's weights are not the ones it was given (fingerprint "
                                   f"{got[0]:.9g}/{got[1]:.9g}, handed over {expected[0]:.9g}/{expected[1]:.9g})")


def check(engine_lp: torch.Tensor, trainer_lp: torch.Tensor, *, dtype: str, what: str) -> float:
    """The largest |difference| of the two sides' probe log-probs; :class:`RolloutOutOfSync` naming ``what`` (which
    sync) when it exceeds the dtype's tolerance."""
    diff = float((engine_lp.float() - trainer_lp.float()).abs().max())
    if not diff <= TOLERANCE[dtype]:  # a NaN fails too
        raise RolloutOutOfSync(f"{what}: the rollout engine's log-probs of the probe batch differ from the trainer's "
                               f"by {diff:.3g} (tolerance {TOLERANCE[dtype]:g} in {dtype}): the engine does not hold "
                               f"the weights it was given")
    return diff
