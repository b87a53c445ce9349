"""Export of a saved policy as a self-contained Hugging Face folder (``rlcore export``).

The stages already save Hugging Face folders (``models/sft``, ``models/ppo/<round>``; a round trained
with a critic keeps it under ``critic/``); a step checkpoint (``checkpoints/<stage>/step_<N>``) holds the
policy's unsharded weights and names the model folder the stage started from. A stage that trained with LoRA saves
an adapter folder (``rlcore.engine.lora``) and its checkpoints hold the adapters only: the export merges them into
the base weights. An export is the policy alone, in the chosen dtype, with its tokenizer and chat template, written
under a temporary name and renamed, then loaded back with ``AutoModelForCausalLM.from_pretrained`` and compared on a
fixed probe batch with the source as it runs in training (an adapter model: base and adapter unmerged).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

from rlcore.engine import lora
from rlcore.errors import ConfigError, InputNotFound

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# Largest |logit difference| accepted for a float32 export: the weights are copied, not recomputed; merged adapters
# (W + s B A in one matrix instead of two products) round differently, well under 1e-4 on the models tested.
FLOAT32_TOLERANCE = 1e-5
MERGED_TOLERANCE = 1e-4


def check_source(path: Path) -> dict:
    """The source folder's config (its base's, for an adapter folder), after checking it holds a causal LM."""
    if lora.is_adapter(path):
        task = lora.adapter_config(path).get("task_type")
        if task not in (None, "CAUSAL_LM"):
            raise ConfigError(f"{path}: a LoRA adapter of a {task} model, not a causal LM (a critic folder?); "
                              "export takes a policy folder")
        path = lora.architecture_folder(path)
    config_file = path / "config.json"
    if not config_file.is_file():
        raise InputNotFound(f"{path}: expected a saved model folder with config.json (a stage output such as "
                            "models/ppo/r1)")
    config = json.loads(config_file.read_text())
    archs = config.get("architectures") or []
    if archs and not any(a.endswith("ForCausalLM") for a in archs):
        raise ConfigError(f"{path}: holds {', '.join(archs)}, not a causal LM (a critic folder?); "
                          "export takes a policy folder")
    return config


def probe_logits(model, vocab: int, seed: int = 0) -> torch.Tensor:
    """Logits of a fixed batch of random tokens (2 rows of 16, or the context if shorter), in float32."""
    context = int(getattr(model.config, "max_position_embeddings", 16) or 16)
    ids = torch.randint(0, vocab, (2, min(16, context)), generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        return model(input_ids=ids).logits.float()


def load_checkpoint_policy(folder: Path):
    """The policy of a step checkpoint (``rlcore.trainer.loop.checkpoint``): its ``actor.pt`` (a PPO round) or
    ``sft.pt`` weights on the architecture and tokenizer of the model folder the stage started from (with LoRA: its
    adapters on that folder's base, unmerged)."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from rlcore.trainer.loop.checkpoint import CONTROLLER_FILE

    state = torch.load(folder / CONTROLLER_FILE, map_location="cpu", weights_only=False)
    base = Path(state.get("model_dir") or "")
    if not ((base / "config.json").is_file() or lora.is_adapter(base)):
        raise InputNotFound(f"{folder}: the model folder it was trained from ({base}) is gone; export needs its "
                            "config and tokenizer")
    weights = next((folder / f"{name}.pt" for name in ("actor", "sft") if (folder / f"{name}.pt").is_file()), None)
    if weights is None:
        raise InputNotFound(f"{folder}: no actor.pt or sft.pt (the policy's training state)")
    saved = torch.load(weights, map_location="cpu", weights_only=False)
    tokenizer = AutoTokenizer.from_pretrained(str(base), local_files_only=True)
    if saved.get("trained_only"):  # LoRA: the adapters of the checkpoint on the base of the stage's model folder
        from peft import LoraConfig, get_peft_model

        arch = lora.architecture_folder(base)
        model = get_peft_model(AutoModelForCausalLM.from_pretrained(str(arch), dtype=torch.float32,
                                                                    local_files_only=True),
                               LoraConfig(**{k: v for k, v in saved["adapter_config"].items() if k != "peft_type"}))
        missing = [k for k in model.load_state_dict(saved["model"], strict=False).missing_keys
                   if lora.is_adapter_key(k)]
        if missing:
            raise InputNotFound(f"{weights}: holds no weights for {len(missing)} adapter tensors ({missing[0]}, ...)")
        return model, tokenizer
    config = AutoConfig.from_pretrained(str(lora.architecture_folder(base)), local_files_only=True)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(saved["model"])
    return model, tokenizer


def load_source(src: Path):
    """The policy of a model folder, an adapter folder (unmerged) or a step checkpoint, with its tokenizer."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rlcore.trainer.loop.checkpoint import CONTROLLER_FILE

    if (src / CONTROLLER_FILE).is_file():
        return load_checkpoint_policy(src)
    check_source(src)
    tokenizer = AutoTokenizer.from_pretrained(str(src), local_files_only=True)
    if lora.is_adapter(src):
        from rlcore.engine.model import load_causal_lm

        return lora.load_adapter(load_causal_lm(lora.adapter_base(src)), src, trainable=False), tokenizer
    return AutoModelForCausalLM.from_pretrained(str(src), dtype=torch.float32, local_files_only=True), tokenizer


def export_model(source: str | Path, out: str | Path, *, dtype: str = "float32", verify: bool = True) -> str:
    """Write ``source``'s policy (a stage's model folder, an adapter folder or a step checkpoint folder) to ``out`` in
    ``dtype``, adapters merged; returns a one-line report."""
    from transformers import AutoModelForCausalLM

    src, out = Path(source), Path(out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ConfigError(f"--out {out}: exists and is not an empty folder; choose a new path")
    model, tokenizer = load_source(src)
    adapter = lora.is_peft(model)
    vocab = model.config.vocab_size
    reference = probe_logits(model, vocab) if verify else None  # the adapter model as it runs: unmerged
    model = lora.merged(model)
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model.to(DTYPES[dtype]).save_pretrained(tmp, safe_serialization=True)
    tokenizer.save_pretrained(tmp)
    if out.exists():
        out.rmdir()
    tmp.rename(out)
    n_params = sum(p.numel() for p in model.parameters())
    merged = ", LoRA adapters merged" if adapter else ""
    report = f"exported {src} -> {out} ({dtype}, {n_params / 1e6:.2f}M parameters{merged})"
    if reference is None:
        return report
    loaded = AutoModelForCausalLM.from_pretrained(str(out), local_files_only=True)
    diff = float((probe_logits(loaded, vocab) - reference).abs().max())
    tolerance = MERGED_TOLERANCE if adapter else FLOAT32_TOLERANCE
    if dtype == "float32" and diff > tolerance:
        raise RuntimeError(f"export of {src}: reloaded logits differ from the source by {diff:.3g}")
    return f"{report}; reloaded with from_pretrained: max |logit difference| {diff:.3g}"
