"""rlcore's GRPO step at a real model size on one GPU (not part of `make test` or `make bench`).

    python -m bench.gpu_scale                       # Qwen2-0.5B shape, 3 configurations, markdown to stdout
    python -m bench.gpu_scale --steps 4 --out gpu.md
    python -m bench.gpu_scale --engines static,hf --configs ddp:packed   # the rollout engines side by side
    python -m bench.gpu_scale --shape qwen2.5-1.5b --modes full,lora --configs ddp:packed   # memory modes

Nothing is downloaded: the model is a randomly initialised decoder with the shape of Qwen2-0.5B
(24 layers, hidden 896, 14 query / 2 key-value heads, vocabulary 151,936, tied embeddings) and
the built-in character tokenizer, saved to a local folder; the prompts are the arithmetic task's.
A random model never emits EOS, so every response runs to ``--response-len`` tokens: the numbers
are throughput at a fixed length, not learning. Each configuration (``resources.strategy``,
``model.packed_forward``) runs ``--warmup`` + ``--steps`` RL steps of ``RoundRunner`` on one
rank with ``resources.use_gpu: true`` (nccl) in bfloat16, and reports the median seconds per
step, its phases, the share of the step spent generating, rollout and training tokens per second,
the rank's peak GPU memory and, for the static engine, its CUDA-graph captures (after the first step
and at the end: captures during the timed steps would be recaptures). ``--engines`` runs every
configuration once per rollout engine (``rollout.engine``; ``--compile`` sets ``rollout.compile``).
``--shape`` takes another shape of ``rlcore init-model`` (Qwen2.5-0.5B, Qwen2.5-1.5B) and ``--modes`` the training
modes of ``bench.real_size``: ``full`` (every parameter, the reference a second copy) and ``lora`` (rank-16 LoRA on
every linear layer with gradient checkpointing, the reference the same model with the adapter off); each mode adds
the peak GPU memory of each phase (generation, reference, update).
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

os.environ.setdefault("TQDM_DISABLE", "1")

QWEN2_05B = dict(hidden_size=896, num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
                 intermediate_size=4864, vocab_size=151_936, max_position_embeddings=4096, tie_word_embeddings=True)
CONFIGS = [("ddp", True), ("fsdp", True), ("ddp", False)]  # (resources.strategy, model.packed_forward)
# training modes (bench.real_size's): full fine-tuning, or LoRA rank 16 + gradient checkpointing
MODES = {"full": {}, "lora": {"lora": {"rank": 16, "alpha": 32.0}, "gradient_checkpointing": True, "lr": 1e-4}}


def parse_configs(text: str) -> list[tuple[str, bool]]:
    """``ddp:packed,fsdp:padded`` -> [("ddp", True), ("fsdp", False)]; "all": CONFIGS."""
    if text == "all":
        return list(CONFIGS)
    out = []
    for item in text.split(","):
        strategy, _, layout = item.partition(":")
        if layout not in ("packed", "padded"):
            raise SystemExit(f"bench.gpu_scale: --configs item {item!r} is not STRATEGY:packed|padded")
        out.append((strategy, layout == "packed"))
    return out


def build_model(folder: Path, layers: int, shape: str = "qwen2-0.5b") -> int:
    """Save a random model of ``shape`` (``qwen2-0.5b``, or a shape of ``rlcore init-model``) with the tiny char
    tokenizer; return its parameter count."""
    import torch

    if shape != "qwen2-0.5b":
        from rlcore.commands.init_model import SHAPES
        from rlcore.engine.tiny_model import build_char_tokenizer, build_tiny_model

        tok = build_char_tokenizer()
        model = build_tiny_model(tok, seed=0, **{**SHAPES[shape], "max_position_embeddings": 4096})
        model.save_pretrained(folder, safe_serialization=True)
        tok.save_pretrained(folder)
        return sum(p.numel() for p in model.parameters())
    from transformers import AutoConfig, AutoModelForCausalLM

    from rlcore.engine.tiny_model import build_char_tokenizer

    tok = build_char_tokenizer()
    config = AutoConfig.for_model("qwen2", **{**QWEN2_05B, "num_hidden_layers": layers},
                                  bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                                  pad_token_id=tok.pad_token_id)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(folder, safe_serialization=True)
    tok.save_pretrained(folder)
    return sum(p.numel() for p in model.parameters())


def peak_gpu_gib(runner) -> float:
    """Peak GPU memory allocated by torch in the rank's process since it started."""
    import ray

    def probe(worker):
        import torch

        return torch.cuda.max_memory_allocated() / 2**30

    return ray.get(runner.actor.workers[0].__ray_call__.remote(probe), timeout=60)


