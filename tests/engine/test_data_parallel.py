"""Data-parallel training across a two-rank Ray worker group equals plain single-process training.

The group runs the real ``SFTWorker`` (plus a frozen reference for the reshard checks), its models
wrapped by each training strategy (``rlcore.engine.strategy``): FSDP2 with the trained model
resharded after forward and the reference not, FSDP2 the other way round, and DDP (a full replica
per rank). It takes two ``train_step`` steps with each rank holding half of each batch, and saves.
The test replays the same two steps on the unsharded model in this process with plain
``torch.optim.AdamW`` on the whole batch and a token-mean loss. Response lengths differ between
the halves, so a rank-mean instead of a global token-mean would give different gradients. The
weight sync's ``rollout_state_dict`` must equal the unsharded weights, before and after training.
Then one step whose gradient is NaN on rank 1 only must be skipped on both ranks, and the finite step
after it must equal a third plain step.
"""

from __future__ import annotations

import math

import pytest
import ray
import torch
import torch.distributed as dist
from safetensors.torch import load_file
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from rlcore.controller.resource_pool import ResourcePool
from rlcore.controller.worker_group import WorkerGroup
from rlcore.engine.lora import LoraSpec, reference_weights
from rlcore.engine.model import ModelSpec, load_causal_lm, load_policy
from rlcore.engine.sequence import sequences
from rlcore.protocol import Batch
from rlcore.workers.optim import OptimSpec
from rlcore.workers.sft import SFTStepSpec, SFTWorker
from tests.engine.dp_cases import GRAD_CLIP, LR, MICRO, WEIGHT_DECAY, reference_training, sft_batches

STEP = SFTStepSpec(micro_batch_size=MICRO, grad_clip=GRAD_CLIP)


