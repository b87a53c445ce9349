"""Is rlcore's reward behind TRL's at the bench's default configuration? Two measurements.

0. **Sampling, the same policy.** The SFT fixture's samples for the same 512 prompts (8 each, 6 repetitions), drawn
   by rlcore's engine and by ``model.generate`` with the generation config TRL builds: their accuracy.
1. **One update, the same batch.** 256 completions sampled by rlcore's engine from the SFT fixture, scored and given
   GRPO advantages; rlcore's actor loss (``ActorRolloutRefWorker._actor_loss``, the update's own code) and TRL's
   (``GRPOTrainer._compute_loss`` of the bench's GRPOTrainer) on exactly those tensors: their losses and gradients.
2. **Independent runs.** ``make bench`` compares one run of each system: the difference of the two reward curves
   step by step is autocorrelated (a policy that drifted ahead by chance stays ahead), so its standard error over
   the steps of one run understates the noise. Here each system runs ``--steps`` steps from the same fixture for
   each of ``--seeds`` RL seeds (prompt order and sampling; both systems take the same prompts for a seed), and the
   per-seed mean rewards are compared across seeds, which are independent.

    .venv/bin/python -m bench.reward_gap --seeds 10 --steps 22     # about 1 minute per seed on 2 idle cores

Writes its report into bench/RESULTS.md as the section ``reward-gap`` (``bench/sections.py``; ``make bench`` keeps it).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

from bench.children import Child
from bench.prepare import ensure_prepared
from bench.sections import write_section
from bench.settings import BENCH_DIR, WORK_DIR


def sampling(reps: int = 6, prompts: int = 512) -> dict[str, float]:
    """Measurement 0 (in this process): accuracy of samples of the same policy by each system's sampler."""
    import torch
    from transformers import GenerationConfig

    from bench.settings import paths, rl_config
    from rlcore.data.collate import decode_responses, prompt_batch
    from rlcore.data.schema import read_rows
    from rlcore.engine.model import load_causal_lm, load_tokenizer
    from rlcore.rewards.rule import compute_score
    from rlcore.rollout import EngineSpec, SamplingParams, make_engine

    p, cfg = paths(), rl_config()
    tok, n, length = load_tokenizer(p["sft"]), cfg.rollout.n, cfg.task.max_response_length
    df = read_rows(p["rl_data"]).iloc[:prompts]
    pb = prompt_batch(df, tok, cfg.task.max_prompt_length, "rl")
    truth = [r["ground_truth"] for r in df["reward_model"] for _ in range(n)]
    model = load_causal_lm(p["sft"]).eval()
    engine = make_engine(load_causal_lm(p["sft"]), EngineSpec(), eos_token_id=tok.eos_token_id,
                         pad_token_id=tok.pad_token_id)
    # TRL 1.16's GRPOTrainer without vLLM: these generation kwargs, prompts tokenised by apply_chat_template
    config = GenerationConfig(max_new_tokens=length, do_sample=True, pad_token_id=tok.pad_token_id,
                              bos_token_id=tok.bos_token_id, eos_token_id=model.generation_config.eos_token_id,
                              temperature=cfg.rollout.temperature, top_p=cfg.rollout.top_p, top_k=cfg.rollout.top_k,
                              min_p=None, repetition_penalty=1.0, disable_compile=True)
    ids = [tok.apply_chat_template(list(m), add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"]
           for m in df["prompt"] for _ in range(n)]
    ours_ids = [row[mask.bool()].tolist() for row, mask in zip(pb["prompts"], pb["prompt_mask"]) for _ in range(n)]
    acc = lambda texts: sum(compute_score("arithmetic", t, g) for t, g in zip(texts, truth)) / len(texts)  # noqa: E731
    ours, trl = [], []
    for rep in range(reps):
        out = engine.generate(pb["prompts"].repeat_interleave(n, 0), pb["prompt_mask"].repeat_interleave(n, 0),
                              SamplingParams(max_new_tokens=length), generator=torch.Generator().manual_seed(rep))
        ours.append(acc(decode_responses(tok, out["responses"], out["response_mask"])))
        torch.manual_seed(rep)
        enc = tok.pad({"input_ids": ids}, padding=True, padding_side="left", return_tensors="pt")
        with torch.no_grad():
            gen = model.generate(**enc, generation_config=config)
        trl.append(acc(tok.batch_decode(gen[:, enc["input_ids"].shape[1]:], skip_special_tokens=True)))
    (mo, so), (mt, st) = mean_se(ours), mean_se(trl)
    return {"samples_per_system": reps * prompts * n, "ours": mo, "ours_se": so, "trl": mt, "trl_se": st,
            "same_prompt_ids": ours_ids == ids}


def one_batch() -> dict[str, float]:
    """Measurement 1 (in this process)."""
    import numpy as np
    import torch

    from bench import trl_side
    from bench.settings import paths, rl_config
    from rlcore.algos.advantage import compute_advantage
    from rlcore.algos.aggregation import AggScale
    from rlcore.controller import RankPlacement
    from rlcore.data.collate import decode_responses, prompt_batch
    from rlcore.data.schema import read_rows
    from rlcore.engine.model import ModelSpec, load_tokenizer
    from rlcore.protocol import Batch
    from rlcore.rewards.rule import compute_score
    from rlcore.rollout import EngineSpec, SamplingParams
    from rlcore.trainer.round.ppo_step import actor_update_spec
    from rlcore.trainer.round.ppo_step import place_scores
    from rlcore.workers.actor import ActorRolloutRefWorker, LogProbSpec
    from rlcore.workers.optim import OptimSpec
    from rlcore.workers.rollout import GenerateSpec

    p, cfg = paths(), rl_config()
    tok, n, prompts_n = load_tokenizer(p["sft"]), cfg.rollout.n, cfg.ppo.train_batch_size
    df = read_rows(p["rl_data"]).iloc[:prompts_n]
    pb = prompt_batch(df, tok, cfg.task.max_prompt_length, "rl")
    w = ActorRolloutRefWorker(RankPlacement(0, 1, 2), model=ModelSpec(str(p["sft"])), engine=EngineSpec(),
                              optim=OptimSpec(lr=cfg.actor.lr), with_ref=True)
    w.init_model()
    rows = Batch({"prompts": pb["prompts"].repeat_interleave(n, 0), "prompt_mask": pb["prompt_mask"].repeat_interleave(n, 0)})
    out = rows.union(w.generate(rows, GenerateSpec(SamplingParams(max_new_tokens=cfg.task.max_response_length), 7,
                                                   len(rows))))
    truth = [r["ground_truth"] for r in df["reward_model"] for _ in range(n)]
    texts = decode_responses(tok, out["responses"], out["response_mask"])
    scores = torch.tensor([compute_score("arithmetic", t, g) for t, g in zip(texts, truth)])
    mask = out["response_mask"]
    adv, _ = compute_advantage("grpo", token_level_rewards=place_scores(scores, mask), response_mask=mask,
                               index=np.repeat(np.arange(prompts_n), n), norm_adv_by_std_in_grpo=True)
    batch = out.union(Batch({"advantages": adv, "old_log_probs": out["rollout_log_probs"]}))
    batch = batch.union(w.compute_ref_log_prob(batch, LogProbSpec(len(batch))))
    spec = actor_update_spec(cfg, 0)
    measures = spec.proximal.measures(batch, spec.off_policy, epochs=spec.epochs, mini_batch_size=len(batch))
    ours = w._actor_loss(batch, spec, AggScale(float(mask.sum()), float(len(batch)), 1), True, measures).loss
    ours.backward()
    g_ours = {k: v.grad for k, v in w.actor.module.named_parameters()}

    trainer = trl_side.make_trainer(2, trl_side.make_pacer())
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = 1
    inputs = {"prompt_ids": out["prompts"], "prompt_mask": out["prompt_mask"], "completion_ids": out["responses"],
              "completion_mask": mask, "advantages": adv[:, 0], "ref_per_token_logps": batch["ref_log_probs"],
              "num_items_in_batch": mask.sum().float()}
    theirs = trainer._compute_loss(trainer.model, inputs)
    theirs.backward()
    g_trl = {k: v.grad for k, v in trainer.model.named_parameters()}
    dot = sum(float((g_ours[k] * g_trl[k]).sum()) for k in g_ours)
    norm = lambda g: sum(float(v.square().sum()) for v in g.values()) ** 0.5  # noqa: E731
    return {"loss_ours": ours.item(), "loss_trl": theirs.item(), "grad_norm_ours": norm(g_ours),
            "grad_norm_trl": norm(g_trl), "grad_cosine": dot / norm(g_ours) / norm(g_trl),
            "grad_max_abs_diff": max(float((g_ours[k] - g_trl[k]).abs().max()) for k in g_ours),
            "accuracy_of_the_batch": float(scores.mean())}


def rewards(module: str, seed: int, steps: int) -> list[float]:
    child = Child(f"gap_{module.split('.')[-1]}_{seed}", module,
                  env={"BENCH_RL_SEED": str(seed), "BENCH_TOTAL_STEPS": str(steps), "RAY_worker_niceness": "0"})
    try:
        child.expect("ready")
        return [r["reward"] for r in child.run(steps)]
    finally:
        child.close()


def mean_se(xs: list[float]) -> tuple[float, float]:
    return statistics.mean(xs), (statistics.stdev(xs) / len(xs) ** 0.5 if len(xs) > 1 else float("nan"))


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seeds", type=int, default=10, help="independent runs per system (RL seeds 1..N)")
    ap.add_argument("--steps", type=int, default=22)
    ap.add_argument("--skip-batch", action="store_true", help="only the independent runs")
    ap.add_argument("--first-seed", type=int, default=1)
    ap.add_argument("--out", default=str(BENCH_DIR / "RESULTS.md"))
    args = ap.parse_args(argv)
    ensure_prepared()
    out: dict = {"steps": args.steps}
    if not args.skip_batch:
        out["sampling"] = sampling()
        print(json.dumps(out["sampling"]), flush=True)
        out["one_batch"] = one_batch()
        print(json.dumps(out["one_batch"]), flush=True)
    runs = []
    for seed in range(args.first_seed, args.first_seed + args.seeds):
        ours, trl = rewards("bench.ours", seed, args.steps), rewards("bench.trl_side", seed, args.steps)
        runs.append({"seed": seed, "ours": statistics.mean(ours), "trl": statistics.mean(trl),
                     "ours_curve": ours, "trl_curve": trl})
        print(json.dumps({k: v for k, v in runs[-1].items() if not k.endswith("curve")}), flush=True)
    out["runs"] = runs
    diffs = [r["ours"] - r["trl"] for r in runs]
    out["summary"] = {"ours": mean_se([r["ours"] for r in runs]), "trl": mean_se([r["trl"] for r in runs]),
                      "ours_minus_trl": mean_se(diffs)}
    (WORK_DIR / "reward_gap.json").write_text(json.dumps(out, indent=1))
    text = report(out, " ".join(["python -m bench.reward_gap", *(argv if argv is not None else sys.argv[1:])]))
    print(text)
    write_section(args.out, "reward-gap", text)


def report(out: dict, command: str) -> str:
    s, runs = out["summary"], out["runs"]
    lines = ["## Reward at the default configuration: ours vs TRL", "",
             f"`{command}` (`bench/reward_gap.py`). `make bench` reports one run of each system, and the step-by-step "
             "difference of two reward curves is autocorrelated (a policy that drifts ahead by chance stays ahead), "
             "so its standard error over the steps of one run understates the noise. Two measurements instead:", ""]
    a = out.get("sampling")
    if a:
        lines += [f"0. **Sampling, the same policy**: accuracy of {a['samples_per_system']:,} samples of the SFT fixture "
                  f"per system for the same prompts: rlcore's engine {a['ours']:.4f} ± {a['ours_se']:.4f}, TRL's "
                  f"generation config through `model.generate` {a['trl']:.4f} ± {a['trl_se']:.4f}. The prompts' token "
                  f"ids are {'the same' if a['same_prompt_ids'] else '**not** the same'} in both.", ""]
    b = out.get("one_batch")
    if b:
        lines += [f"1. **One update on the same batch** (256 completions of the SFT fixture, accuracy "
                  f"{b['accuracy_of_the_batch']:.3f}): loss ours {b['loss_ours']:.9f}, TRL {b['loss_trl']:.9f}; "
                  f"gradient norm ours {b['grad_norm_ours']:.6f}, TRL {b['grad_norm_trl']:.6f}; cosine "
                  f"{b['grad_cosine']:.7f}; largest element difference {b['grad_max_abs_diff']:.2g}. The loss, its "
                  "aggregation, the KL term and the advantages are the same computation.", ""]
    lines += [f"2. **Independent runs**: each system {out['steps']} steps from the same SFT fixture for each of "
              f"{len(runs)} RL seeds (prompt order and sampling; both take the same prompts for a seed). Mean reward "
              f"over the steps, ± 1 s.e. over seeds: ours {s['ours'][0]:.4f} ± {s['ours'][1]:.4f}, TRL "
              f"{s['trl'][0]:.4f} ± {s['trl'][1]:.4f}; **ours - TRL {s['ours_minus_trl'][0]:+.4f} ± "
              f"{s['ours_minus_trl'][1]:.4f}**.", "",
              "| seed | ours | TRL | ours - TRL |", "|---|---|---|---|"]
    lines += [f"| {r['seed']} | {r['ours']:.4f} | {r['trl']:.4f} | {r['ours'] - r['trl']:+.4f} |" for r in runs]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    os.environ.setdefault("TQDM_DISABLE", "1")
    main()
