"""The data-parallel training case shared by the CPU (tests/engine/test_data_parallel.py) and the GPU
(tests/gpu/test_cuda.py) tests: two SFT batches with uneven response lengths, and the same two
steps computed on one plain model. No Ray here, so the GPU tests import on a machine without it."""

from __future__ import annotations

import torch

from rlcore.data.collate import encode_prompts, encode_responses
from rlcore.engine.model import load_causal_lm
from rlcore.engine.sequence import local_model
from rlcore.protocol import Batch

LR = 1e-2
WEIGHT_DECAY = 0.01
GRAD_CLIP = 1.0
MICRO = 2  # two micro-batches per rank per step: gradient accumulation is exercised too
QUESTIONS = ["1+1=", "2+3=", "9+9=", "4+4=", "12+7=", "30+3=", "5+50=", "8+80="]
ANSWERS = ["2", "5", "18", "8", "the answer is 19", "33 is it", "it is 55 ok", "88, i think"]


def sft_batches(tokenizer) -> list[Batch]:
    prompts, pmask = encode_prompts(tokenizer, [[{"role": "user", "content": q}] for q in QUESTIONS], 12, "test")
    responses, rmask = encode_responses(tokenizer, ANSWERS, 20, "test")
    first = Batch({"prompts": prompts, "prompt_mask": pmask, "responses": responses, "response_mask": rmask})
    # Step 1: short answers on rank 0, long on rank 1; step 2 mixes them differently.
    return [first, first.select([5, 0, 6, 4, 1, 2, 3, 7])]


def reference_training(model_dir, batches: list[Batch], device: str = "cpu"
                       ) -> tuple[torch.nn.Module, list[tuple[float, float]]]:
    """The same steps, unsharded, whole batch, padded forward, token-mean NLL, torch AdamW, on ``device``;
    returns the trained model and each step's (loss, grad norm)."""
    model = load_causal_lm(model_dir).to(device).train()
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY, betas=(0.9, 0.999))
    stats = []
    for b in batches:
        b = Batch({k: v.to(device) for k, v in b.tensors.items()})
        ids = torch.cat([b["prompts"], b["responses"]], 1)
        mask = torch.cat([b["prompt_mask"], b["response_mask"]], 1)
        lp, _ = local_model(model).response_log_probs(ids, mask, b["responses"])
        rmask = b["response_mask"].float()
        loss = -(lp * rmask).sum() / rmask.sum()
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), GRAD_CLIP)
        opt.step()
        opt.zero_grad()
        stats.append((loss.item(), norm.item()))
    return model, stats
