"""The memory estimate (rlcore.engine.footprint), the checks a stage runs before Ray starts (trainer.loop.model_specs.check_model),
the offload and LoRA settings' validation, and ``rlcore init-model``'s real shapes."""

from __future__ import annotations

import argparse
import json

import pytest
import torch

from rlcore.stage.frame import DeclaredConfig
from rlcore.config import ConfigError, apply_overrides, parse_config
from rlcore.engine import footprint, lora
from rlcore.engine.lora import LoraSpec
from rlcore.engine.model import load_causal_lm
from rlcore.trainer.loop.model_specs import check_model
from stages.ppo import PARAMS as PPO_PARAMS
from stages.sft import PARAMS as SFT_PARAMS


def config(**sets):
    return parse_config(apply_overrides({}, sets))


def test_the_lora_count_is_peft_s_and_the_parts_follow_the_settings(tiny_model_dir):
    spec = LoraSpec(rank=4, target_modules=("q_proj", "v_proj", "down_proj"))
    shape = footprint.model_shape(tiny_model_dir, [(4, spec.target_modules), (8, "all-linear")])
    model = load_causal_lm(tiny_model_dir)
    assert shape.params == sum(p.numel() for p in model.parameters())
    peft_model = lora.add_adapter(load_causal_lm(tiny_model_dir), spec)
    assert shape.lora_params[(4, "q_proj,v_proj,down_proj")] == lora.trainable_count(peft_model)
    peft_all = lora.add_adapter(load_causal_lm(tiny_model_dir), LoraSpec(rank=8))
    assert shape.lora_params[(8, "all-linear")] == lora.trainable_count(peft_all)

    full = footprint.trainer_estimate(config(), shape, "actor", "ppo", with_ref=True, rollout_copy=False).parts
    assert full["weights"] == 4 * shape.params and full["AdamW"] == 8 * shape.params
    assert full["reference"] == 4 * shape.params and "rollout copy" not in full
    lo = footprint.trainer_estimate(config(**{"actor.lora.rank": 8}), shape, "actor", "ppo", with_ref=True,
                                    rollout_copy=True).parts
    assert lo["gradients"] == 4 * shape.lora_params[(8, "all-linear")] and "reference" not in lo
    assert lo["rollout copy"] == 4 * shape.params
    from rlcore.engine.tiny_model import build_char_tokenizer, tiny_config

    cfg = config()
    deep = footprint.model_shape(tiny_config(build_char_tokenizer(), **cfg.model.tiny.model_dump()))  # 3 layers
    plain = footprint.trainer_estimate(cfg, deep, "actor", "ppo").parts["activations"]
    ckpt = footprint.trainer_estimate(config(**{"actor.gradient_checkpointing": True}), deep, "actor", "ppo").parts
    assert ckpt["activations"] < plain


def test_a_shape_counted_once_is_read_back_from_the_cache_and_a_bad_file_is_counted_again(tiny_model_dir, tmp_path,
                                                                                            monkeypatch):
    """A stage after the first reads the counts from rlcore's cache folder without building a model; a torn file
    is counted again (and replaced)."""
    monkeypatch.setenv("RLCORE_CACHE", str(tmp_path))
    monkeypatch.setattr(footprint, "_META_COUNTS", {})
    spec = (4, ("q_proj", "v_proj"))
    first = footprint.model_shape(tiny_model_dir, [spec])
    model = load_causal_lm(tiny_model_dir)
    assert first.params == sum(p.numel() for p in model.parameters())
    (saved,) = (tmp_path / "model-shapes").iterdir()

    from transformers import AutoModelForCausalLM

    def no_model(*args, **kwargs):
        raise AssertionError("a model was built for a shape in the cache")

    monkeypatch.setattr(footprint, "_META_COUNTS", {})  # a new process
    with monkeypatch.context() as m:
        m.setattr(AutoModelForCausalLM, "from_config", no_model)
        assert footprint.model_shape(tiny_model_dir, [spec]) == first
    saved.write_text('{"params": 1')
    monkeypatch.setattr(footprint, "_META_COUNTS", {})
    assert footprint.model_shape(tiny_model_dir, [spec]) == first
    assert json.loads(saved.read_text())["params"] == first.params


