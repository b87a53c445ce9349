"""LoRA through the PPO worker, built in this process as one rank: the reference without a second model, the adapter
a round starts from, what moves to the rollout engine and the check of every sync, checkpoints, saved folders and
their export, gradient checkpointing.

Expectations come from paths the worker does not take: the plain Hugging Face model (the reference with the
adapter disabled must be the base model itself), peft's own merged model, the exported folder loaded by
``from_pretrained``, and gradients computed without checkpointing.
"""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from rlcore.algos.aggregation import AggScale
from rlcore.config import PolicyLossConfig
from rlcore.controller import RankPlacement
from rlcore.engine import lora, sync_check
from rlcore.engine.lora import LoraSpec
from rlcore.engine.model import ModelSpec, load_causal_lm, load_critic
from rlcore.engine.sequence import local_model, sequences
from rlcore.export import export_model
from rlcore.protocol import Batch
from rlcore.rollout import EngineSpec, SamplingParams
from rlcore.trainer.loop.checkpoint import CONTROLLER_FILE
from rlcore.workers.actor import ActorRolloutRefWorker, ActorUpdateSpec, KLLossSpec, LogProbSpec
from rlcore.workers.optim import OptimSpec
from rlcore.workers.rollout import GenerateSpec

# the default token-mean aggregation does not read the seq-mean-token-sum-norm divisor this length fills in
RESPONSE_LENGTH = 6
UPDATE = ActorUpdateSpec(epochs=1, mini_batch_size=8, micro_batch_size=4, grad_clip=1.0, temperature=1.0,
                         loss=PolicyLossConfig().resolved(RESPONSE_LENGTH), entropy_coeff=0.0,
                         kl=KLLossSpec("low_var_kl", 0.001), seed=0)
LOG_PROBS = LogProbSpec(micro_batch_size=8)
RANK4 = LoraSpec(rank=4, alpha=8.0)


def worker(path, lora_spec: LoraSpec = RANK4, *, dtype: str = "float32", engine: str = "static",
           lr: float = 0.05, checkpointing: bool = False) -> ActorRolloutRefWorker:
    w = ActorRolloutRefWorker(RankPlacement(0, 1, torch.get_num_threads()),
                              model=ModelSpec(str(path), dtype=dtype, lora=lora_spec,
                                              gradient_checkpointing=checkpointing),
                              engine=EngineSpec(name=engine), optim=OptimSpec(lr=lr), with_ref=True)
    w.init_model()
    return w


def rollouts(w: ActorRolloutRefWorker, seed: int = 1) -> Batch:
    """Eight sampled rows after the probe's two prompts, with old log-probs and random advantages."""
    prompts = Batch({"prompts": w.probe["prompts"].repeat(4, 1), "prompt_mask": w.probe["prompt_mask"].repeat(4, 1)})
    out = prompts.union(w.generate(prompts, GenerateSpec(SamplingParams(max_new_tokens=5), seed, 8)))
    old = w.compute_log_prob(out, LOG_PROBS)["old_log_probs"]
    return out.union(Batch({"old_log_probs": old, "advantages": torch.randn(8, 5, generator=torch.Generator().manual_seed(seed))}))


def plain_log_probs(model, batch: Batch) -> torch.Tensor:
    """Log-probs of the responses under a plain model, padded forward: nothing of the worker's path; 0 after each
    response's end (where packed and padded forwards need not agree)."""
    ids, mask = sequences(batch)
    with torch.no_grad():
        return local_model(model.eval()).response_log_probs(ids, mask, batch["responses"])[0] * batch["response_mask"]


def masked(lp: torch.Tensor, batch: Batch) -> torch.Tensor:
    return lp * batch["response_mask"]


@pytest.fixture(scope="module")
def trained(tiny_model_dir, tmp_path_factory):
    """A LoRA worker from the base model after one update, its batch, and its saved adapter folder."""
    w = worker(tiny_model_dir)
    batch = rollouts(w)
    w.update_actor(batch, UPDATE)
    folder = tmp_path_factory.mktemp("lora") / "r1"
    w.save(str(folder))
    return w, batch, folder


