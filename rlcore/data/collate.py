"""Turning dataset rows into token tensors (the controller tokenizes; workers never see text).

Layout: prompts are left-padded to ``max_prompt_length`` (decoder-only generation
continues from the right edge); responses are right-padded to ``max_response_length``.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
import pandas as pd
import torch

from rlcore.errors import DataError
from rlcore.protocol import Batch


def _pad(rows: list[list[int]], width: int, pad_id: int, left: bool) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, r in enumerate(rows):
        sl = slice(width - len(r), width) if left else slice(0, len(r))
        ids[i, sl] = torch.tensor(r, dtype=torch.long)
        mask[i, sl] = 1
    return ids, mask


def encode_prompts(tokenizer, prompts: Sequence[list[dict]], max_len: int, source: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Chat-template each prompt; ``[batch, max_len]`` ids and mask, left-padded."""
    rows = []
    for i, messages in enumerate(prompts):
        text = tokenizer.apply_chat_template(list(messages), add_generation_prompt=True, tokenize=False)
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        if len(ids) > max_len:
            raise DataError(f"{source}: row {i}: prompt is {len(ids)} tokens after the chat template; "
                             f"task.max_prompt_length is {max_len}")
        rows.append(ids)
    return _pad(rows, max_len, tokenizer.pad_token_id, left=True)


def encode_responses(tokenizer, texts: Sequence[str], max_len: int, source: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Response text + EOS; ``[batch, max_len]`` ids and mask, right-padded."""
    rows = []
    for i, text in enumerate(texts):
        ids = tokenizer(text, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
        if len(ids) > max_len:
            raise DataError(f"{source}: row {i}: response is {len(ids)} tokens with EOS; "
                             f"task.max_response_length is {max_len}")
        rows.append(ids)
    return _pad(rows, max_len, tokenizer.pad_token_id, left=False)


def prompt_batch(df: pd.DataFrame, tokenizer, max_prompt_length: int, source: str) -> Batch:
    """Prompt tensors plus what rewards need: data_source, ground_truth, extra_info, a group ``uid``."""
    prompts, mask = encode_prompts(tokenizer, list(df["prompt"]), max_prompt_length, source)
    return Batch(
        {"prompts": prompts, "prompt_mask": mask},
        {
            "data_source": df["data_source"].to_numpy(),
            "ground_truth": np.array([rm["ground_truth"] for rm in df["reward_model"]], dtype=object),
            "uid": np.array([f"{e['split']}-{e['index']}" for e in df["extra_info"]], dtype=object),
            "question": np.array([e["question"] for e in df["extra_info"]], dtype=object),
            "extra_info": [dict(e) for e in df["extra_info"]],
        },
    )


def decode_responses(tokenizer, responses: torch.Tensor, response_mask: torch.Tensor) -> list[str]:
    """Text of each response up to its mask, special tokens (EOS) dropped."""
    return [tokenizer.decode(r[m.bool()].tolist(), skip_special_tokens=True)
            for r, m in zip(responses, response_mask)]
