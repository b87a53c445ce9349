"""Turning dataset rows into token tensors (the controller tokenizes; workers never see text).

Layout: prompts are left-padded to ``max_prompt_length`` (decoder-only generation
continues from the right edge); responses are right-padded to ``max_response_length``.
"""

from __future__ import annotations

from itertools import compress
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


def encode_prompts(tokenizer, prompts: Sequence[list[dict]], max_len: int, source: str,
                   tools: list[dict] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Chat-template each prompt (with ``tools``, the function schemas of the tool loop, for templates that show
    them to the model); ``[batch, max_len]`` ids and mask, left-padded."""
    rows = []
    extra = {"tools": tools} if tools else {}
    for i, messages in enumerate(prompts):
        text = tokenizer.apply_chat_template(list(messages), add_generation_prompt=True, tokenize=False, **extra)
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


def prompt_batch(df: pd.DataFrame, tokenizer, max_prompt_length: int, source: str,
                 tools: list[dict] | None = None) -> Batch:
    """Prompt tensors plus what rewards need: data_source, ground_truth, extra_info, a group ``uid``; and the prompt's
    chat ``messages`` (what an agent program starts from). ``tools``: the tool loop's function schemas, for chat
    templates that show them."""
    prompts, mask = encode_prompts(tokenizer, list(df["prompt"]), max_prompt_length, source, tools)
    return Batch(
        {"prompts": prompts, "prompt_mask": mask},
        {
            "data_source": df["data_source"].to_numpy(),
            "ground_truth": np.array([rm["ground_truth"] for rm in df["reward_model"]], dtype=object),
            "uid": np.array([f"{e['split']}-{e['index']}" for e in df["extra_info"]], dtype=object),
            "question": np.array([e["question"] for e in df["extra_info"]], dtype=object),
            "extra_info": [dict(e) for e in df["extra_info"]],
            # the chat messages themselves: an agent program's row (rollout.agent.loop openai) starts from them
            "messages": [[{k: v for k, v in dict(m).items() if v is not None} for m in p] for p in df["prompt"]],
        },
    )


def decode_responses(tokenizer, responses: torch.Tensor, response_mask: torch.Tensor) -> list[str]:
    """Text of each response's tokens under its mask, special tokens (EOS) dropped: what ``tokenizer.decode``
    gives each one. A plain fast tokenizer decodes the batch in one call of its Rust backend (``decode_batch``):
    0.4 ms for 256 responses here, against 7.4 ms for a ``decode`` per response (masking a tensor per row, and
    transformers' per-call argument handling) and 2.3 ms for ``batch_decode``."""
    ids = [list(compress(r, m)) for r, m in zip(responses.tolist(), response_mask.tolist())]
    if _backend_decodes_as_the_tokenizer(tokenizer):
        return tokenizer.backend_tokenizer.decode_batch(ids, skip_special_tokens=True)
    return [tokenizer.decode(r, skip_special_tokens=True) for r in ids]


def _backend_decodes_as_the_tokenizer(tokenizer) -> bool:
    """Whether the Rust backend's decode is the tokenizer's own: a fast tokenizer whose class changes nothing of
    ``decode`` (some map characters afterwards, as CPM's does) and that cleans up no spaces."""
    from transformers import PreTrainedTokenizerFast

    cls = type(tokenizer)
    return (isinstance(tokenizer, PreTrainedTokenizerFast) and cls._decode is PreTrainedTokenizerFast._decode
            and cls.decode is PreTrainedTokenizerFast.decode
            and not getattr(tokenizer, "clean_up_tokenization_spaces", False))
