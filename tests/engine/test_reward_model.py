"""Reward models (rlcore.engine.reward_model, workers.rm, trainer.rm): the score at each response's last token equals
the Hugging Face sequence-classification model's own pooled output; the Bradley-Terry loss by hand; a saved model
reloads as a plain HF folder with the same scores; and a real rm run on Ray learns a preference."""

from __future__ import annotations

import json
import math

import numpy as np
import pandas as pd
import pytest
import torch
from transformers import AutoModelForSequenceClassification

from rlcore.config import parse_config
from rlcore.engine.model import ModelSpec
from rlcore.engine.reward_model import load_reward_model, read_stats, save_reward_model, sequence_scores
from rlcore.errors import InputNotFound
from rlcore.tracking import NullTracker
from rlcore.workers.rm_training import bradley_terry_loss


def padded_pairs(tok) -> tuple[torch.Tensor, torch.Tensor]:
    """Sequences in the pipeline's layout: left-padded prompts, right-padded responses of different lengths."""
    prompts = [tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, tokenize=False)
               for q in ("1+1", "12+30", "7+7")]
    answers = ["2", "42", "14 or so"]
    p_ids = [tok(p, add_special_tokens=False)["input_ids"] for p in prompts]
    r_ids = [tok(a, add_special_tokens=False)["input_ids"] + [tok.eos_token_id] for a in answers]
    width_p, width_r = max(map(len, p_ids)), max(map(len, r_ids))
    ids = torch.full((3, width_p + width_r), tok.pad_token_id)
    mask = torch.zeros_like(ids)
    for i, (p, r) in enumerate(zip(p_ids, r_ids)):
        ids[i, width_p - len(p):width_p] = torch.tensor(p)
        ids[i, width_p:width_p + len(r)] = torch.tensor(r)
        mask[i, width_p - len(p):width_p + len(r)] = 1
    return ids, mask


def test_scores_are_the_sequence_classification_models_own_at_the_last_token(tiny_model_dir, tiny_tokenizer, tmp_path):
    torch.manual_seed(0)
    rm = load_reward_model(ModelSpec(str(tiny_model_dir)), torch.device("cpu"), frozen=True)
    ids, mask = padded_pairs(tiny_tokenizer)
    ours = sequence_scores(rm, ids, mask)
    hf = rm.module.model  # transformers pools at the rightmost token that is not the pad token: the same one here
    with torch.no_grad():
        theirs = hf(input_ids=ids, attention_mask=mask, position_ids=(mask.cumsum(-1) - 1).clamp(min=0)).logits[:, 0]
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-6)
    assert ours.std() > 0  # the rows score differently

    save_reward_model(rm, tmp_path / "rm", rank=0, tokenizer=tiny_tokenizer, stats={"mean": 1.0, "std": 2.0})
    reloaded = AutoModelForSequenceClassification.from_pretrained(tmp_path / "rm", local_files_only=True)
    assert reloaded.config.num_labels == 1
    with torch.no_grad():
        again = reloaded(input_ids=ids, attention_mask=mask, position_ids=(mask.cumsum(-1) - 1).clamp(min=0)).logits[:, 0]
    torch.testing.assert_close(again, ours, rtol=1e-5, atol=1e-6)
    assert read_stats(tmp_path / "rm") == {"mean": 1.0, "std": 2.0}
    with pytest.raises(InputNotFound, match="reward.model.normalize is true but .* has no reward_stats.json"):
        read_stats(tiny_model_dir)


def test_bradley_terry_loss_by_hand():
    chosen, rejected, margin = torch.tensor([1.0, -0.5]), torch.tensor([0.0, 0.5]), torch.tensor([0.0, 1.0])
    by_hand = np.mean([-math.log(1 / (1 + math.exp(-1.0))), -math.log(1 / (1 + math.exp(2.0)))])
    assert bradley_terry_loss(chosen, rejected, margin, 0.0).item() == pytest.approx(by_hand, rel=1e-6)
    centred = by_hand + 0.1 * np.mean([1.0**2, 0.0**2])
    assert bradley_terry_loss(chosen, rejected, margin, 0.1).item() == pytest.approx(centred, rel=1e-6)


# a reward model trained to a preference on Ray ranks (~28 s): make test-integration
@pytest.mark.integration
def test_a_reward_model_learns_a_preference_on_ray(tiny_model_dir, tiny_tokenizer, tmp_path, ray_local):
    """Chosen answers end in "!" and rejected ones do not: 40 steps on two data-parallel ranks rank every held-out
    pair right, and the saved statistics are the scores' own."""
    from rlcore.trainer.rm import pair_batch, run_rm

    rng = np.random.default_rng(0)
    records = [{"prompt": f"{a}+{b}", "chosen": f"{a + b}!", "rejected": f"{a + b + int(rng.integers(1, 9))}"}
               for a, b in rng.integers(0, 50, (96, 2))]
    pd.DataFrame(records[:64]).to_parquet(tmp_path / "train.parquet")
    pd.DataFrame(records[64:]).to_parquet(tmp_path / "test.parquet")
    cfg = parse_config({"tracking": {"enabled": False}, "rm": {"steps": 40, "batch_size": 16, "lr": 0.01,
                                                                "warmup_steps": 2, "eval_every": 20}})
    metrics = run_rm(cfg, init=str(tiny_model_dir), tokenizer=tiny_tokenizer, train_path=str(tmp_path / "train.parquet"),
                     test_path=str(tmp_path / "test.parquet"), out_dir=str(tmp_path / "rm"), tracker=NullTracker(),
                     plot_csv=str(tmp_path / "rm.csv"))
    assert metrics["rm/test_accuracy"] == 1.0 and metrics["rm/test_margin"] > 0, metrics
    assert (metrics["rm/train_pairs"], metrics["rm/test_pairs"], metrics["rm/steps"]) == (64, 32, 40)
    plot = pd.read_csv(tmp_path / "rm.csv")
    assert plot["rm/val_accuracy"].notna().sum() == 2  # step 20 and the end
    # the saved folder scores the training pairs with exactly the saved statistics
    stats = json.loads((tmp_path / "rm" / "reward_stats.json").read_text())
    model = load_reward_model(ModelSpec(str(tmp_path / "rm")), torch.device("cpu"), frozen=True)
    pairs = pair_batch(str(tmp_path / "train.parquet"), tiny_tokenizer, cfg)
    from rlcore.engine.sequence import sequences
    from rlcore.workers.rm_training import pair_halves

    scores = np.concatenate([sequence_scores(model, *sequences(half)).detach().numpy() for half in pair_halves(pairs)])
    assert stats["mean"] == pytest.approx(scores.mean(), abs=1e-4) and stats["std"] == pytest.approx(scores.std(), rel=1e-3)