class ProbeWorker(SFTWorker):
    """The real SFT worker with a frozen reference beside it, and probes called on each rank's handle
    (each a collective or local)."""

    def init_model(self) -> None:
        super().init_model()
        self.ref = load_policy(self.model_spec, self.device, frozen=True)

    def reconfigure(self, model: ModelSpec, optim: OptimSpec) -> None:
        """This rank as a new ProbeWorker of ``model`` and ``optim`` would be after ``init_model`` (the models,
        optimizer and random state replaced; the process and its process group kept: starting worker processes is
        what costs time here)."""
        for name in ("model", "ref", "opt", "sched", "tokenizer"):
            self.__dict__.pop(name, None)
        self.model_spec, self.optim_spec = model, optim
        torch.manual_seed(self.seed + self.rank)
        self.init_model()

    def full_state(self) -> dict[str, torch.Tensor]:
        return {k: v.cpu().clone() for k, v in self.model.strategy.rollout_state_dict(self.model.module).items()}

    def checkpoint_state(self) -> dict[str, torch.Tensor]:
        state = self.model.strategy.checkpoint_state_dict(self.model.module)
        return {k: v.cpu().clone() for k, v in state.items()}

    def full_state_cost(self) -> dict[str, int | bool]:
        """Collectives one rollout_state_dict issues, FSDP groups, and whether the model is sharded again after."""
        module = self.model.module
        before = collectives_issued()
        self.model.strategy.rollout_state_dict(module)
        return {"collectives": collectives_issued() - before,
                "groups": sum(isinstance(m, FSDPModule) for m in module.modules()),
                "resharded": all(isinstance(p, DTensor) for p in module.parameters())}

    def gradient_reduce_cost(self, batch: Batch) -> int:
        """Collectives ``reduce_gradients`` issues after a backward (the gradients are then dropped)."""
        ids, mask = sequences(batch)
        lp, _ = self.model.response_log_probs(ids, mask, batch["responses"])
        (lp * batch["response_mask"]).sum().backward()
        before = collectives_issued()
        self.model.strategy.reduce_gradients(self.model.module)
        self.model.module.zero_grad(set_to_none=True)
        return collectives_issued() - before

    def train_step_with_nan_gradient_on(self, batch: Batch, spec: SFTStepSpec, rank: int) -> dict[str, float]:
        """``train_step`` with the gradient flowing back into the token embeddings made NaN on rank ``rank``
        only (the loss stays finite; the other rank's own gradients are finite until they are reduced)."""
        def poison(module, inputs, out):
            out.register_hook(lambda grad: torch.full_like(grad, float("nan")))

        hook = self.model.module.get_input_embeddings().register_forward_hook(poison) if self.rank == rank else None
        try:
            return self.train_step(batch, spec)
        finally:
            if hook is not None:
                hook.remove()

    def logits_dtype(self, batch: Batch) -> str:
        ids, mask = sequences(batch)
        with torch.no_grad(), self.model.strategy.autocast():
            return str(self.model.module(input_ids=ids, attention_mask=mask).logits.dtype)

    def lora_reference_then_step(self, batch: Batch) -> dict[str, object]:
        """A LoRA policy's reference forward (``reference_weights``: the adapter disabled) with the blocks sharded, then
        with them gathered by a no-grad forward, each followed by a train step: per layout the reference's and the
        plain base's log-probs, the names that train after the step, and whether the step moved the adapter."""
        module, base = self.model.module, self.ref
        trains = lambda: sorted(n for n, p in module.named_parameters() if p.requires_grad)  # noqa: E731
        adapter = lambda: self.model.strategy.trainable_state_dict(module, compute_dtype=False)  # noqa: E731
        ids, mask = sequences(batch)
        self.train_step(batch, STEP)  # the adapter away from its zero start, so disabling it changes the forward
        out: dict[str, object] = {"trainable": trains(), "sharded_after_step": all(
            isinstance(p, DTensor) for p in module.parameters())}
        for layout in ("sharded", "gathered"):
            with torch.no_grad():
                if layout == "gathered":  # the blocks keep their gathered weights after a forward
                    self.model.response_log_probs(ids, mask, batch["responses"])
                with reference_weights(module):
                    ref, _ = self.model.response_log_probs(ids, mask, batch["responses"])
                policy, _ = self.model.response_log_probs(ids, mask, batch["responses"])
                plain, _ = base.response_log_probs(ids, mask, batch["responses"])
            start = {k: v.clone() for k, v in adapter().items()}
            self.train_step(batch, STEP)
            moved = sorted(k for k, v in adapter().items() if k in start and not torch.equal(v, start[k]))
            out[layout] = {"ref": ref, "base": plain, "policy": policy, "trainable": trains(), "moved": moved}
        return out

    def local_numel(self) -> int:
        return sum((p.to_local() if isinstance(p, DTensor) else p).numel() for p in self.model.module.parameters())

    def sharded_after_forward(self, batch: Batch) -> dict[str, bool]:
        """Whether the trained model's and the reference's blocks hold only their shards after a no-grad forward."""
        ids, mask = sequences(batch)
        out = {}
        for name, model in (("actor", self.model.module), ("ref", self.ref.module)):
            with torch.no_grad():
                model(input_ids=ids, attention_mask=mask)
            blocks = [m for m in model.modules() if isinstance(m, FSDPModule) and m is not model]
            out[name] = all(isinstance(p, DTensor) for b in blocks for p in b.parameters())
        return out


def collectives_issued() -> int:
    """Collectives issued so far on the default process group (its sequence number)."""
    return dist.distributed_c10d._get_default_group()._get_sequence_number_for_group()





# (strategy, reshard_after_forward, ref_reshard_after_forward, packed_forward)
RUNS = {"fsdp-actor-reshards-packed": ("fsdp", True, False, True), "fsdp-ref-reshards": ("fsdp", False, True, False),
        "ddp-packed": ("ddp", False, False, True)}