def test_the_reference_is_the_base_model_and_no_second_copy_is_held(tiny_model_dir, trained):
    w, batch, _ = trained
    assert w.ref is None
    base = load_causal_lm(tiny_model_dir)
    n_base = sum(p.numel() for p in base.parameters())
    n_lora = sum(p.numel() for p in w.actor.module.parameters() if p.requires_grad)
    assert sum(p.numel() for p in w.actor.module.parameters()) == n_base + n_lora  # base + adapters, once
    assert 0 < n_lora < n_base / 4
    ref = w.compute_ref_log_prob(batch, LOG_PROBS)["ref_log_probs"]
    torch.testing.assert_close(masked(ref, batch), plain_log_probs(base, batch), atol=1e-5, rtol=0)
    policy = w.compute_log_prob(batch, LOG_PROBS)["old_log_probs"]
    assert float((policy - ref).abs().max()) > 1e-2  # the update moved the policy, not the reference
    # after a reference forward the adapter trains again: a second update still moves the policy
    assert all(p.requires_grad for n, p in w.actor.module.named_parameters() if lora.is_adapter_key(n))


def test_the_saved_adapter_folder_exports_to_a_plain_model_with_the_adapter_models_logits(trained, tmp_path):
    w, batch, folder = trained
    names = {p.name for p in folder.iterdir()}
    assert {"adapter_config.json", "adapter_model.safetensors", "tokenizer.json"} <= names
    assert "model.safetensors" not in names and "README.md" not in names
    saved = load_file(str(folder / "adapter_model.safetensors"))
    assert saved and all("lora_" in k for k in saved)  # the adapters only, not the base
    report = export_model(folder, tmp_path / "merged")
    assert "LoRA adapters merged" in report
    exported = AutoModelForCausalLM.from_pretrained(str(tmp_path / "merged"), local_files_only=True)
    assert not lora.is_adapter(tmp_path / "merged")
    torch.testing.assert_close(plain_log_probs(exported, batch),
                               masked(w.compute_log_prob(batch, LOG_PROBS)["old_log_probs"], batch), atol=1e-4, rtol=0)


def test_a_round_from_an_adapter_trains_it_on_against_a_frozen_copy_of_it(trained, tmp_path):
    w, batch, folder = trained
    start = w.compute_log_prob(batch, LOG_PROBS)["old_log_probs"]
    w2 = worker(folder)
    assert w2.ref is None and lora.has_reference_adapter(w2.actor.module)
    torch.testing.assert_close(w2.compute_log_prob(batch, LOG_PROBS)["old_log_probs"], start, atol=1e-5, rtol=0)
    torch.testing.assert_close(w2.compute_ref_log_prob(batch, LOG_PROBS)["ref_log_probs"], start, atol=1e-5, rtol=0)
    w2.update_actor(batch.replace(old_log_probs=start), UPDATE)
    assert float((w2.compute_log_prob(batch, LOG_PROBS)["old_log_probs"] - start).abs().max()) > 1e-2
    torch.testing.assert_close(w2.compute_ref_log_prob(batch, LOG_PROBS)["ref_log_probs"], start, atol=1e-5, rtol=0)
    w2.save(str(tmp_path / "r2"))  # the new adapter sits on the same base, not on the adapter it started from
    assert lora.adapter_base(tmp_path / "r2") == lora.adapter_base(folder)
    with pytest.raises(Exception, match="rank 8.*differs from the adapter"):
        lora.check_continues(LoraSpec(rank=8, alpha=8.0), folder, "actor.lora")


