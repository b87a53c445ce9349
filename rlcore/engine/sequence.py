"""Forward passes that turn (prompt ; response) sequences into per-token log-probs and values.

Layout everywhere: ``input_ids`` is ``[batch, prompt_len + response_len]`` with the
prompt left-padded and the response right-padded; ``attention_mask`` marks real tokens.

Two forwards behind one interface (:class:`SequenceForward`), chosen per model when it is
loaded (``model.packed_forward``):

* ``padded`` (:class:`PaddedForward`): the plain Hugging Face forward over the padded batch,
  the reference every optimisation is checked against;
* ``packed`` (:class:`PackedForward`): each distinct prompt and each distinct (prompt ;
  response) row once, no padding tokens (``rlcore.engine.packed``); the same results at real
  response tokens up to float rounding (``tests/engine/test_packed.py``).

:class:`SequenceModel` joins a model with its training strategy (which sets the forward's
autocast) and its forward; workers hold these.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Protocol

import torch

from rlcore.engine import packed
from rlcore.engine.logits import sum_pi_squared, token_log_probs_and_entropy
from rlcore.engine.strategy import Replicated, Strategy
from rlcore.protocol import Batch
from rlcore.registry import Registry


def position_ids(attention_mask: torch.Tensor) -> torch.Tensor:
    """Positions that skip left padding: ``[0,0,1,2]`` for mask ``[0,1,1,1]`` -> ``[0,0,1,2]``."""
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)


def trim_left_padding(input_ids: torch.Tensor, attention_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Drop the leading columns that are padding in every row, ``[batch, len]`` -> ``[batch, len - k]``.

    Prompts are left-padded to a fixed width, usually wider than the batch's longest prompt;
    a forward over the trimmed columns gives the same results (positions come from the mask).
    """
    start = int(attention_mask.any(0).int().argmax())  # the first used column; 0 if none is
    return input_ids[:, start:], attention_mask[:, start:]


# The fields a forward over (prompt ; response) reads: ``response_attention_mask`` (1 on every token of a multi-turn
# trajectory, observations included) comes with the tool loop's batches (rlcore.agents.batch); without it the
# response_mask is also the attention mask.
SEQUENCE_KEYS = ("prompts", "prompt_mask", "responses", "response_mask", "response_attention_mask")


def response_attention(batch: Batch) -> torch.Tensor:
    """Which response tokens a forward attends to ``[batch, response_len]``: ``response_attention_mask`` when the
    batch has one (a multi-turn trajectory, whose ``response_mask`` marks the model's own tokens only), else
    ``response_mask``."""
    return batch["response_attention_mask"] if "response_attention_mask" in batch else batch["response_mask"]


def sequences(batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
    """(prompt ; response) ids and attention mask of a Batch with ``prompts``/``prompt_mask`` and
    ``responses``/``response_mask`` (and ``response_attention_mask``: :func:`response_attention`),
    ``[batch, prompt_len + response_len]``, less the prompt columns that are padding in every row
    (``trim_left_padding``)."""
    ids = torch.cat([batch["prompts"], batch["responses"]], dim=1)
    mask = torch.cat([batch["prompt_mask"], response_attention(batch)], dim=1)
    return trim_left_padding(ids, mask)


class SequenceForward(Protocol):
    """One way of running a (prompt ; response) batch through a model."""

    def response_logits(self, model: torch.nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                        response_len: int) -> torch.Tensor:
        """Logits predicting each response token, ``[batch, response_len, vocab]`` (any values at padding)."""

    def response_values(self, model: torch.nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                        response_len: int) -> torch.Tensor:
        """A value model's outputs at the state before each response token, ``[batch, response_len]``."""


FORWARDS: Registry[SequenceForward] = Registry("sequence forward")


class PaddedForward:
    """The plain Hugging Face forward over the padded batch (positions skip the left padding)."""

    def response_logits(self, model, input_ids, attention_mask, response_len):
        """Only the last ``response_len + 1`` positions go through the LM head (``logits_to_keep``)."""
        out = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids(attention_mask),
                    use_cache=False, logits_to_keep=response_len + 1)
        return out.logits[:, :-1]

    def response_values(self, model, input_ids, attention_mask, response_len):
        out = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids(attention_mask),
                    use_cache=False)
        return out.logits[:, -response_len - 1 : -1, 0]


