"""LoRA across a two-rank FSDP2 group equals plain single-process peft training.

The real ``SFTWorker`` with ``lora`` on and gradient checkpointing, FSDP2-sharded over two Ray ranks (frozen base
weights and trainable adapters in the same FSDP groups), takes two steps with each rank holding half of each batch,
then saves. The test replays the steps on a peft model in this process (the same adapter initialisation: the seed
fixes it on every rank), whole batch, padded forward, no checkpointing, plain ``torch.optim.AdamW``; the saved
adapter folder must hold the adapters it trained, and the training state the same tensors.
"""

from __future__ import annotations

import pytest
import ray
import torch
from safetensors.torch import load_file

from rlcore.controller.resource_pool import ResourcePool
from rlcore.controller.worker_group import WorkerGroup
from rlcore.engine import lora
from rlcore.engine.lora import LoraSpec
from rlcore.engine.model import ModelSpec, load_causal_lm
from rlcore.engine.sequence import local_model
from rlcore.protocol import Batch
from rlcore.workers.optim import OptimSpec
from rlcore.workers.sft import SFTStepSpec, SFTWorker
from tests.engine.dp_cases import GRAD_CLIP, LR, MICRO, sft_batches

SPEC = LoraSpec(rank=4, alpha=8.0, seed=3)


def peft_training(model_dir, batches: list[Batch]) -> dict[str, torch.Tensor]:
    """The same steps on one peft model: token-mean NLL over the whole batch, clipped, AdamW on the adapters."""
    model = lora.add_adapter(load_causal_lm(model_dir), SPEC, seed=SPEC.seed).train()
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=LR, betas=(0.9, 0.999), weight_decay=0.0)
    for b in batches:
        ids = torch.cat([b["prompts"], b["responses"]], 1)
        mask = torch.cat([b["prompt_mask"], b["response_mask"]], 1)
        lp, _ = local_model(model).response_log_probs(ids, mask, b["responses"])
        rmask = b["response_mask"].float()
        (-(lp * rmask).sum() / rmask.sum()).backward()
        torch.nn.utils.clip_grad_norm_(params, GRAD_CLIP)
        opt.step()
        opt.zero_grad()
    return {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}


# two FSDP ranks and a single-process peft model through several optimizer steps (~22 s): make test-integration
@pytest.mark.integration
def test_fsdp_lora_steps_equal_single_process_peft_steps(ray_local, tiny_model_dir, tiny_tokenizer, tmp_path):
    batches = sft_batches(tiny_tokenizer)
    pool = ResourcePool(2, 1.0, False, 60)
    spec = ModelSpec(str(tiny_model_dir), strategy="fsdp", lora=SPEC, gradient_checkpointing=True)
    wg = WorkerGroup(SFTWorker, pool, name="sft", timeout_s=120, model=spec, optim=OptimSpec(lr=LR), seed=0)
    try:
        ray.get([w.init_model.remote() for w in wg.workers], timeout=120)
        for b in batches:
            wg.call(SFTWorker.train_step, b, SFTStepSpec(micro_batch_size=MICRO, grad_clip=GRAD_CLIP))
        wg.call(SFTWorker.save, str(tmp_path / "adapter"))
        wg.call(SFTWorker.save_state, str(tmp_path))
    finally:
        wg.shutdown()
        pool.release()
    expected = peft_training(tiny_model_dir, batches)
    saved = load_file(str(tmp_path / "adapter" / "adapter_model.safetensors"))
    # peft saves the adapter without its name: ...q_proj.lora_A.weight for ...q_proj.lora_A.default.weight
    assert {k.replace(".default.", ".") for k in expected} == set(saved)
    for name, want in expected.items():
        torch.testing.assert_close(saved[name.replace(".default.", ".")], want, atol=1e-5, rtol=1e-4)
    state = torch.load(tmp_path / "sft.pt", weights_only=False)["model"]
    assert set(state) == set(expected)
    for name, want in expected.items():
        torch.testing.assert_close(state[name], want, atol=1e-5, rtol=1e-4)
    assert lora.adapter_base(tmp_path / "adapter") == tiny_model_dir.resolve()