def engine_stats(runner) -> dict:
    """The rank's rollout engine counters (``StaticRolloutEngine.stats``; empty for the hf engine)."""
    import ray

    def probe(worker):
        return dict(getattr(worker.engine, "stats", {}))

    return ray.get(runner.actor.workers[0].__ray_call__.remote(probe), timeout=60)


def run_config(model_dir: Path, data: Path, strategy: str, packed: bool, args, engine: str = "static",
               mode: str = "full") -> dict:
    from rlcore.config import parse_config
    from rlcore.data.collate import prompt_batch
    from rlcore.data.schema import read_rows
    from rlcore.engine.model import load_tokenizer
    from rlcore.trainer.round.modes import running_round

    cfg = parse_config({
        "tracking": {"enabled": False}, "ray": {"num_cpus": os.cpu_count() or 8},
        "model": {"path": str(model_dir), "dtype": "bfloat16", "packed_forward": packed},
        "task": {"max_prompt_length": 16, "max_response_length": args.response_len},
        "resources": {"n_workers": 1, "cpus_per_worker": 4, "use_gpu": True, "strategy": strategy},
        "rollout": {"n": args.n, "engine": engine, "compile": args.compile},
        "actor": {"ppo_mini_batch_size": args.prompts, "micro_batch_size": args.micro, "lr": 1e-6, **MODES[mode]},
        "ppo": {"train_batch_size": args.prompts},
    }, "bench.gpu_scale")
    tok = load_tokenizer(model_dir)
    prompts = prompt_batch(read_rows(data), tok, 16, str(data))
    with running_round(cfg, init_dir=str(model_dir), tokenizer=tok, prompts=prompts, seed=0) as runner:
        rows = []
        for step in range(args.warmup + args.steps):
            start = time.perf_counter()
            m = runner.step(step)
            m["wall_s"] = time.perf_counter() - start
            rows.append(m)
            if step == 0:
                first_stats = engine_stats(runner)
        peak = peak_gpu_gib(runner)
        last_stats = engine_stats(runner)
    used = rows[args.warmup:]

    def med(key: str) -> float:
        return statistics.median(r[key] for r in used)

    phases = sorted({k for r in used for k in r if k.startswith("timing_s/") and k != "timing_s/step"})
    peaks = {k.removeprefix("perf/peak_mem_").removesuffix("_mib"): max(r[k] for r in rows) / 1024
             for k in rows[0] if k.startswith("perf/peak_mem_")}
    return {"strategy": strategy, "packed": packed, "engine": engine, "mode": mode, "s_per_step": med("wall_s"),
            "gen_share": statistics.median(r["timing_s/gen"] / r["timing_s/step"] for r in used),
            "captures": (first_stats.get("graph_captures"), last_stats.get("graph_captures")),
            "spread": (min(r["wall_s"] for r in used), max(r["wall_s"] for r in used)),
            "phases": {k.removeprefix("timing_s/"): med(k) for k in phases},
            "gen_tok_s": med("perf/gen_tokens_per_s"), "train_tok_s": med("perf/tokens_per_s"),
            "response_len": med("rollout/response_length"), "peak_gib": peak, "phase_peak_gib": peaks}


