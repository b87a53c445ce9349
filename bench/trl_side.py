"""TRL's side of the benchmark: GRPOTrainer on the same model, prompts, reward and settings.

Started by ``bench.run_bench`` as a child process. One process, torch with 2 threads, its libraries' own CPU kernels
(``BENCH_TRL_KERNELS=portable``: rlcore's portable ones),
no vLLM (with ``--set rollout.engine=vllm``, run from .venv-vllm: vLLM in TRL's colocate mode, as ours). ``trainer.train()`` runs once; a callback pauses it after every block of steps
until the parent sends the next ``run K`` (``bench.wire``), so the two systems alternate.

    .venv/bin/python -m bench.trl_side      # then type: run 2 / quit

Mapping of settings (rlcore -> TRL): rollout.n -> num_generations; one RL step = one
optimizer step over train_batch_size x n completions -> per_device_train_batch_size =
generation_batch_size = train_batch_size x n, gradient_accumulation_steps = 1;
task.max_response_length -> max_completion_length; kl_loss_coef -> beta (TRL's KL is k3);
ppo_epochs -> num_iterations; token-mean -> loss_type="dapo"; GRPO std scaling ->
scale_rewards="group". TRL 1.x has no max_prompt_length: every prompt here is shorter
than task.max_prompt_length, so nothing would be truncated either way.
"""

from __future__ import annotations

import os
import time
from collections import defaultdict

os.environ.setdefault("TQDM_DISABLE", "1")
os.environ.setdefault("OMP_NUM_THREADS", "2")
# BENCH_TRL_KERNELS=portable: TRL computes with rlcore's portable kernels (the like-for-like row of make bench);
# unset, with its libraries' own, as a TRL user runs it
KERNELS_ENV = "BENCH_TRL_KERNELS"
if os.environ.get(KERNELS_ENV) == "portable":
    from rlcore.kernels import pin

    pin("portable")  # before torch is imported, as rlcore's processes do

import torch  # noqa: E402

from bench import wire  # noqa: E402
from bench.settings import RL_SEED, WORK_DIR, paths, rl_config  # noqa: E402

TRL_THREADS = 2
# BENCH_TRL_PER_RANK=1: the batch of one of rlcore's ranks (train_batch_size / resources.n_workers prompts) in this one
# process: what each rank's peak memory is compared with
PER_RANK_ENV = "BENCH_TRL_PER_RANK"


def prompts_per_step(cfg) -> int:
    if os.environ.get(PER_RANK_ENV) == "1":
        return cfg.ppo.train_batch_size // cfg.resources.n_workers
    return cfg.ppo.train_batch_size


class PeakRSS:
    """This process's peak resident memory per phase: ``VmHWM``, reset to the current RSS by writing 5 to
    ``/proc/self/clear_refs`` at the phase's start (as rlcore's workers measure theirs: rlcore.engine.peak_memory)."""

    def __init__(self):
        self.peaks: dict[str, float] = {}

    def start(self) -> None:
        from rlcore.engine import peak_memory

        peak_memory.reset(torch.device("cpu"))

    def stop(self, name: str) -> None:
        from rlcore.engine import peak_memory

        self.peaks[name] = max(self.peaks.get(name, 0.0), peak_memory.peak_bytes(torch.device("cpu")) / 2**20)


