"""The actor / rollout / reference worker on one CUDA GPU, against plain single-model computations.

What runs where (every test is skipped on a machine without CUDA):

* in this process, no Ray: the ``SFTWorker`` and the ``ActorRolloutRefWorker`` as rank 0 of a one-rank
  nccl group. A process initialises its default group once, so one group serves the module and every
  worker is built on it, for both ``resources.strategy`` values (``ddp``, ``fsdp``). Each is compared
  with the unwrapped model on the GPU: two float32 SFT steps with plain ``torch.optim.AdamW``; the same
  steps in bfloat16 (the forward, the weight sync and the checkpoint dtypes); greedy generation
  with a full padded forward per token; reference log-probs of the packed forward with the padded one.
* in a Ray actor (skipped where Ray is not installed): the same worker through ``WorkerGroup`` on a
  one-GPU ``ResourcePool``, FSDP2 in bfloat16.

Float32 matmuls run at "highest" precision here (no TF32), so float32 results agree to ~1e-5.

Run on a GPU machine::

    python -m pytest tests/gpu -q
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist
from safetensors.torch import load_file
from torch.distributed.fsdp import FSDPModule

from rlcore.controller import RankPlacement
from rlcore.engine import distributed, packed
from rlcore.engine.model import ModelSpec, load_causal_lm
from rlcore.engine.sequence import local_model, sequences
from rlcore.protocol import Batch
from rlcore.rollout import EngineSpec, SamplingParams
from rlcore.workers.actor import ActorRolloutRefWorker, LogProbSpec
from rlcore.workers.optim import OptimSpec
from rlcore.workers.rollout import GenerateSpec
from rlcore.workers.sft import SFTStepSpec, SFTWorker
from tests.engine.dp_cases import GRAD_CLIP, LR, MICRO, WEIGHT_DECAY, reference_training, sft_batches

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

STRATEGIES = ["ddp", "fsdp"]
OPTIM = OptimSpec(lr=LR, weight_decay=WEIGHT_DECAY)
STEP = SFTStepSpec(micro_batch_size=MICRO, grad_clip=GRAD_CLIP)
BF16_REL = 2e-2  # bfloat16 forward against the float32 reference
MAX_NEW_TOKENS = 16


class ProbeWorker(SFTWorker):
    """The real SFT worker plus a probe of where its rank runs (called on the Ray actor's handle)."""

    def placement(self) -> dict[str, str]:
        return {"device": self.device.type, "backend": str(dist.get_backend()),
                "weights": next(self.model.module.parameters()).device.type}


@torch.no_grad()
def greedy_decode(model, prompts: torch.Tensor, prompt_mask: torch.Tensor, *, eos: int, pad: int
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """Greedy responses by one full padded forward per new token (no cache, no packing).

    Args:
        prompts: ``[rows, prompt_len]`` left-padded ids; ``prompt_mask`` marks real tokens.
    Returns:
        responses ``[rows, MAX_NEW_TOKENS]`` (pad after EOS) and their mask (1 up to and including EOS).
    """
    ids, mask = prompts, prompt_mask
    responses = torch.full((len(ids), MAX_NEW_TOKENS), pad, dtype=torch.long, device=ids.device)
    response_mask = torch.zeros_like(responses)
    alive = torch.ones(len(ids), dtype=torch.bool, device=ids.device)
    for t in range(MAX_NEW_TOKENS):
        positions = (mask.cumsum(-1) - 1).clamp(min=0)  # left padding takes no positions
        next_token = model(input_ids=ids, attention_mask=mask, position_ids=positions).logits[:, -1].argmax(-1)
        responses[:, t] = torch.where(alive, next_token, pad)
        response_mask[:, t] = alive.long()
        alive &= next_token != eos
        ids = torch.cat([ids, next_token[:, None]], 1)
        mask = torch.cat([mask, torch.ones_like(mask[:, :1])], 1)
    return responses, response_mask


def plain_log_probs(model, batch: Batch) -> torch.Tensor:
    """Log-probs ``[rows, response_len]`` of the batch's responses under a plain padded forward, on the CPU."""
    ids = torch.cat([batch["prompts"], batch["responses"]], 1).to("cuda")
    mask = torch.cat([batch["prompt_mask"], batch["response_mask"]], 1).to("cuda")
    with torch.no_grad():
        lp, _ = local_model(model).response_log_probs(ids, mask, batch["responses"].to("cuda"))
    return lp.cpu()


def cpu_copy(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A copy on the CPU (a replicated model's state dict holds views of its live weights)."""
    return {k: v.detach().to("cpu", copy=True) for k, v in state.items()}


def start_worker(model_dir, *, strategy: str, dtype: str = "float32", ppo: bool = False):
    """An SFT worker (or, with ``ppo``, an actor/rollout/ref worker) on this module's group
    (``init_distributed`` finds the group up and only picks the device) with its models loaded.
    Packed forwards, as ``model.packed_forward`` defaults to."""
    spec = ModelSpec(str(model_dir), dtype=dtype, strategy=strategy, packed_forward=True)
    placement = RankPlacement(0, 1, torch.get_num_threads())
    if ppo:
        worker = ActorRolloutRefWorker(placement, model=spec, engine=EngineSpec("static"), optim=OPTIM, with_ref=True)
    else:
        worker = SFTWorker(placement, model=spec, optim=OPTIM)
    worker.init_distributed("127.0.0.1", distributed.free_port(), use_gpu=True, timeout_s=60)
    worker.init_model()
    return worker


@pytest.fixture(scope="module")
def cuda_group(tiny_model_dir):
    """The device a worker gets as rank 0 of a one-rank group in this process; the group is torn
    down after the module (other modules' in-process workers expect no group)."""
    worker = SFTWorker(RankPlacement(0, 1, torch.get_num_threads()), model=ModelSpec(str(tiny_model_dir)),
                       optim=OPTIM)
    worker.init_distributed("127.0.0.1", distributed.free_port(), use_gpu=True, timeout_s=60)
    yield worker.device
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def original(tiny_model_dir) -> dict[str, torch.Tensor]:
    """The float32 weights on disk."""
    return load_file(str(tiny_model_dir / "model.safetensors"))


@pytest.fixture(scope="module")
def reference(tiny_model_dir, tiny_tokenizer) -> dict:
    """The two SFT batches and the plain training on them: trained float32 weights (CPU) and (loss, norm) per step."""
    batches = sft_batches(tiny_tokenizer)
    model, stats = reference_training(tiny_model_dir, batches, "cuda")
    return {"batches": batches, "state": cpu_copy(model.state_dict()), "stats": stats}


@pytest.fixture(scope="module")
def plain_model(tiny_model_dir):
    """The unwrapped float32 model on the GPU, padded forwards (no packing)."""
    model = load_causal_lm(tiny_model_dir).to("cuda").eval()
    assert not packed.uses_packing(model)
    return model


def test_the_worker_joins_an_nccl_group_on_a_cuda_device(cuda_group):
    assert cuda_group.type == "cuda" and cuda_group.index == torch.cuda.current_device()
    assert dist.get_backend() == "nccl"
    assert (dist.get_rank(), dist.get_world_size()) == (0, 1)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_float32_sft_steps_equal_plain_adamw_on_the_unwrapped_model(strategy, cuda_group, reference, original,
                                                                   tiny_model_dir):
    worker = start_worker(tiny_model_dir, strategy=strategy)
    assert isinstance(worker.model.module, FSDPModule) == (strategy == "fsdp")
    assert next(worker.model.module.parameters()).device == cuda_group
    metrics = [worker.train_step(b, STEP) for b in reference["batches"]]
    for got, (loss, norm) in zip(metrics, reference["stats"]):
        assert got["sft/loss"] == pytest.approx(loss, rel=1e-5)
        assert got["sft/grad_norm"] == pytest.approx(norm, rel=1e-4)
        assert got["sft/lr"] == pytest.approx(LR)
    trained = worker.model.strategy.checkpoint_state_dict(worker.model.module)
    assert set(trained) == set(original)
    for k, v in reference["state"].items():
        assert trained[k].device.type == "cuda" and trained[k].dtype == torch.float32, k
        assert (trained[k].cpu() - original[k]).abs().max() > LR / 2, f"{k} did not move"
        # Adam steps of ~LR per element: a missed, doubled or mis-scaled step is far outside 1e-4
        torch.testing.assert_close(trained[k].cpu(), v, atol=1e-4, rtol=0, msg=k)


@pytest.fixture(scope="module", params=STRATEGIES)
def bf16_run(request, cuda_group, reference, tiny_model_dir, tmp_path_factory) -> dict:
    """A bfloat16 worker of strategy ``request.param``: its weight sync and checkpoint states (copied
    to the CPU, with their devices) and its logits dtype before training, then the reference's two SFT
    steps' metrics, its float32 weights after them and the folder it saved."""
    worker = start_worker(tiny_model_dir, strategy=request.param, dtype="bfloat16")
    model = worker.model
    full = model.strategy.rollout_state_dict(model.module)
    checkpoint = model.strategy.checkpoint_state_dict(model.module)
    run = {"full": cpu_copy(full), "checkpoint": cpu_copy(checkpoint),
           "devices": {v.device.type for v in [*full.values(), *checkpoint.values()]}}
    ids, mask = sequences(reference["batches"][0])
    with torch.no_grad(), model.strategy.autocast():
        logits = model.module(input_ids=ids.to(cuda_group), attention_mask=mask.to(cuda_group)).logits
    run["logits_dtype"] = logits.dtype
    run["metrics"] = [worker.train_step(b, STEP) for b in reference["batches"]]
    run["trained"] = cpu_copy(model.strategy.checkpoint_state_dict(model.module))
    run["saved"] = worker.save(str(tmp_path_factory.mktemp("bf16") / "saved"))
    return run


def test_bfloat16_computes_and_syncs_in_bfloat16_and_checkpoints_float32(bf16_run, original):
    assert bf16_run["logits_dtype"] == torch.bfloat16  # the forward really computes in bfloat16
    assert bf16_run["devices"] == {"cuda"}
    full, checkpoint = bf16_run["full"], bf16_run["checkpoint"]
    assert set(full) == set(checkpoint) == set(original)
    for k, v in original.items():
        assert full[k].dtype == torch.bfloat16 and torch.equal(full[k], v.to(torch.bfloat16)), k
        assert checkpoint[k].dtype == torch.float32 and torch.equal(checkpoint[k], v), k


def test_bfloat16_sft_steps_track_the_float32_reference(bf16_run, reference):
    (loss0, norm0), (loss1, _) = reference["stats"]
    # the premise: the first step lowers the loss by far more than the tolerance, so a step not taken fails
    assert loss1 < loss0 * (1 - 3 * BF16_REL)
    for got, (loss, norm) in zip(bf16_run["metrics"], reference["stats"]):
        assert got["sft/loss"] == pytest.approx(loss, rel=BF16_REL)
        assert got["sft/grad_norm"] == pytest.approx(norm, rel=5e-2)


def test_bfloat16_checkpoint_loads_back_as_the_moved_float32_weights(bf16_run, original):
    model = load_causal_lm(bf16_run["saved"])
    saved = model.state_dict()
    assert set(saved) == set(original)
    for k, v in original.items():
        assert saved[k].dtype == torch.float32 and torch.equal(saved[k], bf16_run["trained"][k]), k
        assert (saved[k] - v).abs().max() > LR / 2, f"{k} did not move"


@pytest.fixture(scope="module", params=STRATEGIES)
def rollout_run(request, cuda_group, reference, tiny_model_dir, tiny_tokenizer) -> dict:
    """A float32 worker with roles actor, rollout and ref: greedy responses to the SFT prompts, each
    prompt twice (``[16, 12]`` -> ``[16, MAX_NEW_TOKENS]``), then reference log-probs in micro-batches of 8,
    with the input shape of every reference forward."""
    worker = start_worker(tiny_model_dir, strategy=request.param, ppo=True)
    first = reference["batches"][0]
    prompts = Batch({"prompts": first["prompts"], "prompt_mask": first["prompt_mask"]}).repeat(2)
    spec = GenerateSpec(SamplingParams(max_new_tokens=MAX_NEW_TOKENS, greedy=True), seed=0, micro_batch_size=8)
    batch = prompts.union(worker.generate(prompts, spec))
    shapes = []
    hook = worker.ref.module.get_input_embeddings().register_forward_hook(
        lambda module, args, out: shapes.append(tuple(args[0].shape)))
    try:
        ref = worker.compute_ref_log_prob(batch, LogProbSpec(micro_batch_size=8))
    finally:
        hook.remove()
    return {"batch": batch, "ref_log_probs": ref["ref_log_probs"], "shapes": shapes,
            "packing": packed.uses_packing(worker.ref.module)}


def test_greedy_generation_equals_a_plain_padded_greedy_decode(rollout_run, plain_model, tiny_tokenizer):
    batch = rollout_run["batch"]
    expected, expected_mask = greedy_decode(plain_model, batch["prompts"].to("cuda"), batch["prompt_mask"].to("cuda"),
                                            eos=tiny_tokenizer.eos_token_id, pad=tiny_tokenizer.pad_token_id)
    assert batch["responses"].shape == (16, MAX_NEW_TOKENS)
    assert torch.equal(batch["responses"], expected.cpu())
    assert torch.equal(batch["response_mask"], expected_mask.cpu())


def test_sampled_log_probs_equal_a_plain_forward(rollout_run, plain_model):
    batch = rollout_run["batch"]
    real = batch["response_mask"].bool()
    expected = plain_log_probs(plain_model, batch)
    torch.testing.assert_close(batch["rollout_log_probs"][real], expected[real], atol=1e-4, rtol=1e-4)


def test_packed_reference_log_probs_equal_a_plain_forward(rollout_run, plain_model):
    batch = rollout_run["batch"]
    # the reference forwards really were packed: one sequence of real tokens per micro-batch
    assert rollout_run["packing"]
    layouts = [packed.pack(*sequences(part), MAX_NEW_TOKENS) for part in batch.split(8)]
    assert rollout_run["shapes"] == [(1, layout.n_tokens) for layout in layouts]
    real = batch["response_mask"].bool()
    expected = plain_log_probs(plain_model, batch)
    torch.testing.assert_close(rollout_run["ref_log_probs"][real], expected[real], atol=1e-4, rtol=1e-4)


def test_a_ray_worker_group_trains_fsdp_bfloat16_on_the_gpu_over_nccl(request, reference, tiny_model_dir):
    pytest.importorskip("ray")
    ray = request.getfixturevalue("ray_local")  # started without num_gpus: Ray counts the node's GPUs itself
    from rlcore.controller.resource_pool import ResourcePool
    from rlcore.controller.worker_group import WorkerGroup

    assert ray.cluster_resources().get("GPU", 0) >= 1, f"Ray sees no GPU: {ray.cluster_resources()}"
    pool = ResourcePool(1, 1.0, use_gpu=True, timeout_s=60)
    wg = WorkerGroup(ProbeWorker, pool, name="sft", timeout_s=180,
                     model=ModelSpec(str(tiny_model_dir), dtype="bfloat16", strategy="fsdp"), optim=OPTIM)
    try:
        wg.call(SFTWorker.init_model)
        placement = ray.get(wg.workers[0].placement.remote(), timeout=60)
        metrics = wg.call(SFTWorker.train_step, reference["batches"][0], STEP)
    finally:
        wg.shutdown()
        pool.release()
    assert placement == {"device": "cuda", "backend": "nccl", "weights": "cuda"}
    assert math.isfinite(metrics["sft/loss"])
    assert metrics["sft/loss"] == pytest.approx(reference["stats"][0][0], rel=BF16_REL)
