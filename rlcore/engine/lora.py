"""LoRA adapters through peft: adding, loading, saving and merging them, and the reference they give for free.

A model trained with LoRA (``actor``/``critic``/``sft.lora.rank`` > 0) keeps its base weights frozen and trains
two low-rank matrices per target module. What that changes elsewhere:

* **reference without a copy**: a round that starts from a base model takes its reference log-probs from the
  same model with the adapter disabled (:func:`reference_weights`); a round that starts from an adapter
  continues training it and keeps a frozen copy of it as a second adapter (``REFERENCE``), which the reference
  forward switches to;
* **saved folders are adapter folders**: ``adapter_config.json`` + ``adapter_model.safetensors`` (+ the
  tokenizer), whose ``base_model_name_or_path`` is the base model folder *relative to the adapter folder*, so a
  copied or moved tree still finds it (:func:`save_adapter`, :func:`adapter_base`). Every loader of rlcore
  accepts such a folder wherever it accepts a model folder; ``rlcore export`` merges it into a plain one;
* **what moves after an update**: only the adapter's tensors (:func:`is_adapter_key`).
"""

from __future__ import annotations

import copy
import json
import os
import sys
import warnings
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Iterator

from rlcore.errors import ConfigError, InputNotFound

if TYPE_CHECKING:  # this module is read by light checks (rlcore diagnose) too: torch and peft load where used
    import torch

ADAPTER_CONFIG = "adapter_config.json"
POLICY = "default"  # peft's name of the first adapter: the one that trains
REFERENCE = "reference"  # the frozen copy of the adapter a round starts from
TASK_TYPES = {"causal_lm": "CAUSAL_LM", "value": "TOKEN_CLS"}  # TOKEN_CLS: peft trains the value head (score) fully
VALUE_HEADS = ["score", "classifier"]


@dataclass(frozen=True)
class LoraSpec:
    """LoRA of a trained model (params.yaml ``actor``/``critic``/``sft.lora``); rank 0 = off."""

    rank: int = 0
    alpha: float = 32.0
    dropout: float = 0.0
    target_modules: str | tuple[str, ...] = "all-linear"
    seed: int = 0
    """Seeds a fresh adapter's initialisation (the same on every rank)."""

    @property
    def on(self) -> bool:
        return self.rank > 0


def is_adapter(path: str | Path) -> bool:
    """Whether ``path`` is a LoRA adapter folder (rather than a full model folder)."""
    return (Path(path) / ADAPTER_CONFIG).is_file()


def adapter_config(path: str | Path) -> dict:
    return json.loads((Path(path) / ADAPTER_CONFIG).read_text())


def adapter_base(path: str | Path) -> Path:
    """The base model folder of the adapter folder ``path`` (its ``base_model_name_or_path``, relative to it)."""
    folder = Path(path)
    base = adapter_config(folder).get("base_model_name_or_path") or ""
    resolved = Path(base) if Path(base).is_absolute() else folder / base
    if not base or not ((resolved / "config.json").is_file() or is_adapter(resolved)):
        raise InputNotFound(f"{folder}: the base model of this LoRA adapter ({base or 'none named'}, resolved to "
                            f"{resolved}) is not a model folder; adapters need their base model beside them")
    return resolved.resolve()


def architecture_folder(path: str | Path) -> Path:
    """The folder whose ``config.json`` describes the model at ``path`` (the base of an adapter)."""
    folder = Path(path)
    return architecture_folder(adapter_base(folder)) if is_adapter(folder) else folder


def spec_of(path: str | Path) -> LoraSpec:
    """The LoRA settings the adapter folder ``path`` was trained with."""
    c = adapter_config(path)
    targets = c.get("target_modules") or "all-linear"
    return LoraSpec(rank=int(c["r"]), alpha=float(c["lora_alpha"]), dropout=float(c.get("lora_dropout") or 0.0),
                    target_modules=targets if isinstance(targets, str) else tuple(sorted(targets)))


def check_continues(spec: LoraSpec, path: str | Path, key: str) -> None:
    """A model that starts from the adapter at ``path`` trains that adapter on: ``spec`` (params.yaml ``key``) must be
    its settings. ConfigError naming both otherwise."""
    saved = spec_of(path)
    mine = spec.target_modules if isinstance(spec.target_modules, str) else tuple(sorted(spec.target_modules))
    # peft saves 'all-linear' as the module names it resolved to: a list of names is compared, 'all-linear' is not
    same_targets = isinstance(mine, str) or isinstance(saved.target_modules, str) or mine == saved.target_modules
    if (saved.rank, saved.alpha) != (spec.rank, spec.alpha) or not same_targets:
        raise ConfigError(f"{key} (rank {spec.rank}, alpha {spec.alpha:g}, target_modules {_targets(mine)}) differs "
                          f"from the adapter it starts from, {path} (rank {saved.rank}, alpha {saved.alpha:g}, "
                          f"target_modules {_targets(saved.target_modules)}): training goes on with that adapter, so "
                          f"set {key} to its settings, or {key}.rank: 0 to train the merged model fully")


