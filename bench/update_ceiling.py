"""Where one rank's update goes at answers that run to the limit, and how fast its matmuls could make it.

    .venv/bin/python -m bench.update_ceiling            # the `long` configuration's shape: section of bench/RESULTS.md
    .venv/bin/python -m bench.update_ceiling --hidden 512 --layers 4 --rows 64 --out /tmp/ceiling.md
    .venv/bin/python -m bench.update_ceiling --fused-ab 8   # the fused SwiGLU and rotary embedding against eager

One rank's share of a `long` step (``bench.settings.CONFIGS["long"]``: 256 answers of 50 tokens over two ranks, 8
per prompt, prompts of up to 16 tokens; an 8.45M-parameter Llama), on one thread as a rank runs
(``resources.cpus_per_worker: 1``), in this process, without Ray:

* the best fp32 GEMM rate of one thread at 1024 x 1024 x 1024 (the peak the update is held against) and at each shape
  the model's linear layers multiply in the update (T packed tokens: forward, input gradient, weight gradient);
* the update's compute (the packed forward of ``rlcore.engine``, the chunked log-probs with the logged entropy, a
  policy-gradient loss, backward, AdamW) and the reference's no-grad forward, median of ``--repeats``;
* one update with every operator call timed (:class:`OpTimes`): the matmul kernels' share of its wall time, their
  rate (FLOPs counted in another update under ``torch.profiler``'s ``with_flops``), attention's share, and the largest
  other ops. The floor is the update with every op but the matmuls taking no time: what fusing or removing the rest
  could reach at best.

``--fused-ab N`` measures instead the reference forward and the update ``N`` times each with rlcore's fused operators
(:mod:`rlcore.engine.fused`: the same bits) and with PyTorch's eager ones, alternating in this process, and prints the
medians (nothing written).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

from rlcore.kernels import activate, pin

# the CPU kernels a rank computes with: resources.cpu_kernels' default unless BENCH_KERNELS=native (chosen before
# torch is imported, as a rank does)
KERNELS = os.environ.get("BENCH_KERNELS", "portable")
pin(KERNELS)

import torch  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

from bench import machine
from bench.sections import write_section
from bench.settings import BENCH_DIR, WORK_DIR

SECTION = "update-ceiling"
MATMULS = ("aten::mm", "aten::addmm", "aten::bmm")
ATTENTION = "aten::_scaled_dot_product_flash_attention_for_cpu"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--intermediate", type=int, default=1024)
    p.add_argument("--rows", type=int, default=128, help="answers on the rank (the long step's 256 over 2 ranks)")
    p.add_argument("--n", type=int, default=8, help="answers per prompt (rollout.n)")
    p.add_argument("--prompt-len", type=int, default=16, help="the longest prompt (task.max_prompt_length)")
    p.add_argument("--response-len", type=int, default=50, help="every answer at the limit (task.max_response_length)")
    p.add_argument("--threads", type=int, default=1, help="torch threads (a rank's cpus_per_worker)")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--out", default=str(BENCH_DIR / "RESULTS.md"))
    p.add_argument("--fused-ab", type=int, default=0, metavar="N",
                   help="time the reference forward + update N times fused and N times eager, alternating")
    return p.parse_args(argv)


def argv_is_default(args: argparse.Namespace) -> bool:
    """Whether the shape measured is the `long` configuration's (the defaults), so its run can be read against."""
    defaults = parse_args([])
    keys = ("hidden", "layers", "heads", "intermediate", "rows", "n", "prompt_len", "response_len", "threads")
    return all(getattr(args, k) == getattr(defaults, k) for k in keys)