def rss_mib() -> float:
    for line in open("/proc/self/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def prompt_rows(total_steps: int) -> list[dict]:
    """The RL prompts in exactly the order rlcore's PromptSampler takes them (same seed)."""
    from rlcore.data.schema import read_rows
    from rlcore.trainer.round.prompt_sampler import PromptSampler

    cfg = rl_config()
    df = read_rows(paths()["rl_data"])
    sampler = PromptSampler(len(df), RL_SEED)
    order = [i for _ in range(total_steps) for i in sampler.take(prompts_per_step(cfg))]
    return [{"prompt": list(df["prompt"].iloc[i]), "ground_truth": df["reward_model"].iloc[i]["ground_truth"]}
            for i in order]


def grpo_config(total_steps: int):
    from trl import GRPOConfig

    cfg = rl_config()
    a, per_step = cfg.actor, prompts_per_step(cfg) * cfg.rollout.n
    # rollout.engine vllm (--set rollout.engine=vllm, in .venv-vllm): TRL generates with vLLM too, in its colocate
    # mode (vLLM in the trainer's process, weights moved in memory), its KV cache the size of ours
    vllm = cfg.rollout.engine == "vllm"
    if vllm:
        os.environ.update({"VLLM_CPU_OMP_THREADS_BIND": "nobind", "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",
                           "VLLM_CPU_KVCACHE_SPACE": str(max(1, round(cfg.rollout.kv_cache_gib)))})
    return GRPOConfig(
        output_dir=str(WORK_DIR / "trl_out"), use_cpu=True, bf16=False, fp16=False, use_vllm=vllm,
        vllm_mode="colocate", vllm_enable_sleep_mode=False,
        gradient_checkpointing=False, report_to=[], save_strategy="no", logging_steps=1, disable_tqdm=True,
        max_steps=total_steps, seed=RL_SEED, shuffle_dataset=False, dataloader_num_workers=0,
        num_generations=cfg.rollout.n, per_device_train_batch_size=per_step, generation_batch_size=per_step,
        gradient_accumulation_steps=1, num_iterations=a.ppo_epochs, max_completion_length=cfg.task.max_response_length,
        temperature=cfg.rollout.temperature, top_p=cfg.rollout.top_p, top_k=cfg.rollout.top_k,
        learning_rate=a.lr, lr_scheduler_type="constant", warmup_steps=0, weight_decay=a.weight_decay,
        max_grad_norm=a.grad_clip, beta=a.kl_loss_coef, epsilon=a.loss.clip_ratio, loss_type="dapo",
        scale_rewards="group", mask_truncated_completions=False, disable_dropout=True,
        model_init_kwargs={"dtype": "float32", "attn_implementation": cfg.model.attn_implementation},
    )


def make_trainer(total_steps: int, pacer):
    """GRPOTrainer subclass that times rollout (generation + reward scoring) and the forward passes."""
    from datasets import Dataset
    from trl import GRPOTrainer

    from rlcore.engine.model import load_tokenizer
    from rlcore.rewards.rule import compute_score

    def reward(completions, ground_truth, **_):
        scores = [compute_score("arithmetic", c[0]["content"], gt) for c, gt in zip(completions, ground_truth)]
        pacer.rewards.extend(scores)
        return scores

    class TimedGRPOTrainer(GRPOTrainer):
        def _generate(self, prompts):
            start = time.perf_counter()
            pacer.memory.start()
            out = super()._generate(prompts)
            pacer.memory.stop("gen")  # (TRL scores after its reference forward: the scoring is in "update")
            pacer.add("gen", time.perf_counter() - start)
            prompt_ids, completion_ids = out[0], out[1]
            pacer.count("rollout_tokens", sum(len(c) for c in completion_ids))
            pacer.count("train_tokens", sum(len(c) for c in completion_ids) + sum(len(p) for p in prompt_ids))
            return out

        def _calculate_rewards(self, *args, **kwargs):
            start = time.perf_counter()
            out = super()._calculate_rewards(*args, **kwargs)
            pacer.add("gen", time.perf_counter() - start)  # rollout = sampling + scoring, as rlcore's gen phase
            return out

        def _get_per_token_logps_and_entropies(self, model, *args, **kwargs):
            start = time.perf_counter()
            grad = torch.is_grad_enabled()
            if not grad:  # the reference (with LoRA: the model with its adapter disabled) or old log-probs
                pacer.memory.start()
            out = super()._get_per_token_logps_and_entropies(model, *args, **kwargs)
            name = "ref" if not grad and (model is self.ref_model or self.ref_model is None) else (
                "policy_fwd" if grad else "old_log_prob")
            pacer.add(name, time.perf_counter() - start)
            if not grad:
                pacer.memory.stop(name)
                pacer.memory.start()  # the update: from here to the step's end (policy forward, backward, AdamW)
            return out

    p, cfg = paths(), rl_config()
    return TimedGRPOTrainer(model=str(p["sft"]), reward_funcs=[reward], args=grpo_config(total_steps),
                            train_dataset=Dataset.from_list(prompt_rows(total_steps)),
                            processing_class=load_tokenizer(p["sft"]), callbacks=[pacer],
                            peft_config=lora_config(cfg))


def lora_config(cfg):
    """rlcore's actor.lora as peft's LoraConfig for TRL (None: full fine-tuning), so both train the same adapters."""
    if not cfg.actor.lora.rank:
        return None
    from rlcore.engine.lora import LoraSpec, peft_config

    lo = cfg.actor.lora
    return peft_config(LoraSpec(rank=lo.rank, alpha=lo.alpha, dropout=lo.dropout, target_modules=lo.target_modules))


def make_pacer():
    from transformers import TrainerCallback

    class Pacer(TrainerCallback):
        """Reports each optimizer step and pauses the training loop between blocks."""

        def __init__(self):
            self.left, self.step, self.start = 0, 0, 0.0
            self.phases, self.counts, self.rewards = defaultdict(float), defaultdict(int), []
            self.memory = PeakRSS()

        def add(self, name: str, seconds: float) -> None:
            self.phases[name] += seconds

        def count(self, name: str, n: int) -> None:
            self.counts[name] += n

        def wait(self, control) -> None:
            """Block until the parent says how many steps to run next (stop the loop on quit)."""
            wire.emit("paused", step=self.step)
            verb, k = wire.next_command()
            if verb == "quit":
                control.should_training_stop = True
            self.left = k
            self.start = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            wall = time.perf_counter() - self.start
            self.memory.stop("update")
            wire.emit("step", step=self.step, wall_s=wall, gen_s=self.phases["gen"],
                      reward=sum(self.rewards) / max(len(self.rewards), 1), phases=dict(self.phases, step=wall),
                      rollout_tokens=self.counts["rollout_tokens"], train_tokens=self.counts["train_tokens"],
                      memory_mib=dict(self.memory.peaks))
            self.phases, self.counts, self.rewards = defaultdict(float), defaultdict(int), []
            self.memory = PeakRSS()
            self.step, self.left = self.step + 1, self.left - 1
            if self.left <= 0:
                self.wait(control)
            else:
                self.start = time.perf_counter()
            return control

    return Pacer()


def main() -> None:
    from rlcore.kernels import activate

    activate(TRL_THREADS)  # torch's threads; with portable kernels, the products' threads (torch's own loops on one)
    t0 = time.perf_counter()
    pacer = make_pacer()
    trainer = make_trainer(total_steps=int(os.environ.get("BENCH_TOTAL_STEPS", "1000")), pacer=pacer)
    wire.emit("ready", setup_s=time.perf_counter() - t0, pid=os.getpid(), rss_mib=rss_mib(),
              per_rank=os.environ.get(PER_RANK_ENV) == "1")
    verb, k = wire.next_command()
    if verb == "run":
        pacer.left, pacer.start = k, time.perf_counter()
        trainer.train()
    wire.emit("closed")


if __name__ == "__main__":
    main()