@pytest.fixture(scope="module")
def probe_group(ray_local, tiny_model_dir):
    """One two-rank group of ProbeWorkers for every run of this file, each run reconfiguring it
    (:meth:`ProbeWorker.reconfigure`)."""
    pool = ResourcePool(2, 1.0, False, 60)
    wg = WorkerGroup(ProbeWorker, pool, name="sft", timeout_s=120, model=ModelSpec(str(tiny_model_dir)),
                     optim=OptimSpec(lr=LR), seed=0)
    try:
        yield wg
    finally:
        wg.shutdown()
        pool.release()


@pytest.fixture(scope="module", params=sorted(RUNS))
def dp_run(request, probe_group, tiny_model_dir, tiny_tokenizer, tmp_path_factory):
    """The group's run with (strategy, reshard_after_forward, ref_reshard_after_forward, packed_forward) =
    ``RUNS[request.param]``; the reference training it is compared with is always padded and unsharded."""
    strategy, reshard, ref_reshard, packed = RUNS[request.param]
    batches = sft_batches(tiny_tokenizer)
    out = tmp_path_factory.mktemp("dp") / "saved"
    spec = ModelSpec(str(tiny_model_dir), strategy=strategy, reshard_after_forward=reshard,
                     ref_reshard_after_forward=ref_reshard, packed_forward=packed)
    wg = probe_group
    ray.get([w.reconfigure.remote(spec, OptimSpec(lr=LR, weight_decay=WEIGHT_DECAY)) for w in wg.workers],
            timeout=120)
    states = ray.get([w.full_state.remote() for w in wg.workers], timeout=120)
    numels = ray.get([w.local_numel.remote() for w in wg.workers], timeout=120)
    # Before training: without resharding, the actor starts its first step with gathered weights.
    layouts = ray.get([w.sharded_after_forward.remote(batches[0]) for w in wg.workers], timeout=120)
    halves = batches[0].chunk(2)
    reduce_costs = ray.get([w.gradient_reduce_cost.remote(h) for w, h in zip(wg.workers, halves)], timeout=120)
    metrics = [wg.call(SFTWorker.train_step, b, STEP) for b in batches]
    trained = ray.get([w.full_state.remote() for w in wg.workers], timeout=120)
    costs = ray.get([w.full_state_cost.remote() for w in wg.workers], timeout=120)
    wg.call(SFTWorker.save, str(out))
    # then a step whose gradient is NaN on rank 1 only (every rank must skip it), then a finite one
    skipped = ray.get([w.train_step_with_nan_gradient_on.remote(h, STEP, 1)
                       for w, h in zip(wg.workers, batches[1].chunk(2))], timeout=120)
    after_skip = ray.get([w.full_state.remote() for w in wg.workers], timeout=120)
    metrics.append(wg.call(SFTWorker.train_step, batches[0], STEP))
    after_finite = ray.get([w.full_state.remote() for w in wg.workers], timeout=120)
    return {"batches": batches, "states": states, "numels": numels, "metrics": metrics[:2], "trained": trained,
            "skipped": skipped, "after_skip": after_skip, "after_finite": (metrics[2], after_finite),
            "costs": costs, "saved": load_file(str(out / "model.safetensors")), "saved_dir": out,
            "strategy": strategy, "reshards": (reshard, ref_reshard), "layouts": layouts, "reduce_costs": reduce_costs}


@pytest.fixture(scope="module", params=["fsdp", "ddp"])
def bf16_states(request, probe_group, tiny_model_dir, tiny_tokenizer):
    """(rollout_state_dict, checkpoint_state_dict, dtype of the forward's logits) of rank 0 of a group
    that computes in bfloat16 with strategy ``request.param``."""
    wg = probe_group
    spec = ModelSpec(str(tiny_model_dir), dtype="bfloat16", strategy=request.param)
    ray.get([w.reconfigure.remote(spec, OptimSpec(lr=LR)) for w in wg.workers], timeout=120)
    full = ray.get([w.full_state.remote() for w in wg.workers], timeout=120)
    checkpoint = ray.get([w.checkpoint_state.remote() for w in wg.workers], timeout=120)
    batch = sft_batches(tiny_tokenizer)[0]  # every rank runs the forward: under FSDP it is a collective
    logits = ray.get([w.logits_dtype.remote(batch) for w in wg.workers], timeout=120)[0]
    return full[0], checkpoint[0], logits





