"""The markdown report (stdout and bench/RESULTS.md) from the info dict of ``bench.run_bench``."""

from __future__ import annotations

import time
from typing import Any

from bench import report


DIFFERENCES = """\
- **Parallelism.** Ours: a controller process (1 torch thread) plus 2 Ray worker ranks
  (`resources.strategy: ddp`, a full replica each, gradients all-reduced over gloo), each with
  1 torch thread; each step makes two worker calls (generate, update_actor), moving only the
  tensors the ranks read. TRL: one process, torch with 2 threads, no vLLM, model and reference
  in the same process.
- **Prompts.** The same RL prompts in the same order: TRL's dataset is laid out in the order
  rlcore's `PromptSampler` takes them (same seed) and `shuffle_dataset=False`. Sampling RNGs differ,
  so the completions (and rewards) differ from step to step; the distribution is the same.
- **Advantages.** Both (r - group mean) / (unbiased group std + eps); eps is 1e-6 in rlcore, 1e-4
  in TRL (fixed in TRL).
- **Policy loss.** Both token-mean over all completion tokens of the step (rlcore `token-mean`,
  TRL `loss_type="dapo"`), clip 0.2. rlcore's `vanilla` loss adds dual-clip (c=3) for negative
  advantages; TRL has none. With one pass per step the ratio is 1 (TRL: exactly, it uses the
  detached current log-probs; rlcore: up to float error, it reuses the sampler's log-probs), so
  clipping does not act in either.
- **KL.** Both k3 (`e^x - x - 1`, x = logp_ref - logp) times the same coefficient, added to the
  per-token loss; rlcore clamps x to [-20, 20] and k3 to [-10, 10] (verl), TRL does not clamp.
- **Optimizer.** Both AdamW (0.9, 0.999, eps 1e-8), weight decay 0, constant LR without warm-up,
  grad-norm clip 1.0. TRL uses its default `adamw_torch_fused`; rlcore `torch.optim.AdamW(foreach=True)`.
- **Generation.** rlcore: its static-cache engine (`rollout.engine: static`: a preallocated KV cache,
  each distinct prompt prefilled once, finished rows compacted out of the batch, inverse-CDF sampling)
  reading the trainer's own float32 weights (no copy, no sync: `ddp`, float32), each sync checked on a probe.
  TRL: `model.generate(do_sample=True)` on the training model. Both stop at EOS or max length;
  TRL's `top_k=0` and rlcore's `top_k: 0` both mean no top-k filter.
- **Padding and repeats.** rlcore's forwards are packed (`model.packed_forward`): no padding token,
  each distinct prompt once and each distinct (prompt ; response) row once, outputs gathered back
  to every row (the same numbers as the padded forward, tested). TRL pads to the longest prompt and
  completion in the batch and runs every row. Token counts never include padding.
- **Prompt length.** TRL 1.x has no `max_prompt_length`; every prompt here is shorter than
  rlcore's limit, so neither truncates.
- **Entropy.** Both compute the entropy in the training forward (for logging; coefficient 0);
  rlcore keeps it off the autograd graph when its coefficient is 0.
- **LoRA** (configuration `lora`): both train peft adapters of the same rank, alpha and target modules at the
  same learning rate, and both take the reference from the model with its adapter disabled.
- **Reward.** The loss, its aggregation, the KL term, the advantages and the sampler are the same computation
  (section "Reward at the default configuration" below: `bench/reward_gap.py`)."""


def kv_table(d: dict[str, Any], head: tuple[str, str] = ("key", "value")) -> list[str]:
    return [f"| {head[0]} | {head[1]} |", "|---|---|"] + [f"| {k} | {v} |" for k, v in d.items()]


def headline(s: dict[str, dict]) -> str:
    ratio = s["trl"]["median_s"] / s["ours"]["median_s"]
    faster = "rlcore is faster" if ratio > 1 else "TRL is faster"
    line = f"**TRL/ours seconds per RL step (median), each at its own defaults: {ratio:.2f}** ({faster})."
    if "ours_native" in s and "trl_portable" in s:
        line += (f" Both on their libraries' own kernels: {s['trl']['median_s'] / s['ours_native']['median_s']:.2f}; "
                 f"both on rlcore's portable kernels: {s['trl_portable']['median_s'] / s['ours']['median_s']:.2f}.")
    return line