def render(results: list[dict], n_params: int, args, device: str) -> str:
    shape = "Qwen2-0.5B" if args.shape == "qwen2-0.5b" else args.shape.replace("qwen", "Qwen").replace("b", "B")
    lines = [f"# rlcore GRPO step on {device}", "",
             f"Random {shape}-shaped model ({n_params / 1e6:.0f}M parameters, {args.layers or 'all'} layers), bfloat16, "
             f"one rank (nccl), {args.prompts} prompts x {args.n} responses of {args.response_len} tokens, "
             f"one optimizer step per RL step, micro-batch {args.micro}; median of {args.steps} steps after "
             f"{args.warmup} warm-up. `python -m bench.gpu_scale --shape {args.shape} --modes {args.modes} "
             f"--engines {args.engines} --configs {args.configs}"
             f"{' --compile' if args.compile else ''}` reproduces it.", "",
             "| mode | engine | strategy | packed forward | s/step (min-max) | gen share | phases (s) | rollout tok/s | "
             "training tok/s | peak GPU GiB (gen, ref, update) | graph captures (after step 1, end) |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        phases = ", ".join(f"{k} {v:.2f}" for k, v in r["phases"].items() if v >= 0.005)
        captures = "-" if r["captures"][0] is None else f"{r['captures'][0]}, {r['captures'][1]}"
        per_phase = ", ".join(f"{r['phase_peak_gib'][k]:.1f}" for k in ("gen", "ref", "update")
                              if k in r["phase_peak_gib"])
        lines.append(f"| {r['mode']} | {r['engine']} | {r['strategy']} | {r['packed']} | {r['s_per_step']:.2f} ({r['spread'][0]:.2f}-"
                     f"{r['spread'][1]:.2f}) | {r['gen_share']:.0%} | {phases} | {r['gen_tok_s']:,.0f} | "
                     f"{r['train_tok_s']:,.0f} | {r['peak_gib']:.1f} ({per_phase}) | {captures} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.strip().splitlines()[0])
    p.add_argument("--shape", default="qwen2-0.5b", choices=("qwen2-0.5b", "qwen2.5-0.5b", "qwen2.5-1.5b"))
    p.add_argument("--modes", default="full", help="comma list of training modes: full, lora")
    p.add_argument("--layers", type=int, default=24, help="qwen2-0.5b only: layers kept")
    p.add_argument("--prompts", type=int, default=32)
    p.add_argument("--n", type=int, default=8)
    p.add_argument("--response-len", type=int, default=128)
    p.add_argument("--micro", type=int, default=64)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--engines", default="static", help="comma list of rollout engines (rollout.engine)")
    p.add_argument("--compile", action="store_true", help="rollout.compile: true")
    p.add_argument("--configs", default="all", help="all, or a comma list of STRATEGY:packed|padded")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    configs = parse_configs(args.configs)

    import torch

    from rlcore.data.schema import write_rows
    from rlcore.data.splits import build_splits

    if not torch.cuda.is_available():
        raise SystemExit("bench.gpu_scale: needs a CUDA GPU")
    device = torch.cuda.get_device_name(0)
    work = Path(tempfile.mkdtemp(prefix="rlcore-gpu-scale-"))
    n_params = build_model(work / "model", args.layers, args.shape)
    if args.shape != "qwen2-0.5b":
        args.layers = None
    data = work / "rl_train.parquet"
    write_rows(build_splits(task="arithmetic", seed=0, n_sft=1, n_rl=2048, n_test=1, min_digits=1, max_digits=2,
                            ops=("+",))["rl_train"], data)
    results = []
    for strategy, packed in configs:
        for engine in args.engines.split(","):
            for mode in args.modes.split(","):
                results.append(run_config(work / "model", data, strategy, packed, args, engine, mode))
                print(results[-1], flush=True)
    text = render(results, n_params, args, device)
    print(text)
    if args.out:
        Path(args.out).write_text(text)


if __name__ == "__main__":
    main()
