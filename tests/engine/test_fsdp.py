"""FSDP2 across a two-rank Ray worker group equals plain single-process training.

The group runs the real ``ActorRolloutRefWorker`` (roles ``("actor", "ref")``): it shards the
tiny model with ``distributed.shard``, takes two ``train_sft`` steps with each rank holding half
of each batch, and saves; once with the actor resharded after forward and the reference not,
once the other way round. The test replays the same two steps on the unsharded model in this
process with plain ``torch.optim.AdamW`` on the whole batch and a token-mean loss. Response
lengths differ between the halves, so a rank-mean instead of a global token-mean (the
``_micro_weight`` scaling) would give different gradients. The weight sync's
``distributed.full_state_dict`` must equal the unsharded weights, before and after training.
"""

from __future__ import annotations

import pytest
import ray
import torch
import torch.distributed as dist
from safetensors.torch import load_file
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from rlcore.controller import ResourcePool, WorkerGroup
from rlcore.data.collate import encode_prompts, encode_responses
from rlcore.engine import distributed
from rlcore.engine.logprob import response_log_probs
from rlcore.engine.model import load_causal_lm
from rlcore.protocol import Batch
from rlcore.workers.actor import ActorRolloutRefWorker, sequences

LR = 1e-2
WEIGHT_DECAY = 0.01
GRAD_CLIP = 1.0
MICRO = 2  # two micro-batches per rank per step: gradient accumulation is exercised too
QUESTIONS = ["1+1=", "2+3=", "9+9=", "4+4=", "12+7=", "30+3=", "5+50=", "8+80="]
ANSWERS = ["2", "5", "18", "8", "the answer is 19", "33 is it", "it is 55 ok", "88, i think"]


class ProbeWorker(ActorRolloutRefWorker):
    """The real worker plus two probes, called on each rank's handle (both are collectives or local)."""

    def full_state(self) -> dict[str, torch.Tensor]:
        return {k: v.cpu().clone() for k, v in distributed.full_state_dict(self.actor).items()}

    def checkpoint_state(self) -> dict[str, torch.Tensor]:
        return {k: v.cpu().clone() for k, v in distributed.checkpoint_state_dict(self.actor).items()}

    def full_state_cost(self) -> dict[str, int | bool]:
        """Collectives one full_state_dict issues, FSDP groups, and whether the model is sharded again after."""
        group = dist.distributed_c10d._get_default_group()
        before = group._get_sequence_number_for_group()  # counts the collectives issued on the group
        distributed.full_state_dict(self.actor)
        return {"collectives": group._get_sequence_number_for_group() - before,
                "groups": sum(isinstance(m, FSDPModule) for m in self.actor.modules()),
                "resharded": all(isinstance(p, DTensor) for p in self.actor.parameters())}

    def local_numel(self) -> int:
        return sum(p.to_local().numel() for p in self.actor.parameters())

    def sharded_after_forward(self, batch: Batch) -> dict[str, bool]:
        """Whether the actor's and the reference's blocks hold only their shards after a no-grad forward."""
        ids, mask = sequences(batch)
        out = {}
        for name, model in (("actor", self.actor), ("ref", self.ref)):
            with torch.no_grad():
                model(input_ids=ids, attention_mask=mask)
            blocks = [m for m in model.modules() if isinstance(m, FSDPModule) and m is not model]
            out[name] = all(isinstance(p, DTensor) for b in blocks for p in b.parameters())
        return out


def sft_batches(tokenizer) -> list[Batch]:
    prompts, pmask = encode_prompts(tokenizer, [[{"role": "user", "content": q}] for q in QUESTIONS], 12, "test")
    responses, rmask = encode_responses(tokenizer, ANSWERS, 20, "test")
    first = Batch({"prompts": prompts, "prompt_mask": pmask, "responses": responses, "response_mask": rmask},
                  meta={"micro_batch_size": MICRO, "grad_clip": GRAD_CLIP})
    # Step 1: short answers on rank 0, long on rank 1; step 2 mixes them differently.
    second = first.select([5, 0, 6, 4, 1, 2, 3, 7])
    second.meta.update(first.meta)
    return [first, second]


@pytest.fixture(scope="module", params=[(True, False, True), (False, True, False)],
                ids=["actor-reshards-packed", "ref-reshards"])
def sharded_run(request, ray_local, tiny_model_dir, tiny_tokenizer, tmp_path_factory):
    """The group's run with (reshard_after_forward, ref_reshard_after_forward, packed_forward) =
    ``request.param``; the reference training it is compared with is always padded and unsharded."""
    batches = sft_batches(tiny_tokenizer)
    out = tmp_path_factory.mktemp("fsdp") / "saved"
    pool = ResourcePool(2, 1.0, False, 60)
    wg = WorkerGroup(ProbeWorker, pool, name="actor", timeout_s=120, model_path=str(tiny_model_dir),
                     roles=("actor", "ref"), optim={"lr": LR, "weight_decay": WEIGHT_DECAY, "warmup_steps": 0},
                     seed=0, reshard_after_forward=request.param[0], ref_reshard_after_forward=request.param[1],
                     packed_forward=request.param[2])
    try:
        wg.init_model()
        states = ray.get([w.full_state.remote() for w in wg.workers], timeout=120)
        numels = ray.get([w.local_numel.remote() for w in wg.workers], timeout=120)
        # Before training: without resharding, the actor starts its first step with gathered weights.
        layouts = ray.get([w.sharded_after_forward.remote(batches[0]) for w in wg.workers], timeout=120)
        metrics = [wg.train_sft(b).meta["metrics"] for b in batches]
        trained = ray.get([w.full_state.remote() for w in wg.workers], timeout=120)
        costs = ray.get([w.full_state_cost.remote() for w in wg.workers], timeout=120)
        wg.save(str(out))
    finally:
        wg.shutdown()
        pool.release()
    return {"batches": batches, "states": states, "numels": numels, "metrics": metrics, "trained": trained,
            "costs": costs, "saved": load_file(str(out / "model.safetensors")), "saved_dir": out,
            "reshards": request.param[:2], "layouts": layouts}