def steps_note(info: dict) -> str:
    if info["clean_only"]:
        return (f"Timing rows use the *clean* steps only: those during which other processes on the machine used "
                f"< {report.CLEAN_CORES} cores (each system had at least {report.MIN_CLEAN}).")
    return (f"**Noisy run:** fewer than {report.MIN_CLEAN} clean steps (other processes < {report.CLEAN_CORES} "
            "cores) for a system, so the timing rows use every measured step; they are less trustworthy.")


def experiment_note(info: dict) -> list[str]:
    """Non-default runs say so at the top: these numbers are not the project's configuration."""
    sets = info["ours_overrides"]
    if not sets:
        return []
    return [f"**Experiment, not the default configuration:** ours ran with config overrides {sets}.", ""]


def step_rows(info: dict) -> list[str]:
    rec, warm = info["records"], info["args"]["warmup"]
    lines = ["Other load = cores used by other processes while the step ran.", "",
             "| step | ours s | ours reward | ours other load | TRL s | TRL reward | TRL other load |",
             "|---|---|---|---|---|---|---|"]
    load = lambda r: f"{r['foreign_load']:.2f}" if "foreign_load" in r else "-"  # noqa: E731
    for i, (o, t) in enumerate(zip(rec["ours"], rec["trl"])):
        tag = " (warm-up)" if i < warm else ""
        lines.append(f"| {i}{tag} | {o['wall_s']:.3f} | {o['reward']:.3f} | {load(o)} | {t['wall_s']:.3f} | "
                     f"{t['reward']:.3f} | {load(t)} |")
    return lines


def where_time_goes(info: dict) -> list[str]:
    lines = ["Phases as each system times them (mean over the measured steps). Ours: rlcore's",
             "`timing_s/*` (controller wall time per phase, Ray round trips included; gen = weight sync +",
             "sampling + reward scoring). TRL: timers around its `_generate` + `_calculate_rewards` (gen:",
             "tokenise, sample, decode, score) and `_get_per_token_logps_and_entropies` (ref forward, policy",
             "forward under grad); the rest of TRL's step is backward, optimizer, advantages and logging.",
             "", *report.phase_table(info["measured"], info["params"]["matmul"], info["peak_flops"])]
    prof = info.get("profile")
    if not prof:
        lines += ["", "(No profile in this run: --no-profile, or py-spy is not installed.)"]
    if prof:
        lines += ["", f"### Profile of {prof['steps']} of our steps (py-spy, 100 Hz, non-blocking)", "",
                  *report.profile_tables(prof), "",
                  "Raw py-spy stacks: `bench/_work/profile/{controller,worker0,worker1}.txt` (workers in pid",
                  "order). A phase's wall time minus the ranks' compute buckets for it is Ray dispatch, Batch",
                  "(de)serialisation and transfer, and one rank waiting for the other in a collective. Where the",
                  "machine has no core to spare for py-spy, its sampling slows one rank at a time and the other",
                  "waits, so most of that remainder is the profiler's own; Ray's cost is measured directly above."]
    return lines