def test_halves_have_uneven_token_counts(dp_run):
    # The premise of the weighting check: per-rank token counts differ a lot.
    for b in dp_run["batches"]:
        halves = [int(h["response_mask"].sum()) for h in b.chunk(2)]
        assert max(halves) >= 2 * min(halves), halves


def test_fsdp_shards_the_parameters_and_ddp_replicates_them(dp_run, tiny_model_dir):
    total = sum(t.numel() for t in load_file(str(tiny_model_dir / "model.safetensors")).values())
    n0, n1 = dp_run["numels"]
    if dp_run["strategy"] == "fsdp":
        assert n0 + n1 == total and max(n0, n1) < total
    else:
        assert n0 == n1 == total


def test_reshard_switches_reach_fsdp(dp_run):
    actor_reshards, ref_reshards = dp_run["reshards"]
    if dp_run["strategy"] == "fsdp":
        assert dp_run["layouts"] == [{"actor": actor_reshards, "ref": ref_reshards}] * 2
    else:  # no FSDP block at all: nothing to gather or free
        assert dp_run["costs"][0]["groups"] == 0


def test_gradients_are_reduced_in_one_collective_under_ddp_and_by_backward_under_fsdp(dp_run):
    assert dp_run["reduce_costs"] == ([1, 1] if dp_run["strategy"] == "ddp" else [0, 0])


def test_rollout_state_dict_equals_the_original_weights_on_every_rank(dp_run, tiny_model_dir):
    original = load_file(str(tiny_model_dir / "model.safetensors"))
    for state in dp_run["states"]:
        assert set(state) == set(original)
        for k, v in original.items():
            assert torch.equal(state[k], v), k


def test_rollout_state_dict_after_training_equals_the_saved_weights(dp_run):
    for state in dp_run["trained"]:
        assert set(state) == set(dp_run["saved"])
        for k, v in dp_run["saved"].items():
            assert torch.equal(state[k], v), k


def test_rollout_state_dict_gathers_once_per_fsdp_group_and_ddp_not_at_all(dp_run):
    for cost in dp_run["costs"]:
        if dp_run["strategy"] == "fsdp":
            assert cost["groups"] == 2  # the one decoder layer and the root
            assert cost["collectives"] == cost["groups"]  # not one per parameter
            assert cost["resharded"]
        else:
            assert cost["collectives"] == 0


def test_under_mixed_precision_the_sync_is_in_the_compute_dtype_and_the_checkpoint_in_float32(
        bf16_states, tiny_model_dir):
    full, checkpoint, logits_dtype = bf16_states
    assert logits_dtype == "torch.bfloat16"  # the forward really computes in bfloat16
    original = load_file(str(tiny_model_dir / "model.safetensors"))
    assert set(full) == set(checkpoint) == set(original)
    for k, v in original.items():
        assert full[k].dtype == torch.bfloat16 and torch.equal(full[k], v.to(torch.bfloat16)), k
        assert checkpoint[k].dtype == torch.float32 and torch.equal(checkpoint[k], v), k


def test_sharded_sft_steps_equal_single_process_steps(dp_run, tiny_model_dir):
    model, stats = reference_training(tiny_model_dir, dp_run["batches"])
    for got, (loss, norm) in zip(dp_run["metrics"], stats):
        assert got["sft/loss"] == pytest.approx(loss, rel=1e-5)
        assert got["sft/grad_norm"] == pytest.approx(norm, rel=1e-4)
        assert got["sft/lr"] == pytest.approx(LR)
    saved, original = dp_run["saved"], load_file(str(tiny_model_dir / "model.safetensors"))
    expected = model.state_dict()
    assert set(saved) == set(original)
    for k, v in saved.items():
        assert (v - original[k]).abs().max() > LR / 2, f"{k} did not move"
        torch.testing.assert_close(v, expected[k], atol=1e-5, rtol=0, msg=k)


