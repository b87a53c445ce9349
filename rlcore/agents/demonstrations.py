"""Multi-turn demonstrations for SFT, laid out token for token as the tool loop lays out a trajectory: the
assistant turns trained on, the tool (or user) messages between them in the sequence but out of the loss."""

from __future__ import annotations

from typing import Sequence

import torch

from rlcore.agents.template import TurnTemplate
from rlcore.errors import DataError


def encode_conversations(tokenizer, conversations: Sequence[list[dict]], max_len: int, source: str,
                         tools: list[dict] | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Multi-turn demonstrations (each the turns after its prompt: assistant turns with tool or user messages
    between them) as the tool loop lays a trajectory out (:class:`rlcore.agents.template.TurnTemplate`):
    ``[batch, max_len]`` ids, loss mask (1 on the assistant turns' tokens and their EOS) and attention mask (1 on
    every token), right-padded."""
    turns = TurnTemplate(tokenizer, tools)
    ids = torch.full((len(conversations), max_len), tokenizer.pad_token_id, dtype=torch.long)
    loss = torch.zeros((len(conversations), max_len), dtype=torch.long)
    attention = torch.zeros((len(conversations), max_len), dtype=torch.long)
    for i, messages in enumerate(conversations):
        try:
            row, mask = turns.conversation_ids([{k: v for k, v in m.items() if v is not None} for m in messages])
        except ValueError as err:
            raise DataError(f"{source}: row {i}: extra_info.messages: {err}") from None
        if len(row) > max_len:
            raise DataError(f"{source}: row {i}: the demonstration's turns are {len(row)} tokens; "
                            f"task.max_response_length is {max_len}")
        ids[i, :len(row)] = torch.tensor(row, dtype=torch.long)
        loss[i, :len(row)] = torch.tensor(mask, dtype=torch.long)
        attention[i, :len(row)] = 1
    return ids, loss, attention