class PackedForward:
    """Each distinct prompt and each distinct (prompt ; response) row once, no padding tokens
    (``rlcore.engine.packed``). A batch whose padding is not of the left-prompt / right-response
    form runs the padded forward instead. Needs a model loaded for packing (``packed.ATTN_NAME``)."""

    def response_logits(self, model, input_ids, attention_mask, response_len):
        layout = packed.pack(input_ids, attention_mask, response_len)
        if layout is None:
            return PADDED.response_logits(model, input_ids, attention_mask, response_len)
        return packed.packed_response_logits(model, layout)

    def response_values(self, model, input_ids, attention_mask, response_len):
        layout = packed.pack(input_ids, attention_mask, response_len)
        if layout is None:
            return PADDED.response_values(model, input_ids, attention_mask, response_len)
        return packed.packed_values(model, layout)


PADDED = PaddedForward()
FORWARDS.add("padded", PADDED)
FORWARDS.add("packed", PackedForward())


def forward_for(model: torch.nn.Module) -> SequenceForward:
    """The packed forward for a model loaded for packing, the padded one otherwise."""
    return FORWARDS.get("packed" if packed.uses_packing(model) else "padded")


@dataclass
class SequenceModel:
    """A causal LM (or a value model) with the strategy that wraps it and the forward it runs."""

    module: torch.nn.Module
    strategy: Strategy
    forward: SequenceForward

    def response_log_probs(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, responses: torch.Tensor, *,
                           temperature: float = 1.0, with_entropy: bool = False, entropy_grad: bool = True
                           ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Log-probs ``[batch, response_len]`` of ``responses`` under ``softmax(logits / temperature)`` and,
        optionally, their entropy, off the autograd graph unless ``entropy_grad`` (a logged-only entropy
        then costs backward nothing).

        The logits stay in the forward's dtype and the statistics are taken a chunk at a time
        (:func:`rlcore.engine.logits.token_log_probs_and_entropy`): no float copy of them is kept for the backward."""
        logits = self._logits(input_ids, attention_mask, responses.shape[1])
        return token_log_probs_and_entropy(logits, responses, temperature, with_entropy=with_entropy,
                                           entropy_grad=entropy_grad)

    def response_log_probs_and_sum_pi_squared(self, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                                              responses: torch.Tensor, *, temperature: float = 1.0
                                              ) -> tuple[torch.Tensor, torch.Tensor]:
        """Log-probs ``[batch, response_len]`` of ``responses`` and ``sum_v pi(v)^2`` of each position's
        distribution ``softmax(logits / temperature)``, from one forward (the optimal token baseline's inputs)."""
        logits = self._logits(input_ids, attention_mask, responses.shape[1])
        log_probs, _ = token_log_probs_and_entropy(logits, responses, temperature)
        return log_probs, sum_pi_squared(logits, temperature)

    def _logits(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, response_len: int) -> torch.Tensor:
        """The logits predicting each response token, in the forward's dtype (the autocast's under mixed
        precision)."""
        with self.strategy.autocast():
            return self.forward.response_logits(self.module, input_ids, attention_mask, response_len)

    def response_values(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, response_len: int
                        ) -> torch.Tensor:
        """Critic values ``[batch, response_len]``: V of the state before each response token."""
        with self.strategy.autocast():
            values = self.forward.response_values(self.module, input_ids, attention_mask, response_len)
        return values.float()


@contextmanager
def eval_mode(module: torch.nn.Module) -> Iterator[None]:
    """``module`` in eval mode inside (no dropout: a LoRA adapter's), back in its own mode after."""
    training = module.training
    module.eval()
    try:
        yield
    finally:
        module.train(training)


def local_model(module: torch.nn.Module) -> SequenceModel:
    """``module`` as a SequenceModel used in this one process (no data parallelism, its own dtype; the
    forward chosen by how it was loaded): for tools and tests that run a model outside a worker group."""
    return SequenceModel(module, Replicated(next(module.parameters()).device), forward_for(module))