def _targets(t: str | tuple[str, ...]) -> str:
    return t if isinstance(t, str) else "[" + ", ".join(t) + "]"


def peft_config(spec: LoraSpec, kind: str = "causal_lm"):
    from peft import LoraConfig

    targets = spec.target_modules if isinstance(spec.target_modules, str) else list(spec.target_modules)
    # a value model's head (score) trains fully (peft's modules_to_save for TOKEN_CLS): no adapter on it
    exclude = VALUE_HEADS if kind == "value" else None
    return LoraConfig(r=spec.rank, lora_alpha=spec.alpha, lora_dropout=spec.dropout, target_modules=targets,
                      exclude_modules=exclude, task_type=TASK_TYPES[kind])


def add_adapter(model: torch.nn.Module, spec: LoraSpec, *, kind: str = "causal_lm", key: str = "lora",
                seed: int = 0):
    """``model`` with a fresh trainable adapter (peft's initialisation: A random, B = 0, so the model is unchanged);
    every other parameter frozen (but a value model's head, which trains fully). A is drawn from ``seed`` on a forked
    generator: every rank of a group draws the same adapter (sharded ranks never compare their shards), and the
    process's own random stream is left as it was."""
    import torch
    from peft import get_peft_model

    try:
        with _quiet(), torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            return get_peft_model(model, peft_config(spec, kind))
    except ValueError as err:  # peft: target modules not found in the model
        raise ConfigError(f"{key}.target_modules {_targets(spec.target_modules)}: {str(err).splitlines()[0]}") from None


def load_adapter(model: torch.nn.Module, path: str | Path, *, trainable: bool, with_reference: bool = False):
    """``model`` (the adapter's base) with the adapter saved at ``path`` as ``POLICY`` (trainable or not) and, with
    ``with_reference``, a frozen copy of it as ``REFERENCE``; the policy adapter is the active one."""
    from peft import PeftModel

    with _quiet():
        peft_model = PeftModel.from_pretrained(model, str(path), is_trainable=trainable)
        if with_reference:
            peft_model.load_adapter(str(path), adapter_name=REFERENCE, is_trainable=False)
            peft_model.set_adapter(POLICY, inference_mode=not trainable)
    return peft_model


@contextmanager
def _quiet() -> Iterator[None]:
    """peft 0.21 asks transformers 5 a deprecated question (``is_gradient_checkpointing``) on every wrap."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*")
        yield


def merged(model: torch.nn.Module) -> torch.nn.Module:
    """A plain model with the active adapter merged into the base weights (``model`` itself if it has none)."""
    return model.merge_and_unload() if is_peft(model) else model


def hf_model(model: torch.nn.Module) -> torch.nn.Module:
    """The Hugging Face model inside a peft model (``model`` itself otherwise)."""
    return model.get_base_model() if is_peft(model) else model


def merged_copy(model: torch.nn.Module, state: dict[str, torch.Tensor]) -> torch.nn.Module:
    """A plain model on the CPU with the peft ``model``'s full unsharded ``state`` and its adapter merged in, built
    fresh from the model's config (the live, possibly sharded, model stays as it is and may go on training)."""
    import torch
    from peft import get_peft_model

    base = model.get_base_model()
    with torch.device("meta"):
        fresh = type(base)(copy.deepcopy(base.config))
    config = copy.deepcopy(model.peft_config[POLICY])
    config.inference_mode = False
    with _quiet():
        fresh = get_peft_model(fresh, config)
    # copies: merging writes into the base weights, which must not be the live model's
    fresh.load_state_dict({k: v.detach().to("cpu", copy=True) for k, v in state.items()}, strict=True, assign=True)
    live = dict(base.named_buffers())
    for name, buf in list(fresh.get_base_model().named_buffers()):
        if buf.is_meta:  # buffers a state dict leaves out (rotary frequencies): the live model's
            owner, _, leaf = name.rpartition(".")
            fresh.get_base_model().get_submodule(owner)._buffers[leaf] = live[name].detach().cpu().clone()
    return fresh.merge_and_unload()


