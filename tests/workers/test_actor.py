"""Tests for the parts of rlcore.workers.actor that need no Ray: sequences and the actor loss."""

from __future__ import annotations

import torch

from rlcore.protocol import Batch
from rlcore.workers.actor import sequences


def test_sequences_drop_the_prompt_columns_that_no_row_uses():
    prompts = torch.tensor([[0, 0, 0, 5, 6], [0, 0, 7, 8, 9]])
    responses = torch.tensor([[10, 3, 0], [11, 12, 3]])
    batch = Batch({"prompts": prompts, "prompt_mask": (prompts != 0).long(),
                   "responses": responses, "response_mask": torch.tensor([[1, 1, 0], [1, 1, 1]])})
    ids, mask = sequences(batch)
    assert ids.tolist() == [[0, 5, 6, 10, 3, 0], [7, 8, 9, 11, 12, 3]]
    assert mask.tolist() == [[0, 1, 1, 1, 1, 0], [1, 1, 1, 1, 1, 1]]
