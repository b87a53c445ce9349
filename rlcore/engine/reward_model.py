"""Reward models: a Hugging Face sequence-classification model (``num_labels=1``) scored at each response's last
token, and the statistics that standardise its scores.

Any ``*ForSequenceClassification`` folder whose head sits on a decoder (``score`` on ``model``, as transformers
builds it for Llama, Qwen2, Qwen3, Mistral, Gemma and most decoders) works, as does the ``rm`` stage's output;
a causal-LM folder (the SFT model) loads with a fresh head, which the ``rm`` stage trains. The score of a
(prompt ; response) sequence is the head's output at the last real token of the response (its EOS when it has
one), found from the attention mask, not from the pad token id (which some tokenizers share with EOS).

``reward_stats.json`` in the folder holds the mean and standard deviation of the model's scores on its training
pairs (both answers), written by the ``rm`` stage; ``reward.model.normalize`` standardises with them.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch
from transformers import AutoConfig, AutoModelForSequenceClassification

from rlcore.engine import fused
from rlcore.engine.model import DTYPES, ModelSpec, load_tokenizer, wrap_for_training
from rlcore.engine.sequence import SequenceModel, position_ids
from rlcore.errors import ConfigError, InputNotFound

STATS_FILE = "reward_stats.json"


class LastTokenReward(torch.nn.Module):
    """A sequence-classification model whose forward returns one score per row: the head at the row's last real
    token. The model is a submodule, so a sharding strategy wraps this module as its root (every parameter
    outside the decoder blocks is gathered by the root's forward) and the blocks as usual."""

    def __init__(self, model: torch.nn.Module):
        super().__init__()
        self.model = model
        self._no_split_modules = getattr(model, "_no_split_modules", None)
        if not isinstance(getattr(model, "score", None), torch.nn.Linear) or not hasattr(model, model.base_model_prefix):
            raise ConfigError(f"{type(model).__name__}: a reward model needs a decoder with a linear 'score' head "
                              "(transformers' *ForSequenceClassification of a decoder)")

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """``[batch]`` scores of ``[batch, len]`` sequences (left-padded prompt, right-padded response)."""
        backbone = getattr(self.model, self.model.base_model_prefix)
        hidden = backbone(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids(attention_mask),
                          use_cache=False).last_hidden_state
        index = torch.arange(attention_mask.shape[1], device=attention_mask.device)
        last = (index * attention_mask.long()).argmax(-1)
        return self.model.score(hidden[torch.arange(len(last), device=last.device), last]).squeeze(-1).float()


def load_reward_model(spec: ModelSpec, device: torch.device, *, frozen: bool) -> SequenceModel:
    """The reward model at ``spec.path`` (a fresh head on a causal-LM folder), wrapped with the spec's strategy:
    trainable (the rm stage) or frozen (scoring in PPO rounds, score and evaluate)."""
    path = Path(spec.path)
    if not (path / "config.json").is_file():
        raise InputNotFound(f"reward model {spec.path!r}: expected a local Hugging Face folder with config.json")
    tok = load_tokenizer(path)
    config = AutoConfig.from_pretrained(str(path), num_labels=1, local_files_only=True)
    config.pad_token_id = tok.pad_token_id
    model = AutoModelForSequenceClassification.from_pretrained(
        str(path), config=config, dtype=DTYPES["float32"], attn_implementation=spec.attn_implementation,
        local_files_only=True)
    fused.use_fused_ops(model)
    if model.config.num_labels != 1:
        raise ConfigError(f"reward model {spec.path!r}: its head has {model.config.num_labels} outputs; expected 1")
    module = LastTokenReward(model).to(device)
    return wrap_for_training(spec, module, device, frozen=frozen)


def sequence_scores(model: SequenceModel, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """``[batch]`` float32 scores (with the strategy's autocast)."""
    with model.strategy.autocast():
        return model.module(input_ids, attention_mask).float()


def save_reward_model(model: SequenceModel, path: str | Path, *, rank: int, tokenizer, stats: dict | None) -> None:
    """Write the model as a plain sequence-classification folder (and ``reward_stats.json``) from rank 0. A
    collective: every rank calls it."""
    state = model.strategy.checkpoint_state_dict(model.module)
    if rank == 0:
        out = Path(path)
        out.mkdir(parents=True, exist_ok=True)
        inner = model.module.model
        inner.save_pretrained(out, state_dict={k.removeprefix("model."): v.cpu().contiguous() for k, v in state.items()},
                              safe_serialization=True)
        tokenizer.save_pretrained(out)
        if stats is not None:
            (out / STATS_FILE).write_text(json.dumps(stats, indent=1) + "\n")


def read_stats(path: str | Path) -> dict[str, float]:
    """``{"mean", "std"}`` from a reward model folder (one line naming the folder when there is none)."""
    file = Path(path) / STATS_FILE
    if not file.is_file():
        raise InputNotFound(f"reward.model.normalize is true but {path} has no {STATS_FILE} (the rm stage writes it): "
                            "set reward.model.normalize: false, or train the model with an rm stage")
    stats = json.loads(file.read_text())
    return {"mean": float(stats["mean"]), "std": float(stats["std"])}


class LocalRewardModel:
    """``reward.model`` in this process, on the CPU (``rlcore eval``): scores (prompt messages, response text)
    pairs as the reward-model worker group does, standardised and weighted the same way."""

    def __init__(self, path: str, *, weight: float, normalize: bool, micro_batch_size: int = 64):
        self.tokenizer = load_tokenizer(path)
        self.model = load_reward_model(ModelSpec(path), torch.device("cpu"), frozen=True)
        self.stats = read_stats(path) if normalize else None
        self.weight, self.micro = weight, micro_batch_size

    def __call__(self, prompts: list[list[dict]], responses: list[str], ended: list[bool]):
        """Scores of each response to its prompt; ``ended``: it stopped at EOS (the EOS is then its last token, as
        in generation), else it ran to the token limit."""
        from rlcore.rewards.scoring import ModelScores  # here: keeps rlcore/rewards out of the rm stage's deps

        tok, raw = self.tokenizer, []
        for start in range(0, len(responses), self.micro):
            rows = []
            part = slice(start, start + self.micro)
            for messages, text, stop in zip(prompts[part], responses[part], ended[part]):
                prompt = tok.apply_chat_template(list(messages), add_generation_prompt=True, tokenize=False)
                rows.append((tok(prompt, add_special_tokens=False)["input_ids"],
                             tok(text, add_special_tokens=False)["input_ids"] + ([tok.eos_token_id] if stop else [])))
            width_p, width_r = max(len(p) for p, _ in rows), max(len(r) for _, r in rows)
            ids = torch.full((len(rows), width_p + width_r), tok.pad_token_id)
            mask = torch.zeros_like(ids)
            for i, (p, r) in enumerate(rows):
                ids[i, width_p - len(p):width_p + len(r)] = torch.tensor(p + r)
                mask[i, width_p - len(p):width_p + len(r)] = 1
            with torch.no_grad():
                raw.append(sequence_scores(self.model, ids, mask).double().numpy())
        scores = np.concatenate(raw)
        value = (scores - self.stats["mean"]) / self.stats["std"] if self.stats is not None else scores
        return ModelScores(raw=scores, value=value, weight=self.weight)