def test_a_checkpoint_holds_the_adapters_and_resumes_the_same_update(tiny_model_dir, tmp_path):
    w = worker(tiny_model_dir)
    batch = rollouts(w)
    w.update_actor(batch, UPDATE)
    w.save_state(str(tmp_path))
    at_save = w.compute_log_prob(batch, LOG_PROBS)["old_log_probs"]
    state = torch.load(tmp_path / "actor.pt", weights_only=False)
    assert state["trained_only"] and state["model"] and all(lora.is_adapter_key(k) for k in state["model"])
    assert "torch" in torch.load(tmp_path / "actor.rng0.pt", weights_only=False)
    other = worker(tiny_model_dir)  # a fresh run from the base, then resumed
    other.load_state(str(tmp_path))
    torch.testing.assert_close(other.compute_log_prob(batch, LOG_PROBS)["old_log_probs"], at_save, atol=0, rtol=0)
    m1, m2 = w.update_actor(batch, UPDATE), other.update_actor(batch, UPDATE)  # the AdamW moments came back too
    assert m1["actor/grad_norm"] == m2["actor/grad_norm"]
    torch.testing.assert_close(other.compute_log_prob(batch, LOG_PROBS)["old_log_probs"],
                               w.compute_log_prob(batch, LOG_PROBS)["old_log_probs"], atol=0, rtol=0)
    # and `rlcore export` of the checkpoint itself merges its adapters on the base (the controller's file names it)
    torch.save({"model_dir": str(tiny_model_dir)}, tmp_path / CONTROLLER_FILE)
    export_model(tmp_path, tmp_path / "exported")
    exported = AutoModelForCausalLM.from_pretrained(str(tmp_path / "exported"), local_files_only=True)
    torch.testing.assert_close(plain_log_probs(exported, batch), masked(at_save, batch), atol=1e-4, rtol=0)


@pytest.mark.parametrize("engine", ["static", "hf"])
def test_a_copied_rollout_engine_gets_the_adapters_only_and_each_sync_is_checked(tiny_model_dir, engine):
    """bfloat16 compute makes the engine a copy (it cannot read the float32 trainer's tensors)."""
    w = worker(tiny_model_dir, dtype="bfloat16", engine=engine)
    assert not w.engine_shares
    batch = rollouts(w)
    state = w._rollout_state()
    assert state and all(lora.is_adapter_key(k) and v.dtype == torch.bfloat16 for k, v in state.items())
    n_adapter = sum(v.numel() for v in state.values())
    assert n_adapter == sum(p.numel() for p in w.actor.module.parameters() if p.requires_grad)
    w.update_actor(batch, UPDATE)
    before = sync_check.engine_log_probs(w.engine, w.probe, w.device)
    with pytest.raises(sync_check.RolloutOutOfSync, match="weight sync"):  # the update happened, the engine did not get it
        sync_check.check(before, w.probe_log_probs(), dtype="float32", what="weight sync 2")
    w.rollout_stale = True
    w.generate(batch.only("prompts", "prompt_mask"), GenerateSpec(SamplingParams(max_new_tokens=3), 2, 8))
    assert w.syncs == 2
    after = sync_check.engine_log_probs(w.engine, w.probe, w.device)
    assert float((after - w.probe_log_probs()).abs().max()) <= sync_check.TOLERANCE["bfloat16"]


def test_a_missed_sync_fails_loudly(tiny_model_dir):
    """Full fine-tuning with a copied engine (the hf engine never reads the trainer's tensors): an engine that did not
    load the update is caught by the probe, and the next generate after the sync passes it."""
    w = worker(tiny_model_dir, LoraSpec(), engine="hf")
    batch = rollouts(w)
    w.update_actor(batch, UPDATE)
    w.engine.load_weights = lambda state: None  # a sync that never reaches the engine
    with pytest.raises(sync_check.RolloutOutOfSync, match="rank 0, weight sync 2"):
        w.generate(batch.only("prompts", "prompt_mask"), GenerateSpec(SamplingParams(max_new_tokens=3), 2, 8))