def settings_section(info: dict) -> list[str]:
    sh, p, ready = info["shared"], info["params"], info["ours_ready"]
    res = ready["resources"]
    per_step = sh["completions_per_step"]
    trl_cfg = {"num_generations": sh["generations_per_prompt"], "per_device_train_batch_size": per_step,
               "generation_batch_size": per_step, "gradient_accumulation_steps": 1,
               "num_iterations": sh["optimisation_passes_per_step"],
               "max_completion_length": sh["max_response_length"], "temperature": sh["temperature"],
               "top_p / top_k": f"{sh['top_p']} / {sh['top_k']}", "learning_rate": sh["learning_rate"],
               "lr_scheduler_type": "constant", "beta": sh["kl_coef"], "epsilon": sh["clip_ratio"],
               "loss_type": "dapo", "scale_rewards": "group", "max_grad_norm": sh["grad_clip"],
               "use_vllm / use_cpu / bf16": "False / True / False", "gradient_checkpointing": False,
               "shuffle_dataset": False, "torch threads": 2}
    return ["Shared by both (from `params.yaml` + `bench/settings.py` OVERRIDES):", "", *kv_table(sh), "",
            f"Model: the built-in tiny Llama (char-level tokenizer; shape from `model.tiny`: "
            f"{tiny_shape(info)}), SFT'd once by rlcore ({info['prepare'].get('sft_steps')} steps, pinned in "
            f"`bench/settings.py`) and saved to `{info['fixture']}`; both systems load that folder. "
            f"{p['total']:,} parameters, {p['matmul']:,} excluding the input embedding (N in the FLOP formula).", "",
            "TRL `GRPOConfig` (see `bench/trl_side.py`):", "", *kv_table(trl_cfg, ("field", "value")), "",
            f"Ours: `RoundRunner` from `rlcore.trainer.ppo`, `resources.n_workers: {res['n_workers']}`, "
            f"`cpus_per_worker: {res['cpus_per_worker']}` (= torch threads per rank), "
            f"`strategy: {res['strategy']}`, `model.packed_forward: {str(ready['packed_forward']).lower()}`, "
            f"`ppo.balance_batch: {str(ready['balance_batch']).lower()}`, "
            "`actor.ppo_mini_batch_size` = `ppo.train_batch_size` (one optimizer step per RL step), "
            f"`rollout.engine: {ready.get('engine', 'static')}`, `actor.recompute_log_prob: false`."]


def tiny_shape(info: dict) -> str:
    tiny = info["prepare"].get("built_from", {}).get("model", {}).get("tiny", {})
    return ", ".join(f"{k}={v}" for k, v in tiny.items()) or "see params.yaml"


def command(info: dict) -> str:
    args = info["args"]
    cmd = (f"python -m bench.run_bench --configs {args['configs']} --steps {args['steps']} --warmup {args['warmup']} "
           f"--block {args['block']}")
    return cmd + "".join(f" --{flag} {v}" for flag, key in (("set", "sets"), ("fixture-set", "fixture_sets"))
                         for v in args[key]) + "".join(f" --ours-set {k}={v}" for k, v in info["ours_overrides"].items())


def generation_section(info: dict) -> list[str]:
    g, sh = info["generation"], info["shared"]
    return ["Generation against this machine's ceilings (see `bench/report.py: generation_efficiency`): matmul "
            f"FLOPs = 2 x N per generated token; bytes = the fp32 weights once per decode step per model copy (ours: "
            f"one per rank, TRL: one) plus each row's KV cache; {sh['max_response_length']} decode steps per RL step "
            "(`task.max_response_length`: exact when answers run to the limit, an upper bound otherwise). "
            f"Memory bandwidth: {info['mem_bandwidth'] / 1e9:.1f} GB/s (a 256 MiB copy, 2 threads).", "",
            "| system | generated tokens/step | generation s/step | FLOP/s (of matmul peak) | bytes/s (of bandwidth) |",
            "|---|---|---|---|---|",
            *[f"| {name} | {g[name]['tokens_per_step']:,.0f} | {g[name]['gen_s_per_step']:.3f} | "
              f"{g[name]['flop_s'] / 1e9:.1f} G ({g[name]['flop_frac']:.0%}) | {g[name]['bytes_s'] / 1e9:.2f} G "
              f"({g[name]['bw_frac']:.0%}) |" for name in ("ours", "trl")], ""]


