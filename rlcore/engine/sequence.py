"""Forward passes that turn (prompt ; response) sequences into per-token log-probs and values.

Layout everywhere: ``input_ids`` is ``[batch, prompt_len + response_len]`` with the
prompt left-padded and the response right-padded; ``attention_mask`` marks real tokens.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from rlcore.algos.losses import entropy_from_logits
from rlcore.engine import packed


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


def response_logits(model, input_ids, attention_mask, response_len: int) -> torch.Tensor:
    """Logits predicting each response token: ``[batch, response_len, vocab]``. Only the last
    ``response_len + 1`` positions go through the LM head (``logits_to_keep``).

    A model loaded for packed forwards (``model.packed_forward``) runs each distinct prompt and each
    distinct (prompt ; response) row once, and no padding (``rlcore.engine.packed``); the logits at
    real response tokens are the same.
    """
    if packed.uses_packing(model):
        layout = packed.pack(input_ids, attention_mask, response_len)
        if layout is not None:
            return packed.packed_response_logits(model, layout)
    out = model(input_ids=input_ids, attention_mask=attention_mask,
                position_ids=position_ids(attention_mask), use_cache=False, logits_to_keep=response_len + 1)
    return out.logits[:, :-1]


def token_log_probs(logits: torch.Tensor, tokens: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """log p(token) under softmax(logits / temperature); ``[batch, len]``."""
    logp = F.log_softmax(logits.float() / temperature, dim=-1)
    return logp.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)


def response_log_probs(model, input_ids, attention_mask, responses, *, temperature: float = 1.0,
                       with_entropy: bool = False, entropy_grad: bool = True
                       ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probs ``[batch, response_len]`` of ``responses`` and optionally their entropy, off the
    autograd graph unless ``entropy_grad`` (a logged-only entropy then costs backward nothing)."""
    logits = response_logits(model, input_ids, attention_mask, responses.shape[1]).float() / temperature
    log_probs = token_log_probs(logits, responses)
    entropy = entropy_from_logits(logits if entropy_grad else logits.detach()) if with_entropy else None
    return log_probs, entropy


def response_values(value_model, input_ids, attention_mask, response_len: int) -> torch.Tensor:
    """Critic values ``[batch, response_len]``: V of the state before each response token."""
    if packed.uses_packing(value_model):
        layout = packed.pack(input_ids, attention_mask, response_len)
        if layout is not None:
            return packed.packed_values(value_model, layout).float()
    out = value_model(input_ids=input_ids, attention_mask=attention_mask,
                      position_ids=position_ids(attention_mask), use_cache=False)
    return out.logits[:, -response_len - 1 : -1, 0].float()