def test_the_estimate_warns_only_when_it_does_not_fit(tiny_model_dir, monkeypatch):
    cfg = config()
    assert footprint.warning(cfg, tiny_model_dir, "ppo") is None
    need = sum(e.per_rank for e in footprint.estimates(cfg, tiny_model_dir, "ppo")) * cfg.resources.n_workers
    monkeypatch.setattr(footprint, "machine_bytes", lambda: (need, need * 0.9))
    line = footprint.warning(cfg, tiny_model_dir, "ppo")
    assert line.startswith("memory: ") and "will not fit" in line and "ppo actor: about" in line
    assert "\n" not in line and "lora.rank" in line


def test_the_stages_checks_read_only_their_declared_params_and_refuse_bad_lora(tiny_model_dir, tmp_path, capsys):
    declared = lambda cfg, sections, stage: DeclaredConfig(cfg, sections, stage)  # noqa: E731
    check_model(declared(config(**{"sft.lora.rank": 4}), SFT_PARAMS, "sft"), tiny_model_dir, "sft")
    check_model(declared(config(**{"actor.lora.rank": 4}), PPO_PARAMS, "ppo"), tiny_model_dir, "ppo")
    with pytest.raises(ConfigError, match=r"actor.lora.target_modules: qq_proj: no linear layer of that name"):
        check_model(config(**{"actor.lora.rank": 4, "actor.lora.target_modules": ["q_proj", "qq_proj"]}),
                    tiny_model_dir, "ppo")
    adapter = tmp_path / "adapter"
    peft_model = lora.add_adapter(load_causal_lm(tiny_model_dir), LoraSpec(rank=4, alpha=8.0))
    lora.save_adapter(peft_model, dict(peft_model.named_parameters()), adapter, tiny_model_dir)
    check_model(config(**{"actor.lora.rank": 4, "actor.lora.alpha": 8.0}), adapter, "ppo")
    with pytest.raises(ConfigError, match=r"actor.lora \(rank 16, alpha 32.*differs from the adapter"):
        check_model(config(**{"actor.lora.rank": 16}), adapter, "ppo")


@pytest.mark.parametrize("sets, needle", [
    ({"resources.offload.optimizer": True}, "resources.offload.optimizer is true but resources.use_gpu is false"),
    ({"resources.offload.params": True}, "resources.offload.params is true but resources.use_gpu is false"),
    ({"resources.offload.params": True, "resources.use_gpu": True},
     "resources.offload.params is true but resources.strategy is 'ddp'"),
    ({"actor.lora.target_modules": "attention"}, "expected 'all-linear' or a list of module names"),
    ({"sft.lora.rank": -1}, "sft.lora.rank"),
])
def test_offload_and_lora_settings_that_cannot_work_are_one_line(sets, needle):
    with pytest.raises(ConfigError) as err:
        config(**sets)
    assert needle in str(err.value) and "\n" not in str(err.value)


def test_init_model_shapes_are_the_published_dimensions_and_flags_override_them(tmp_path):
    from rlcore.commands import init_model

    def args(**kw):
        base = {k: None for k in ("shape", "arch", "hidden_size", "num_layers", "num_heads", "num_kv_heads",
                                  "intermediate_size", "vocab_size", "tie_word_embeddings", "max_position_embeddings")}
        return argparse.Namespace(**{**base, **kw})

    qwen = init_model._resolved(args(shape="qwen2.5-0.5b"))
    assert (qwen["hidden_size"], qwen["num_layers"], qwen["num_heads"], qwen["num_kv_heads"], qwen["intermediate_size"],
            qwen["vocab_size"], qwen["tie_word_embeddings"]) == (896, 24, 14, 2, 4864, 151936, True)
    assert init_model._resolved(args(shape="qwen2.5-0.5b", num_layers=2))["num_layers"] == 2
    with pytest.raises(ConfigError, match="give --arch, --hidden-size"):
        init_model._resolved(args(num_layers=2))
    out = tmp_path / "m"
    assert init_model.run(argparse.Namespace(**vars(args(arch="qwen2", hidden_size=32, num_layers=1, num_heads=4,
                                                        num_kv_heads=2, vocab_size=300, tie_word_embeddings=True)),
                                             out=str(out), tokenizer=None, seed=0)) == 0
    model = load_causal_lm(out)
    assert model.config.num_key_value_heads == 2 and model.config.vocab_size == 300
    assert model.get_input_embeddings().weight.data_ptr() == model.get_output_embeddings().weight.data_ptr()
    assert model.model.layers[0].self_attn.k_proj.weight.shape == torch.Size([16, 32])  # 2 kv heads x 8