@pytest.fixture(scope="module")
def bf16_states(ray_local, tiny_model_dir):
    """(full_state_dict, checkpoint_state_dict) of rank 0 of a group that computes in bfloat16."""
    pool = ResourcePool(2, 1.0, False, 60)
    wg = WorkerGroup(ProbeWorker, pool, name="actor", timeout_s=120, model_path=str(tiny_model_dir),
                     roles=("actor",), dtype="bfloat16", optim={"lr": LR, "weight_decay": 0.0, "warmup_steps": 0})
    try:
        wg.init_model()
        full = ray.get([w.full_state.remote() for w in wg.workers], timeout=120)
        checkpoint = ray.get([w.checkpoint_state.remote() for w in wg.workers], timeout=120)
    finally:
        wg.shutdown()
        pool.release()
    return full[0], checkpoint[0]


def reference_training(model_dir, batches: list[Batch]):
    """The same steps, unsharded, whole batch, token-mean NLL, torch AdamW; (model, [(loss, norm)])."""
    model = load_causal_lm(model_dir).train()
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY, betas=(0.9, 0.999))
    stats = []
    for b in batches:
        ids = torch.cat([b["prompts"], b["responses"]], 1)
        mask = torch.cat([b["prompt_mask"], b["response_mask"]], 1)
        lp, _ = response_log_probs(model, ids, mask, b["responses"])
        rmask = b["response_mask"].float()
        loss = -(lp * rmask).sum() / rmask.sum()
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), GRAD_CLIP)
        opt.step()
        opt.zero_grad()
        stats.append((loss.item(), norm.item()))
    return model, stats


def test_halves_have_uneven_token_counts(sharded_run):
    # The premise of the weighting check: per-rank token counts differ a lot.
    for b in sharded_run["batches"]:
        halves = [int(h["response_mask"].sum()) for h in b.chunk(2)]
        assert max(halves) >= 2 * min(halves), halves


def test_parameters_are_really_sharded(sharded_run, tiny_model_dir):
    total = sum(t.numel() for t in load_file(str(tiny_model_dir / "model.safetensors")).values())
    n0, n1 = sharded_run["numels"]
    assert n0 + n1 == total and max(n0, n1) < total


def test_reshard_switches_reach_fsdp(sharded_run):
    actor_reshards, ref_reshards = sharded_run["reshards"]
    assert sharded_run["layouts"] == [{"actor": actor_reshards, "ref": ref_reshards}] * 2


def test_full_state_dict_equals_the_original_weights_on_every_rank(sharded_run, tiny_model_dir):
    original = load_file(str(tiny_model_dir / "model.safetensors"))
    for state in sharded_run["states"]:
        assert set(state) == set(original)
        for k, v in original.items():
            assert torch.equal(state[k], v), k


def test_full_state_dict_after_training_equals_the_saved_weights(sharded_run):
    for state in sharded_run["trained"]:
        assert set(state) == set(sharded_run["saved"])
        for k, v in sharded_run["saved"].items():
            assert torch.equal(state[k], v), k


def test_full_state_dict_gathers_once_per_fsdp_group_and_reshards(sharded_run):
    for cost in sharded_run["costs"]:
        assert cost["groups"] == 2  # the one decoder layer and the root
        assert cost["collectives"] == cost["groups"]  # not one per parameter
        assert cost["resharded"]


def test_under_mixed_precision_the_sync_is_in_the_compute_dtype_and_the_checkpoint_in_float32(
        bf16_states, tiny_model_dir):
    full, checkpoint = bf16_states
    original = load_file(str(tiny_model_dir / "model.safetensors"))
    assert set(full) == set(checkpoint) == set(original)
    for k, v in original.items():
        assert full[k].dtype == torch.bfloat16 and torch.equal(full[k], v.to(torch.bfloat16)), k
        assert checkpoint[k].dtype == torch.float32 and torch.equal(checkpoint[k], v), k


def test_sharded_sft_steps_equal_single_process_steps(sharded_run, tiny_model_dir):
    model, stats = reference_training(tiny_model_dir, sharded_run["batches"])
    for got, (loss, norm) in zip(sharded_run["metrics"], stats):
        assert got["sft/loss"] == pytest.approx(loss, rel=1e-5)
        assert got["sft/grad_norm"] == pytest.approx(norm, rel=1e-4)
        assert got["sft/lr"] == pytest.approx(LR)
    saved, original = sharded_run["saved"], load_file(str(tiny_model_dir / "model.safetensors"))
    expected = model.state_dict()
    assert set(saved) == set(original)
    for k, v in saved.items():
        assert (v - original[k]).abs().max() > LR / 2, f"{k} did not move"
        torch.testing.assert_close(v, expected[k], atol=1e-5, rtol=0, msg=k)


def test_saved_folder_loads_as_a_model_with_its_tokenizer(sharded_run, tiny_tokenizer):
    from rlcore.engine.model import load_tokenizer

    folder = sharded_run["saved_dir"]
    tok = load_tokenizer(folder)
    assert tok.get_vocab() == tiny_tokenizer.get_vocab()
    model = load_causal_lm(folder)
    torch.testing.assert_close(model.lm_head.weight.detach(), sharded_run["saved"]["lm_head.weight"], atol=0, rtol=0)