def test_the_static_engine_runs_adapters_unmerged_as_peft_does(tiny_model_dir, trained):
    w, batch, folder = trained
    peft_model = lora.load_adapter(load_causal_lm(tiny_model_dir), folder, trainable=False).eval()
    expect = plain_log_probs(peft_model, batch)
    from rlcore.rollout.static import StaticRolloutEngine

    engine = StaticRolloutEngine(peft_model, eos_token_id=3, pad_token_id=0)
    got = engine.log_probs(batch["prompts"], batch["prompt_mask"], batch["responses"])
    torch.testing.assert_close(masked(got, batch), expect, atol=1e-5, rtol=0)


@pytest.mark.parametrize("lora_spec", [LoraSpec(), RANK4])
def test_gradient_checkpointing_gives_the_same_gradients(tiny_model_dir, lora_spec):
    grads = []
    for checkpointing in (False, True):
        w = worker(tiny_model_dir, lora_spec, checkpointing=checkpointing)
        batch = rollouts(w)
        batch = batch.union(w.compute_ref_log_prob(batch, LOG_PROBS))
        scale = AggScale(tokens=float(batch["response_mask"].sum()), rows=8.0, dp_size=1)
        measures = UPDATE.proximal.measures(batch, None, epochs=1, mini_batch_size=len(batch))
        w._actor_loss(batch, UPDATE, scale, True, measures).loss.backward()
        grads.append({n: p.grad.clone() for n, p in w.actor.module.named_parameters() if p.grad is not None})
        layers = [m for m in w.actor.module.modules() if hasattr(m, "gradient_checkpointing")]
        assert layers and all(m.gradient_checkpointing == checkpointing for m in layers)
    assert grads[0].keys() == grads[1].keys() and grads[0]
    for name in grads[0]:
        torch.testing.assert_close(grads[1][name], grads[0][name], atol=1e-6, rtol=1e-5)


def test_a_lora_critic_trains_its_value_head_fully_and_its_merged_folder_restores_it(tiny_model_dir, tmp_path):
    spec = ModelSpec(str(tiny_model_dir), lora=RANK4)
    critic = load_critic(spec, torch.device("cpu"))
    trainable = {n for n, p in critic.module.named_parameters() if p.requires_grad}
    assert any("score" in n for n in trainable) and any("lora_A" in n for n in trainable)
    assert not any("embed_tokens" in n or n.endswith("q_proj.base_layer.weight") for n in trainable)
    with torch.no_grad():
        for n, p in critic.module.named_parameters():
            if p.requires_grad:
                p.add_(0.1 * torch.randn_like(p))
    from rlcore.engine.model import save_pretrained

    save_pretrained(critic, tmp_path / "critic", rank=0, merge=True)  # as the critic worker saves it
    assert (tmp_path / "critic" / "model.safetensors").is_file() and not lora.is_adapter(tmp_path / "critic")
    ids = torch.randint(7, 50, (2, 9))
    mask = torch.ones_like(ids)
    with torch.no_grad():
        want = critic.response_values(ids, mask, 4)
        got = load_critic(ModelSpec(str(tmp_path / "critic")), torch.device("cpu")).response_values(ids, mask, 4)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)


def test_merged_state_is_peft_merge_and_unloads_and_leaves_the_live_model_as_it_was(tiny_model_dir):
    """What the vllm engine loads: the base weights with the policy adapter merged in, the live tensors untouched."""
    model = lora.add_adapter(load_causal_lm(tiny_model_dir), RANK4, seed=0)
    with torch.no_grad():  # B starts at zero: give the adapter weights that matter
        for name, p in model.named_parameters():
            if ".lora_B." in name:
                p.normal_(0, 0.2, generator=torch.Generator().manual_seed(len(name)))
    live = {k: v.clone() for k, v in model.state_dict().items()}
    got = lora.merged_state(model)
    want = lora.merged_copy(model, model.state_dict()).state_dict()
    assert got.keys() == want.keys()
    assert max(float((got[k] - want[k]).abs().max()) for k in want) < 1e-6
    plain = load_causal_lm(tiny_model_dir)
    assert any(not torch.equal(want[k], v) for k, v in plain.state_dict().items())  # the adapter counts
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in live.items())
    assert lora.merged_state(plain).keys() == plain.state_dict().keys()