def results_section(info: dict) -> list[str]:
    s, args = info["summary"], info["args"]
    flop_note = (f"Matmul peak: {info['peak_flops'] / 1e9:.0f} GFLOP/s (fp32 1024x1024 GEMM, 2 threads, best of "
                 f"2 s; other load during it: {info['load_during_matmul']:.2f} cores). Training FLOPs per step = "
                 f"(6 + 2) x N x T: policy forward+backward plus the reference forward over the step's T prompt+"
                 f"completion tokens. Nominal: the same T for both systems; rlcore's packed forwards run each "
                 f"repeated prompt and each repeated (prompt ; response) row once, so they execute fewer FLOPs "
                 f"than this and the figure is useful work per second, not hardware utilisation.")
    return ["## Results", "",
            f"{args['steps']} measured steps per system after {args['warmup']} warm-up steps, in alternating blocks "
            f"of {args['block']}. TRL/ours > 1 means ours is better for times and memory, < 1 for rates.", "",
            *report.results_table(s, info["memory"], info["total_steps"], info["shared"]["completions_per_step"],
                                  info["records"]),
            "", steps_note(info), "", flop_note, ""]


PHASES = (("gen", "generation (weight sync + sampling)"), ("ref", "reference forward"),
          ("update", "update (policy forward, backward, AdamW)"))


def phase_peaks(records: list[dict]) -> dict[str, float]:
    """The largest peak of each phase over the steps (ours: already the largest rank's)."""
    keys = {k for r in records for k in r.get("memory_mib", {})}
    return {k: max(r.get("memory_mib", {}).get(k, 0.0) for r in records) for k in keys}


def memory_section(info: dict) -> list[str]:
    """Peak memory per phase of one rlcore rank against TRL's one process, with one rank's batch and the whole batch;
    then what costs what (rlcore.engine.footprint's formulas) against the measured figures."""
    ours, trl = phase_peaks(info["measured"]["ours"]), phase_peaks(info["measured"]["trl"])
    rank = info.get("trl_per_rank")
    sh, workers = info["shared"], info["ours_ready"]["resources"]["n_workers"]
    per_rank = sh["completions_per_step"] // workers
    head = (f"| phase | ours: largest of {workers} ranks ({per_rank} completions each) | TRL, {per_rank} completions "
            f"in one process | TRL, {sh['completions_per_step']} completions |")
    lines = ["## Memory per phase", "",
             "Each process's peak resident memory during each phase (`VmHWM`, reset at the phase's start through "
             "`/proc/self/clear_refs`: `rlcore.engine.peak_memory`; largest over the measured steps). A rank of ours "
             "is compared with TRL running the same per-rank batch in one process (a separate TRL run of "
             f"{info['args'].get('memory_steps', 0)} steps after a warm-up one).", "", head, "|---|---|---|---|"]
    after_setup = [max(info["ours_ready"].get("rank_rss_mib") or [float("nan")]),
                   rank["ready_rss_mib"] if rank else float("nan"), info["trl_ready"].get("rss_mib", float("nan"))]
    lines.append("| after set-up, before any step | " + " | ".join(f"{v:,.0f} MiB" for v in after_setup) + " |")
    rank_mem = rank["memory_mib"] if rank else {}
    for key, label in PHASES:
        lines.append(f"| {label} | {ours.get(key, float('nan')):,.0f} MiB | {rank_mem.get(key, float('nan')):,.0f} MiB "
                     f"| {trl.get(key, float('nan')):,.0f} MiB |")
    peak = [max(d.values()) if d else float("nan") for d in (ours, rank_mem, trl)]
    lines.append("| **peak of the step** | " + " | ".join(f"**{v:,.0f} MiB**" for v in peak) + " |")
    if rank:
        verdict = "yes" if peak[0] <= peak[1] else "**no**"
        lines += ["", f"Each rlcore rank's peak at or under TRL's for the same per-rank batch: {verdict} "
                  f"({peak[0]:,.0f} vs {peak[1]:,.0f} MiB). The controller process of ours held "
                  f"{info['ours_ready'].get('controller_rss_mib', float('nan')):,.0f} MiB after set-up."]
    return lines + ["", *cost_rows(info), ""]


# ours: the logits and their gradient, and the chunked log-prob's four float chunks (rlcore.engine.logits), of one
# micro-batch; TRL: the logits, their log-softmax and its gradient, of the whole batch (in float32)
LOGITS_ROW = "logits (ours: logits, gradient, chunk temporaries; TRL: logits, log-softmax, gradient)"