def median_s(fn, repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def build(args: argparse.Namespace):
    """(policy in train mode, frozen reference, the rank's batch) at the configured shape, random weights."""
    from rlcore.engine.model import load_causal_lm
    from rlcore.engine.tiny_model import materialize_tiny

    folder = materialize_tiny(WORK_DIR / "ceiling", seed=0, arch="llama", hidden_size=args.hidden,
                              num_layers=args.layers, num_heads=args.heads, intermediate_size=args.intermediate,
                              max_position_embeddings=max(128, args.prompt_len + args.response_len))
    policy = load_causal_lm(folder, packed_forward=True).train()
    reference = load_causal_lm(folder, packed_forward=True).eval().requires_grad_(False)
    gen = torch.Generator().manual_seed(1)
    vocab = policy.config.vocab_size
    prompts = args.rows // args.n
    ids = torch.randint(3, vocab, (prompts, args.prompt_len), generator=gen).repeat_interleave(args.n, 0)
    prompt_mask = torch.ones_like(ids)
    for p in range(prompts):  # left padding of different lengths, as the task's prompts have
        pad = p % (args.prompt_len // 3)
        prompt_mask[p * args.n:(p + 1) * args.n, :pad] = 0
    ids = ids * prompt_mask
    responses = torch.randint(3, vocab, (args.rows, args.response_len), generator=gen)
    batch = {"input_ids": torch.cat([ids, responses], 1),
             "attention_mask": torch.cat([prompt_mask, torch.ones_like(responses)], 1),
             "responses": responses, "advantages": torch.randn(args.rows, 1, generator=gen)}
    return policy, reference, batch


def workload(args: argparse.Namespace):
    """This process's kernels activated; (kernels, policy, batch, update, reference_forward) at the configured shape:
    ``update`` is one rank's packed forward, chunked log-probs with the logged entropy, backward and AdamW step,
    ``reference_forward`` the reference's no-grad forward over the same batch."""
    from rlcore.engine.sequence import local_model

    torch.manual_seed(0)
    kernels = activate(args.threads)
    policy, reference, batch = build(args)
    actor, ref = local_model(policy), local_model(reference)
    optim = torch.optim.AdamW(policy.parameters(), lr=1e-6)
    ids, mask, responses = batch["input_ids"], batch["attention_mask"], batch["responses"]

    def update() -> None:
        log_probs, _ = actor.response_log_probs(ids, mask, responses, with_entropy=True, entropy_grad=False)
        (-(log_probs * batch["advantages"]).mean()).backward()
        optim.step()
        optim.zero_grad(set_to_none=True)

    def reference_forward() -> None:
        with torch.no_grad():
            ref.response_log_probs(ids, mask, responses)

    return kernels, policy, batch, update, reference_forward


class OpTimes(TorchDispatchMode):
    """The wall time of every operator call below autograd (aten's and rlcore's own), summed by name in ``seconds``
    (and counted in ``calls``): each call's own time (an operator's inner calls do not come back through the mode).
    Not ``torch.profiler``'s: under it this process takes page faults again on memory it otherwise reuses (the
    cause inside the profiler not found), and the operator that first writes an output pays them (measured at the
    `long` shape: ``swiglu_backward`` 7 ms a call alone, 80-160 ms and 6,600-13,000 faults a call under the profiler,
    which then put 5.5-14% of the update there)."""

    def __init__(self):
        super().__init__()
        self.seconds: dict[str, float] = {}
        self.calls: dict[str, int] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        start = time.perf_counter()
        out = func(*args, **(kwargs or {}))
        name = func._schema.name
        self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - start
        self.calls[name] = self.calls.get(name, 0) + 1
        return out


def measure(args: argparse.Namespace) -> dict:
    from torch.profiler import ProfilerActivity, profile

    kernels, policy, batch, update, reference_forward = workload(args)
    ids, mask = batch["input_ids"], batch["attention_mask"]

    update_s = median_s(update, args.repeats)
    reference_s = median_s(reference_forward, args.repeats)
    # the ops' times from one update under OpTimes (not torch.profiler: see OpTimes), the matmuls' FLOPs from one
    # under the profiler (a count, which its cost does not change)
    with OpTimes() as timed:
        start = time.perf_counter()
        update()
        timed_s = time.perf_counter() - start
    with profile(activities=[ProfilerActivity.CPU], with_flops=True) as counted:
        update()
    matmul_flops = sum(e.flops for e in counted.key_averages() if e.key in MATMULS)
    times = timed.seconds
    matmul_s = sum(t for k, t in times.items() if k in MATMULS)
    attention_s = sum(t for k, t in times.items() if k.startswith(ATTENTION))
    others = sorted(((k, t) for k, t in times.items() if k not in MATMULS and not k.startswith(ATTENTION)),
                    key=lambda kt: -kt[1])[:8]

    from rlcore.engine import packed

    layout = packed.pack(ids, mask, args.response_len)
    tokens = int(layout.input_ids.numel()) if layout is not None else int(mask.sum())
    h, i = args.hidden, args.intermediate
    shapes = {f"T x {h} x {h} (attention projections)": (tokens, h, h, False),
              f"T x {h} x {i} (gate, up)": (tokens, h, i, False),
              f"T x {i} x {h} (down)": (tokens, i, h, False),
              f"{h} x T x {i} (a weight gradient)": (h, tokens, i, True)}
    return {
        "peak": machine.gemm_flops(1024, 1024, 1024, threads=args.threads, seconds=1.0) / 1e9,
        "shapes": {name: machine.gemm_flops(m, k, n, transposed=t, threads=args.threads, seconds=1.0) / 1e9
                   for name, (m, k, n, t) in shapes.items()},
        "tokens": tokens, "rows_tokens": int(mask.sum()), "params": sum(p.numel() for p in policy.parameters()),
        "update_s": update_s, "reference_s": reference_s, "timed_s": timed_s,
        "matmul_share": matmul_s / timed_s, "matmul_flops": matmul_flops, "matmul_s": matmul_s,
        "attention_share": attention_s / timed_s,
        "others": [(k, t / timed_s) for k, t in others], "kernels": kernels,
    }


def fused_ab(args: argparse.Namespace) -> str:
    """The reference forward + update with rlcore's fused operators and with the eager ones, alternating."""
    from rlcore.engine import fused

    kernels, _, _, update, reference_forward = workload(args)

    def step() -> None:
        reference_forward()
        update()

    checks = {"fused": (fused._fusable, fused._rotary_fusable),
              "eager": (lambda *a: False, lambda *a: False)}
    times: dict[str, list[float]] = {"fused": [], "eager": []}
    step()  # warm-up
    for i in range(args.fused_ab):
        for name in (("fused", "eager") if i % 2 == 0 else ("eager", "fused")):
            fused._fusable, fused._rotary_fusable = checks[name]
            start = time.perf_counter()
            step()
            times[name].append(time.perf_counter() - start)
    fused._fusable, fused._rotary_fusable = checks["fused"]
    f, e = statistics.median(times["fused"]), statistics.median(times["eager"])
    return (f"reference forward + update, {args.rows} answers of {args.response_len} tokens, hidden {args.hidden}, "
            f"{args.layers} layers, kernels {kernels}, medians of {args.fused_ab} alternating: fused {f:.3f} s, "
            f"eager {e:.3f} s, eager/fused {e / f:.3f}")


def render(r: dict, args: argparse.Namespace, took_s: float) -> str:
    rate = r["matmul_flops"] / r["matmul_s"] / 1e9
    floor_s = r["update_s"] * r["matmul_share"]  # the timing's own cost spread over the ops as their times are
    lines = [
        "# The update at answers that run to the limit: where one rank's time goes",
        "",
        f"Generated {datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC by "
        f"`{' '.join(['python -m bench.update_ceiling', *sys.argv[1:]])}` in {took_s:.0f} s. One rank's share of a "
        "`long` step: "
        f"{args.rows} answers of {args.response_len} tokens, {args.n} per prompt, prompts of up to "
        f"{args.prompt_len} tokens ({r['rows_tokens']:,} tokens in the rows, {r['tokens']:,} after the packed "
        f"forward runs each repeated prompt once); a Llama of {r['params'] / 1e6:.2f}M parameters (hidden "
        f"{args.hidden}, {args.layers} layers, intermediate {args.intermediate}); {args.threads} "
        f"thread{'s' if args.threads > 1 else ''}, as a rank runs; CPU kernels {r['kernels']} (GEMM rates below with "
        f"the same kernels; `BENCH_KERNELS=native` for the libraries' own); median of {args.repeats}.",
        "",
        "| measure | value |",
        "|---|---|",
        f"| one thread's fp32 GEMM at 1024 x 1024 x 1024, best of 1 s (the peak) | {r['peak']:.1f} GFLOP/s |",
    ]
    for name, gflops in r["shapes"].items():
        lines.append(f"| GEMM at the model's shape {name} | {gflops:.1f} GFLOP/s ({gflops / r['peak']:.0%}) |")
    lines += [
        f"| update: packed forward, chunked log-probs, backward, AdamW | {r['update_s']:.3f} s |",
        f"| reference forward (no grad) | {r['reference_s']:.3f} s |",
        f"| matmul kernels' share of the update's wall time (every op timed: {r['timed_s']:.3f} s) | "
        f"{r['matmul_share']:.0%} |",
        f"| their FLOPs and rate | {r['matmul_flops'] / 1e9:.0f} GFLOP at {rate:.1f} GFLOP/s "
        f"({rate / r['peak']:.0%} of the peak) |",
        f"| attention (sdpa's fused kernel; the portable kernels' attention is products, counted above) | "
        f"{r['attention_share']:.0%} |",
        f"| **floor: the update with every op but the matmuls free** | **{floor_s:.3f} s "
        f"({r['update_s'] / floor_s:.2f}x faster at best)** |",
        "",
        "The largest other ops of the update (share of its wall time): "
        + ", ".join(f"`{k}` {s:.1%}" for k, s in r["others"]) + ".",
    ]
    return "\n".join(lines)


def reading(r: dict, run: dict) -> str:
    """What the floor allows the whole step of the last `long` run of ``bench.run_bench`` (its
    ``last_run-long.json``): its update phase (the reference forward included, taken to be of the same make-up)
    with every op but the matmuls free, and the rest of the step as measured."""
    ours = [m for m in run["measured"]["ours"] if m.get("kind") == "step"]
    step = statistics.median(m["wall_s"] for m in ours)
    update = statistics.median(m["phases"]["update_actor"] for m in ours)
    trl = run["summary"]["trl"]["median_s"]
    rate, alone = r["matmul_flops"] / r["matmul_s"] / 1e9, list(r["shapes"].values())
    best = step - update * (1 - r["matmul_share"])
    need = step - trl / 2
    return (f"Against the last `long` run of `bench.run_bench` (bench/_work/last_run-long.json: ours {step:.2f} s a "
            f"step, {update:.2f} s of it the update phase with the reference forward; TRL {trl:.2f} s; TRL/ours "
            f"{trl / step:.2f}): were every op but the matmuls free in the update phase, a step would take "
            f"{best:.2f} s and TRL/ours be {trl / best:.2f} (the matmuls as they run now). TRL/ours 2.0 takes "
            f"{need:.2f} s off a step: "
            f"{need / (update * (1 - r['matmul_share'])):.0%} of the update phase's non-matmul time, if the "
            f"generation phase stays as it is. The matmuls ran at {rate / r['peak']:.0%} of the peak inside the "
            f"(timed) update, against {min(alone) / r['peak']:.0%}-{max(alone) / r['peak']:.0%} alone at its "
            f"shapes with their operands in cache: at the rate alone they would take "
            f"{r['matmul_flops'] / (sum(alone) / len(alone)) / 1e9:.2f} s of the update, not {r['matmul_s']:.2f} s.")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.fused_ab:
        print(fused_ab(args))
        return 0
    start = time.perf_counter()
    result = measure(args)
    text = render(result, args, time.perf_counter() - start)
    last = WORK_DIR / "last_run-long.json"
    if last.is_file() and argv_is_default(args):
        text += "\n\n" + reading(result, json.loads(last.read_text()))
    print(text)
    write_section(args.out, SECTION, text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
