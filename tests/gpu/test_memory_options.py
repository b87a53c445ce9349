"""Offload, LoRA, gradient checkpointing and the CUDA RNG in checkpoints, on one CUDA GPU (skipped without one).

In this process, as rank 0 of a one-rank nccl group (as tests/gpu/test_cuda.py does):

* ``resources.offload.params`` (FSDP2's CPUOffloadPolicy): the sharded parameters live on the CPU, and two SFT
  steps equal plain AdamW on the unwrapped model;
* ``resources.offload.optimizer``: the AdamW state is on the CPU between steps, and the steps are the same;
* LoRA in bfloat16: the rollout engine is a copy that takes the adapters only, every sync passes its check;
* a step checkpoint holds the CUDA RNG state and resuming restores it;
* gradient checkpointing lowers the peak of allocated memory of an update.

    python -m pytest tests/gpu -q
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from rlcore.controller import RankPlacement
from rlcore.engine import distributed, lora
from rlcore.engine.lora import LoraSpec
from rlcore.engine.model import ModelSpec
from rlcore.workers.optim import OptimSpec
from rlcore.workers.sft import SFTStepSpec, SFTWorker
from tests.engine.dp_cases import GRAD_CLIP, LR, MICRO, WEIGHT_DECAY, reference_training, sft_batches

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

STEP = SFTStepSpec(micro_batch_size=MICRO, grad_clip=GRAD_CLIP)


@pytest.fixture(scope="module")
def cuda_group(tiny_model_dir):
    """A one-rank group for the module, with gloo for CPU tensors beside nccl (as a worker with offloaded parameters
    starts it: its gathers and norms run on CPU shards)."""
    worker = SFTWorker(RankPlacement(0, 1, torch.get_num_threads()),
                       model=ModelSpec(str(tiny_model_dir), strategy="fsdp", offload_params=True), optim=OptimSpec(lr=LR))
    worker.init_distributed("127.0.0.1", distributed.free_port(), use_gpu=True, timeout_s=60)
    yield worker.device
    dist.destroy_process_group()


def sft_worker(model_dir, *, optim: OptimSpec, **spec) -> SFTWorker:
    worker = SFTWorker(RankPlacement(0, 1, torch.get_num_threads()), model=ModelSpec(str(model_dir), **spec),
                       optim=optim)
    worker.init_distributed("127.0.0.1", distributed.free_port(), use_gpu=True, timeout_s=60)
    worker.init_model()
    return worker


@pytest.mark.parametrize("offload", ["params", "optimizer"])
def test_offloaded_sft_steps_equal_plain_adamw(offload, cuda_group, tiny_model_dir, tiny_tokenizer):
    assert dist.get_backend_config() == "cpu:gloo,cuda:nccl"
    batches = sft_batches(tiny_tokenizer)
    model, _ = reference_training(tiny_model_dir, batches, "cuda")
    params = offload == "params"
    worker = sft_worker(tiny_model_dir, strategy="fsdp" if params else "ddp", offload_params=params,
                        optim=OptimSpec(lr=LR, weight_decay=WEIGHT_DECAY, offload=not params))
    if params:
        assert all(isinstance(p, DTensor) and p.to_local().device.type == "cpu" for p in worker.model.module.parameters())
    for b in batches:
        worker.train_step(b, STEP)
    state = [v for s in worker.opt.state.values() for k, v in s.items() if k != "step"]
    assert state and {v.device.type for v in state} == {"cpu"}  # between steps the moments are in CPU memory
    trained = worker.model.strategy.checkpoint_state_dict(worker.model.module)
    for k, v in model.state_dict().items():
        torch.testing.assert_close(trained[k].cpu(), v.cpu(), atol=1e-4, rtol=0, msg=k)


def test_lora_in_bfloat16_syncs_adapters_only_and_checks_each_sync(cuda_group, tiny_model_dir):
    from rlcore.rollout import EngineSpec, SamplingParams
    from rlcore.workers.actor import ActorRolloutRefWorker
    from rlcore.workers.rollout import GenerateSpec
    from tests.engine.test_lora import UPDATE, rollouts

    worker = ActorRolloutRefWorker(RankPlacement(0, 1, torch.get_num_threads()),
                                   model=ModelSpec(str(tiny_model_dir), dtype="bfloat16", lora=LoraSpec(rank=4, alpha=8.0)),
                                   engine=EngineSpec(), optim=OptimSpec(lr=1e-3), with_ref=True)
    worker.init_distributed("127.0.0.1", distributed.free_port(), use_gpu=True, timeout_s=60)
    worker.init_model()
    assert not worker.engine_shares
    batch = rollouts(worker)
    state = worker._rollout_state()
    assert all(lora.is_adapter_key(k) and v.device.type == "cuda" for k, v in state.items())
    worker.update_actor(batch, UPDATE)
    worker.generate(batch.only("prompts", "prompt_mask"), GenerateSpec(SamplingParams(max_new_tokens=4), 3, 8))
    assert worker.syncs == 2  # each checked (a failure raises)


def test_a_step_checkpoint_restores_the_cuda_rng(cuda_group, tiny_model_dir, tmp_path):
    worker = sft_worker(tiny_model_dir, optim=OptimSpec(lr=LR))
    torch.cuda.manual_seed(123)
    saved = torch.cuda.get_rng_state()
    worker.save_state(str(tmp_path))
    torch.rand(1000, device="cuda")  # moves the generator on
    assert not torch.equal(torch.cuda.get_rng_state(), saved)
    worker.load_state(str(tmp_path))
    assert torch.equal(torch.cuda.get_rng_state(), saved)


def test_gradient_checkpointing_lowers_the_peak_of_an_update(cuda_group, tiny_model_dir, tiny_tokenizer):
    batch = sft_batches(tiny_tokenizer)[0].repeat(64)  # 512 rows: activations dominate the tiny model
    peaks = []
    for checkpointing in (False, True):
        worker = sft_worker(tiny_model_dir, optim=OptimSpec(lr=LR), gradient_checkpointing=checkpointing)
        worker.train_step(batch, SFTStepSpec(micro_batch_size=512, grad_clip=GRAD_CLIP))  # optimizer state exists
        torch.cuda.reset_peak_memory_stats()
        worker.train_step(batch, SFTStepSpec(micro_batch_size=512, grad_clip=GRAD_CLIP))
        peaks.append(torch.cuda.max_memory_allocated())
        del worker
        torch.cuda.empty_cache()
    assert peaks[1] < peaks[0]