def cost_rows(info: dict) -> list[str]:
    """What costs what, per process: the model-related bytes by the formulas of rlcore.engine.footprint (the
    same ones ``rlcore diagnose`` warns with), the rest of each process measured."""
    from bench.settings import rl_config
    from rlcore.engine import footprint

    cfg = rl_config(info.get("ours_overrides") or {})
    shape = footprint.model_shape(info["fixture_path"], [(cfg.actor.lora.rank, cfg.actor.lora.target_modules)])
    ours = footprint.estimates(cfg, info["fixture_path"], "ppo")[0].parts
    lora = cfg.actor.lora.rank > 0
    trained = shape.lora_params[(cfg.actor.lora.rank, cfg.actor.lora.target_modules)] if lora else shape.params
    sh = info["shared"]
    trl_logits = 3 * 4.0 * sh["completions_per_step"] * sh["max_response_length"] * shape.vocab
    kv = 2 * 4.0 * shape.layers * shape.kv_width * sh["completions_per_step"] * (
        sh["max_prompt_length"] + sh["max_response_length"])  # transformers' dynamic cache of the whole batch
    trl = {"weights": 4.0 * shape.params, "gradients": 4.0 * trained, "AdamW": 8.0 * trained,
           "AdamW step": 4.0 * trained, "reference": 0.0 if lora else 4.0 * shape.params, "KV cache": kv,
           "rollout copy": 0.0, LOGITS_ROW: trl_logits}
    micro_logits = min(cfg.actor.micro_batch_size, sh["completions_per_step"] // cfg.resources.n_workers) \
        * sh["max_response_length"] * shape.vocab
    ours = {**{k: v for k, v in ours.items() if k not in ("activations", "runtime")},
            LOGITS_ROW: footprint.logits_bytes(micro_logits)}
    mib = lambda v: f"{v / 2**20:,.1f} MiB"  # noqa: E731
    lines = [f"What costs what, per process ({shape.params / 1e6:.2f}M parameters, {trained / 1e6:.3f}M of them "
             f"trained{', LoRA' if lora else ''}; model bytes by `rlcore.engine.footprint`'s formulas, the "
             "process after set-up measured):", "", "| item | ours, one rank | TRL, one process |", "|---|---|---|"]
    for key in dict.fromkeys([*ours, *trl]):
        lines.append(f"| {key} | {mib(ours.get(key, 0.0))} | {mib(trl.get(key, 0.0))} |")
    setup = [max(info["ours_ready"].get("rank_rss_mib") or [float("nan")]), info["trl_ready"].get("rss_mib", float("nan"))]
    model_bytes = [sum(v for k, v in d.items() if k in ("weights", "reference", "rollout copy")) / 2**20
                   for d in (ours, trl)]
    lines.append("| runtime: the process after set-up less its model copies (Python, torch, transformers; ours: "
                 "Ray's core worker; TRL: trl, datasets, accelerate) | "
                 + " | ".join(f"{s - m:,.0f} MiB" for s, m in zip(setup, model_bytes)) + " |")
    return lines


def reproduce_section(info: dict) -> list[str]:
    return ["## How to reproduce", "",
            "```", "make bench                       # installs the `bench` extra (TRL), then runs the default",
            command(info),
            "python -m bench.run_bench --steps 2 --warmup 1 --no-profile --out bench/_work/quick.md   # quick check",
            "python -m bench.ab --ours-set resources.ref_reshard_after_forward=true   # A/B of one rlcore "
            "setting on our side", "```", "",
            f"The first run also builds the data and the SFT checkpoint (`{info['fixture']}`; a few minutes); a "
            "change to the seed/model/task/sft params builds new ones, deleting them rebuilds them. "
            "Child logs: `bench/_work/logs/`; all numbers of the last run: `bench/_work/last_run.json`.", "",
            "Other processes on the machine slow both systems (TRL's 2 OpenMP threads suffer most when a core "
            "is taken). Three things keep that out of the comparison: every process of both systems runs at "
            f"niceness {info['nice']} (`--nice`; Ray's workers, which Ray starts 15 levels lower by default, are "
            "levelled with `RAY_worker_niceness=0`); the run waits before each block, up to 15 s and "
            f"`--quiet-wait` s in all (this run: {info['quiet_wait_s']:.0f} s), for other processes to use < 0.3 "
            "cores; and only steps during which other processes used < 0.3 cores count when each system has "
            "at least 5 of them.", ""]


def config_title(info: dict) -> str:
    c = info["config"]
    sets = ", ".join(f"`{k}={v}`" for k, v in {**c["sets"], **{f"fixture {k}": v for k, v in c["fixture_sets"].items()}
                                                 }.items())
    return f"Configuration `{c['name']}`" + (f" ({sets})" if sets else " (params.yaml as is)")


def ratio(s: dict[str, dict], trl: str, ours: str) -> str:
    return f"{s[trl]['median_s'] / s[ours]['median_s']:.2f}" if trl in s and ours in s else "-"


def summary_table(infos: list[dict]) -> list[str]:
    """One row per configuration. The headline pair runs each system as its users get it (rlcore's defaults: portable
    kernels; TRL: its libraries' own); the like-for-like pairs give both the same kernels."""
    lines = ["| configuration | parameters | completions/step x max tokens | rlcore s/step (defaults: portable) | "
             "TRL s/step (its own kernels) | **TRL/ours, each at its defaults** | TRL/ours, both native | "
             "TRL/ours, both portable | reward last 5 steps, ours / TRL |", "|---|---|---|---|---|---|---|---|---|"]
    for info in infos:
        s, sh = info["summary"], info["shared"]
        lines.append(f"| {info['config']['name']} | {info['params']['total'] / 1e6:.2f}M | "
                     f"{sh['completions_per_step']} x {sh['max_response_length']} | {s['ours']['median_s']:.3f} | "
                     f"{s['trl']['median_s']:.3f} | **{ratio(s, 'trl', 'ours')}** | {ratio(s, 'trl', 'ours_native')} | "
                     f"{ratio(s, 'trl_portable', 'ours')} | "
                     f"{s['ours']['reward_last5']:.3f} / {s['trl']['reward_last5']:.3f} |")
    return lines


def render(infos: list[dict]) -> str:
    """One document: a summary over the configurations, then each configuration's report."""
    lines = ["# rlcore vs TRL: GRPO on the arithmetic task, on this machine", "",
             f"Generated {time.strftime('%Y-%m-%d %H:%M')} by `{command(infos[0])}` in "
             f"{sum(i['wall_s'] for i in infos):.0f} s.", "", *summary_table(infos), "",
             "Kernels: rlcore's default `resources.cpu_kernels: portable` (the same bits on any x86-64 CPU with AVX2; "
             "docs/concepts/reproducibility.md); `native` and TRL's own are MKL's and ATen's choice for this CPU. "
             "Medians of steps measured in turn, in blocks, in one run.", ""]
    for info in infos:
        lines += [f"# {config_title(info)}", "", render_one(info)]
    return "\n".join(lines)


def render_one(info: dict) -> str:
    lines = [
        f"Ran in {info['wall_s']:.0f} s (setup: ours {info['setup_s']['ours']:.0f} s, TRL {info['setup_s']['trl']:.0f} s, "
        "not in the step times).",
        "", headline(info["summary"]), "", *experiment_note(info),
        *results_section(info), *memory_section(info), *generation_section(info),
        "## Where the time goes", "", *where_time_goes(info), "",
        "## Machine", "", *kv_table(info["machine"]), "",
        "## Versions", "", *kv_table(info["versions"], ("package", "version")), "",
        "## Settings", "", *settings_section(info), "",
        "## Remaining differences between the two setups", "", DIFFERENCES, "",
        *reproduce_section(info),
        "## Per-step data", "", *step_rows(info), "",
    ]
    return "\n".join(lines)