def merged_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The weights of ``model`` as a plain Hugging Face state dict, the policy adapter merged in (base weight plus
    peft's ``get_delta_weight``; other adapters left out), computed beside the live tensors without changing them (a
    merge and unmerge in place would leave rounding in the base weights): what an engine that takes whole models
    (vLLM) loads. A model without an adapter: its own state dict."""
    if not is_peft(model):
        return {k: v.detach() for k, v in model.state_dict().items()}
    import torch
    from peft.tuners.lora import LoraLayer

    base = model.get_base_model()
    with torch.no_grad():
        deltas = {f"{name}.weight": module.get_delta_weight(POLICY) for name, module in base.named_modules()
                  if isinstance(module, LoraLayer) and POLICY in module.lora_A}
        out = {}
        for key, value in base.state_dict().items():
            if ".lora_" in key:
                continue
            key = key.replace(".base_layer.", ".")
            out[key] = (value + deltas[key].to(value.dtype) if key in deltas else value).detach()
    return out


def is_peft(model: torch.nn.Module) -> bool:
    """Whether ``model`` is a peft model (without importing peft where it was never imported: then none is)."""
    if "peft" not in sys.modules:
        return False
    from peft import PeftModel

    return isinstance(model, PeftModel)


def has_reference_adapter(model: torch.nn.Module) -> bool:
    return is_peft(model) and REFERENCE in model.peft_config


@contextmanager
def _trainable_flags_kept(model: torch.nn.Module) -> Iterator[None]:
    """Whatever runs inside leaves ``requires_grad`` of the parameters registered on entry as it found it.

    peft switches adapters (``set_adapter``, ``disable_adapter``) by setting ``requires_grad`` on the adapter
    parameters registered at that moment. Under FSDP2 those are the shards between steps and the gathered copies
    after a forward that kept them (``resources.reshard_after_forward`` off), and the gathered copy of a parameter
    is made once, with the shard's flag at that time: a switch made on one and undone on the other left the
    shards frozen, so the optimizer stopped moving the adapter and a save found nothing to write. A no-grad
    reference forward needs none of those flags changed, so none is."""
    flags = [(p, p.requires_grad) for p in model.parameters()]
    try:
        yield
    finally:
        for p, trains in flags:
            p.requires_grad_(trains)


@contextmanager
def reference_weights(model: torch.nn.Module) -> Iterator[None]:
    """Forwards inside run the round's starting model: the frozen ``REFERENCE`` adapter where the round started from
    an adapter, else the base with the adapter disabled. For no-grad forwards only; which parameters train is the
    same inside and after (:func:`_trainable_flags_kept`), whichever of a sharded model's layouts is registered."""
    if has_reference_adapter(model):
        with _trainable_flags_kept(model):
            model.set_adapter(REFERENCE, inference_mode=True)
        try:
            yield
        finally:
            with _trainable_flags_kept(model):
                model.set_adapter(POLICY)
    else:
        disabled = model.disable_adapter()
        with _trainable_flags_kept(model):
            disabled.__enter__()
        try:
            yield
        finally:
            with _trainable_flags_kept(model):
                disabled.__exit__(None, None, None)


def is_adapter_key(name: str) -> bool:
    """Whether a state-dict key of a peft model is a LoRA tensor of the policy adapter."""
    return (".lora_A." in name or ".lora_B." in name) and f".{POLICY}." in name


def save_adapter(model: torch.nn.Module, state: dict[str, torch.Tensor], out: str | Path, base: str | Path) -> None:
    """Write the policy adapter of ``model`` (its tensors taken from the full ``state``, unsharded) as an adapter folder
    at ``out`` whose base model is the folder ``base`` (recorded relative to ``out``)."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    card = out / "README.md"
    had_card = card.exists()
    # peft reads the base's config to see whether the vocabulary changed: give it the path from here
    model.peft_config[POLICY].base_model_name_or_path = str(Path(base).resolve())
    with _quiet():
        model.save_pretrained(out, state_dict={k: v.cpu().contiguous() for k, v in state.items()},
                              selected_adapters=[POLICY], safe_serialization=True)
    if not had_card:
        card.unlink(missing_ok=True)  # peft's model card is a template of placeholders
    config = adapter_config(out)
    config["base_model_name_or_path"] = os.path.relpath(Path(base).resolve(), out.resolve())
    (out / ADAPTER_CONFIG).write_text(json.dumps(config, indent=2, sort_keys=True))


def trainable_count(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters() if p.requires_grad)