def test_saved_folder_loads_as_a_model_with_its_tokenizer(dp_run, tiny_tokenizer):
    from rlcore.engine.model import load_tokenizer

    folder = dp_run["saved_dir"]
    tok = load_tokenizer(folder)
    assert tok.get_vocab() == tiny_tokenizer.get_vocab()
    model = load_causal_lm(folder)
    torch.testing.assert_close(model.lm_head.weight.detach(), dp_run["saved"]["lm_head.weight"], atol=0, rtol=0)


@pytest.fixture(scope="module")
def three_plain_steps(tiny_model_dir, tiny_tokenizer):
    """The two steps of every run and the first batch again, in one plain process."""
    batches = sft_batches(tiny_tokenizer)
    return reference_training(tiny_model_dir, batches + batches[:1])


def test_a_nan_gradient_on_one_rank_skips_the_step_on_every_rank_and_the_next_step_trains_as_if_it_never_ran(
        dp_run, three_plain_steps):
    """The NaN reaches every rank through the gradient reduction (ddp: the all-reduce; fsdp: the
    reduce-scatter into one rank's shard, then the norm over all shards): both ranks skip, their weights
    stay as they were, and the finite step after it equals a third plain AdamW step."""
    for m in dp_run["skipped"]:
        assert m["sft/nonfinite_steps"] == 1.0 and math.isnan(m["sft/grad_norm"]) and math.isfinite(m["sft/loss"])
    for state in dp_run["after_skip"]:
        for k, v in dp_run["trained"][0].items():
            assert torch.equal(state[k], v), k
    got, states = dp_run["after_finite"]
    model, stats = three_plain_steps
    assert got["sft/nonfinite_steps"] == 0.0
    assert got["sft/loss"] == pytest.approx(stats[2][0], rel=1e-5)
    assert got["sft/grad_norm"] == pytest.approx(stats[2][1], rel=1e-4)
    expected = model.state_dict()
    for state in states:
        for k, v in state.items():
            torch.testing.assert_close(v, expected[k], atol=1e-5, rtol=0, msg=k)


def test_a_lora_reference_forward_under_fsdp_leaves_the_adapter_training_whichever_layout_it_finds(
        probe_group, tiny_model_dir, tiny_tokenizer):
    """peft disables an adapter by clearing requires_grad on the parameters registered at that moment; under FSDP2
    those are the shards, or the gathered copies after a forward that kept them. A reference forward that found the
    shards and was undone on the gathered copies froze the shards: the optimizer stopped moving the adapter and a
    save wrote an empty adapter. In both layouts the reference must be the base model, and the step after it must
    train every adapter tensor it trained before."""
    wg = probe_group
    spec = ModelSpec(str(tiny_model_dir), strategy="fsdp", lora=LoraSpec(rank=4, alpha=8.0, seed=3))
    ray.get([w.reconfigure.remote(spec, OptimSpec(lr=LR)) for w in wg.workers], timeout=120)
    batch = sft_batches(tiny_tokenizer)[0]
    runs = ray.get([w.lora_reference_then_step.remote(h) for w, h in zip(wg.workers, batch.chunk(2))], timeout=120)
    for rank, run in enumerate(runs):
        assert run["sharded_after_step"]  # the premise of the first layout
        adapters = run["trainable"]
        assert adapters and all(".lora_A." in n or ".lora_B." in n for n in adapters), adapters
        for layout in ("sharded", "gathered"):
            got = run[layout]
            torch.testing.assert_close(got["ref"], got["base"], atol=1e-6, rtol=0, msg=f"rank {rank} {layout}")
            assert (got["ref"] - got["policy"]).abs().max() > 1e-4, f"rank {rank} {layout}: the adapter was not off"
            assert got["trainable"] == adapters, f"rank {rank} {layout}"
            # the B matrices move at every step; a frozen shard would move nothing
            assert [n for n in got["moved"] if ".lora_B." in n] == [n for n in adapters if ".lora_B." in n], layout
