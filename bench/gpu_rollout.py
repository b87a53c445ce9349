"""Rollout throughput of the generation engines on one CUDA GPU, against the memory-bandwidth bound
(no Ray; not part of `make test` or `make bench`).

    python -m bench.gpu_rollout                        # Qwen2-0.5B shape, 256 rows x 256 tokens, markdown to stdout
    python -m bench.gpu_rollout --out rollout.md --no-compile
    python -m bench.gpu_rollout --smoke --device cpu   # a few seconds on a CPU: checks the script, not the speed

The model is a randomly initialised decoder with the shape of Qwen2-0.5B (``bench.gpu_scale.build_model``)
in bfloat16; ``--prompts`` distinct random prompts of 8-16 tokens, left-padded, each repeated ``--n``
times; EOS is -1, so every row runs to ``--new-tokens``; sampling at temperature 1. Each engine
(``hf``; ``static`` eager, with CUDA graphs, compiled with CUDA graphs) generates ``--warmup`` times, then
``--repeats`` timed times (``torch.cuda.synchronize`` around each call); the table gives the median.

The bound: the card's bandwidth (a device-to-device copy of 2 GiB, bytes read + written over the
time) and the fewest bytes a decode step must read: every weight a matmul uses once (lm_head included,
the embedding lookup not) plus every row's KV cache up to its current length; over all steps of a
generation, rows x new tokens / (bytes / bandwidth). The compute floor (2 x matmul parameters x rows
FLOPs per step, plus attention, at the rate of a measured 8192^3 bf16 matmul) is printed beside it.

Weight updates: ``load_weights`` of a perturbed state dict into the graphed (and compiled) engine, then
the graph captures before/after, the first sampled generate after the update against a steady one,
and greedy tokens after the update against the HF engine on its own model copy loaded with the same
weights; "argmax-consistent" is the share of greedy tokens that are (within 0.1 logit of) the argmax
of a plain teacher-forced HF forward with the new weights, for the engine's tokens and, as the
control, for the same engine's greedy tokens from before the update.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import tempfile
import time
from pathlib import Path

# Qwen2-shaped, small enough for a CPU smoke run (checks this script's logic only)
SMOKE = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             intermediate_size=128, vocab_size=512, max_position_embeddings=512, tie_word_embeddings=True)
MARGIN = 0.1  # logit margin of "argmax-consistent" (bf16 kernels differ by ~1e-2 on a logit of std ~0.6)


def sync(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure_bandwidth(device, n_bytes: int = 2**31) -> float:
    """Bytes read + written per second by a device-to-device copy of ``n_bytes`` (median of 20)."""
    import torch

    x = torch.randn(n_bytes // 2, dtype=torch.bfloat16, device=device)
    y = torch.empty_like(x)
    for _ in range(3):
        y.copy_(x)
    times = []
    for _ in range(20):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        y.copy_(x)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    del x, y
    return 2 * n_bytes / statistics.median(times)


def measure_matmul(device, n: int = 8192) -> float:
    """bf16 FLOP/s of an ``n``^3 matrix product on random data (median of 10 after 3 warm-ups)."""
    import torch

    a = torch.randn(n, n, dtype=torch.bfloat16, device=device)
    b = torch.randn(n, n, dtype=torch.bfloat16, device=device)
    for _ in range(3):
        a @ b
    times = []
    for _ in range(10):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        a @ b
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    del a, b
    return 2 * n**3 / statistics.median(times)


def decode_floor(model, lengths, new: int, bandwidth: float, flops: float) -> dict:
    """The fewest bytes and FLOPs of the decode steps of one generation (prefill not counted) and the
    tokens/s they allow at ``bandwidth`` and ``flops``."""
    cfg = model.config
    embed = model.get_input_embeddings().weight
    head = model.get_output_embeddings().weight
    unique = {p.data_ptr(): p for p in model.parameters()}
    # every weight once per step; the embedding table only where it is also the lm_head (tied)
    weights = [p for p in unique.values() if p.data_ptr() != embed.data_ptr() or embed.data_ptr() == head.data_ptr()]
    weight_bytes = sum(p.numel() * p.element_size() for p in weights)
    matmul_params = sum(p.numel() for p in weights if p.dim() == 2)
    n_kv = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    elem = embed.element_size()
    kv_per_token = cfg.num_hidden_layers * 2 * n_kv * head_dim * elem  # keys and values of one position
    rows = len(lengths)
    total_len = int(sum(lengths))
    # decode step t (t = 0 .. new-2) attends to a row's prompt + t + 1 positions
    steps = new - 1
    ctx_sum = sum(total_len + rows * (t + 1) for t in range(steps))
    kv_bytes = ctx_sum * kv_per_token
    total_bytes = steps * weight_bytes + kv_bytes
    attn_flops = 4 * cfg.num_attention_heads * head_dim * cfg.num_hidden_layers * ctx_sum
    total_flops = steps * 2 * matmul_params * rows + attn_flops
    tokens = rows * new
    return {"weight_bytes": weight_bytes, "kv_bytes_per_step": kv_bytes / max(steps, 1),
            "bytes_per_step": total_bytes / max(steps, 1), "mean_ctx": ctx_sum / max(steps * rows, 1),
            "bw_tok_s": tokens / (total_bytes / bandwidth), "flop_tok_s": tokens / (total_flops / flops)}


def random_prompts(n_prompts: int, n: int, vocab: int, pad: int, device, seed: int = 0):
    """``n_prompts`` distinct prompts of 8-16 ids in [7, vocab) (no special tokens), left-padded with
    ``pad``, each repeated ``n`` times (a group's rows together)."""
    import torch

    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(8, 17, (n_prompts,), generator=g)
    width = int(lengths.max())
    ids = torch.full((n_prompts, width), pad, dtype=torch.long)
    mask = torch.zeros((n_prompts, width), dtype=torch.long)
    for i, length in enumerate(lengths.tolist()):
        ids[i, width - length:] = torch.randint(7, vocab, (length,), generator=g)
        mask[i, width - length:] = 1
    return ids.repeat_interleave(n, 0).to(device), mask.repeat_interleave(n, 0).to(device)


def timed(engine, ids, mask, params, seed: int, device) -> tuple[float, dict]:
    import torch

    g = torch.Generator(device=device).manual_seed(seed)
    sync(device)
    start = time.perf_counter()
    out = engine.generate(ids, mask, params, g)
    sync(device)
    return time.perf_counter() - start, out


def replay_ms(engine, device, n: int = 20) -> float | None:
    """Milliseconds of one replay of the engine's largest captured decode step (the model forward alone,
    without sampling), at the positions of its last step; None without graphs."""
    import torch

    graphs = getattr(engine, "graphs", None)
    if not graphs or device.type != "cuda":
        return None
    graphed = graphs[max(graphs)]
    graphed.graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(n):
        graphed.graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / n


def perturbed(model, seed: int = 1) -> dict:
    """The model's state dict with every tensor moved by noise of its own spread (at least 0.05): tied
    entries stay one tensor's values."""
    import torch

    g = torch.Generator(device=next(model.parameters()).device).manual_seed(seed)
    new, by_ptr = {}, {}
    for k, v in model.state_dict().items():
        if v.data_ptr() not in by_ptr:
            scale = float(v.float().std()) if v.numel() > 1 else 0.0
            noise = torch.randn(v.shape, generator=g, device=v.device, dtype=torch.float32) * max(scale, 0.05)
            by_ptr[v.data_ptr()] = (v.float() + noise).to(v.dtype)
        new[k] = by_ptr[v.data_ptr()]
    return new


def argmax_consistency(model, ids, mask, responses, chunk: int = 8) -> tuple[float, float]:
    """Share of response tokens that are the argmax (and within MARGIN of the max logit) of ``model``'s
    teacher-forced forward over prompt + response."""
    import torch

    width, new = ids.shape[1], responses.shape[1]
    exact = near = 0
    with torch.inference_mode():
        for i in range(0, len(ids), chunk):
            full = torch.cat([ids[i:i + chunk], responses[i:i + chunk]], 1)
            m = torch.cat([mask[i:i + chunk], torch.ones_like(responses[i:i + chunk])], 1)
            pos = (m.cumsum(-1) - 1).clamp(min=0)
            logits = model(input_ids=full, attention_mask=m, position_ids=pos).logits[:, width - 1:width - 1 + new]
            logits = logits.float()
            top = logits.max(-1).values
            got = logits.gather(-1, responses[i:i + chunk, :, None]).squeeze(-1)
            exact += int((logits.argmax(-1) == responses[i:i + chunk]).sum())
            near += int((top - got <= MARGIN).sum())
            del logits
    return exact / responses.numel(), near / responses.numel()


def prefix_match(a, b) -> tuple[float, float, float]:
    """(share of rows whose first token agrees, mean length of the agreeing prefix, share of rows equal)."""
    eq = (a == b).long()
    prefix = eq.cumprod(-1).sum(-1).float()
    return float(eq[:, 0].float().mean()), float(prefix.mean()), float((prefix == a.shape[1]).float().mean())


def free(device) -> None:
    import torch

    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.strip().splitlines()[0])
    p.add_argument("--layers", type=int, default=24)
    p.add_argument("--prompts", type=int, default=32)
    p.add_argument("--n", type=int, default=8)
    p.add_argument("--new-tokens", type=int, default=256)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--engines", default="hf,static-eager,static-graphs,static-compile",
                   help="comma list of hf, static-eager, static-graphs, static-compile")
    p.add_argument("--no-compile", action="store_true", help="leave out static-compile")
    p.add_argument("--device", default="cuda")
    p.add_argument("--smoke", action="store_true", help="a tiny Qwen2-shaped model (checks the script on a CPU)")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)

    import torch

    from bench.gpu_scale import QWEN2_05B, build_model
    from rlcore.engine.model import load_causal_lm
    from rlcore.rollout import EngineSpec, SamplingParams, make_engine

    device = torch.device(args.device)
    if device.type == "cuda" and device.index is None and torch.cuda.is_available():
        device = torch.device("cuda", torch.cuda.current_device())  # set_device needs an index
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("bench.gpu_rollout: needs a CUDA GPU (or --smoke --device cpu)")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    dtype = "bfloat16"
    engines = [e for e in args.engines.split(",") if e and not (args.no_compile and e == "static-compile")]
    work = Path(tempfile.mkdtemp(prefix="rlcore-gpu-rollout-"))
    if args.smoke:
        import bench.gpu_scale as gs

        gs.QWEN2_05B = SMOKE  # build_model reads the module's shape
        args.layers = SMOKE["num_hidden_layers"]
        try:
            n_params = build_model(work / "model", args.layers)
        finally:
            gs.QWEN2_05B = QWEN2_05B
    else:
        n_params = build_model(work / "model", args.layers)
    log = lambda *a: print(*a, flush=True)  # noqa: E731
    log(f"model: {n_params / 1e6:.0f}M parameters, {args.layers} layers, {dtype}, on {name}")

    def load():
        return load_causal_lm(work / "model", dtype=dtype).to(device).eval()

    model = load()
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(work / "model")
    eos, pad = -1, tok.pad_token_id
    ids, mask = random_prompts(args.prompts, args.n, len(tok), pad, device)
    rows, new = ids.shape[0], args.new_tokens
    sampling = SamplingParams(max_new_tokens=new, temperature=1.0)
    greedy = SamplingParams(max_new_tokens=new, greedy=True)

    if device.type == "cuda":
        bandwidth, flops = measure_bandwidth(device), measure_matmul(device)
    else:
        bandwidth, flops = float("nan"), float("nan")
    floor = decode_floor(model, mask.sum(-1).tolist(), new, bandwidth, flops)
    log(f"bandwidth {bandwidth / 1e12:.2f} TB/s, bf16 matmul {flops / 1e12:.0f} TFLOP/s; per decode step: weights "
        f"{floor['weight_bytes'] / 1e9:.3f} GB + KV {floor['kv_bytes_per_step'] / 1e9:.3f} GB (mean context "
        f"{floor['mean_ctx']:.0f}); bound {floor['bw_tok_s']:,.0f} tok/s (bandwidth), {floor['flop_tok_s']:,.0f} "
        f"tok/s (compute)")

    specs = {"hf": EngineSpec("hf"), "static-eager": EngineSpec("static", compile=False, cuda_graphs=False),
             "static-graphs": EngineSpec("static", compile=False, cuda_graphs=True),
             "static-compile": EngineSpec("static", compile=True, cuda_graphs=True)}
    results, outputs, kept = [], {}, {}
    for key in engines:
        engine = make_engine(model, specs[key], eos_token_id=eos, pad_token_id=pad)
        try:
            first, seeded = timed(engine, ids, mask, sampling, 0, device)
            for i in range(args.warmup - 1):
                timed(engine, ids, mask, sampling, 1 + i, device)
            times = []
            for i in range(args.repeats):
                t, out = timed(engine, ids, mask, sampling, 100 + i, device)
                times.append(t)
        except Exception as e:  # noqa: BLE001 - a failing engine (e.g. compile) is reported, the others still run
            log(f"{key}: FAILED {type(e).__name__}: {e}")
            results.append({"engine": key, "error": f"{type(e).__name__}: {(str(e).splitlines() or [''])[0][:120]}"})
            del engine
            free(device)
            continue
        n_tokens = int(out["response_mask"].sum())
        assert n_tokens == rows * new, f"{key}: {n_tokens} tokens, expected {rows * new} (EOS -1 never stops)"
        med = statistics.median(times)
        stats = dict(getattr(engine, "stats", {}))
        r = {"engine": key, "first_s": first, "median_s": med, "spread": (min(times), max(times)),
             "tok_s": n_tokens / med, "frac_bound": n_tokens / med / floor["bw_tok_s"], "stats": stats,
             "step_ms": 1e3 * med / new, "replay_ms": replay_ms(engine, device)}
        results.append(r)
        outputs[key] = seeded["responses"]  # the first call (seed 0) of every engine, to compare across engines
        log(f"{key}: first call {first:.2f} s (minus a steady call: {first - med:.2f} s of capture/compilation), "
            f"median {med:.3f} s ({min(times):.3f}-{max(times):.3f}), {r['tok_s']:,.0f} tok/s, "
            f"{r['frac_bound']:.1%} of the bandwidth bound, stats {stats}")
        if key in ("static-graphs", "static-compile"):
            kept[key] = engine
        else:
            del engine
        free(device)
    if "hf" in outputs:
        for key, resp in outputs.items():
            if key != "hf":
                first, mean_prefix, equal = prefix_match(resp, outputs["hf"])
                log(f"seeded sampling, {key} vs hf: first token equal in {first:.1%} of rows, mean equal prefix "
                    f"{mean_prefix:.1f} tokens, rows fully equal {equal:.1%}")

    # weight updates: the graphed (compiled) engines' own model gets new weights in place
    updates = []
    new_state = perturbed(model) if kept else None
    old_state = {k: v.clone() for k, v in model.state_dict().items()} if kept else None
    if kept:
        ref = load()
        hf_ref = make_engine(ref, EngineSpec("hf"), eos_token_id=eos, pad_token_id=pad)
        hf_ref.load_weights(new_state)
        _, hf_new = timed(hf_ref, ids, mask, greedy, 0, device)
        hf_new = hf_new["responses"]
    for key, engine in kept.items():
        engine.load_weights(old_state)  # the engines share one model: each starts from the original weights
        _, before = timed(engine, ids, mask, greedy, 0, device)
        captures_before = engine.stats["graph_captures"]
        steady = statistics.median(timed(engine, ids, mask, sampling, 200 + i, device)[0] for i in range(2))
        engine.load_weights(new_state)
        first_after, _ = timed(engine, ids, mask, sampling, 300, device)
        _, after = timed(engine, ids, mask, greedy, 0, device)
        captures_after = engine.stats["graph_captures"]
        before, after = before["responses"], after["responses"]
        changed = float((before != after).any(-1).float().mean())
        first, mean_prefix, equal = prefix_match(after, hf_new)
        cons_after = argmax_consistency(ref, ids, mask, after)
        cons_stale = argmax_consistency(ref, ids, mask, before)
        cons_hf = argmax_consistency(ref, ids, mask, hf_new)
        u = {"engine": key, "captures": (captures_before, captures_after), "steady_s": steady,
             "first_after_s": first_after, "changed": changed, "first_equal": first, "mean_prefix": mean_prefix,
             "rows_equal": equal, "cons_after": cons_after, "cons_stale": cons_stale, "cons_hf": cons_hf}
        updates.append(u)
        log(f"update {key}: captures {captures_before} -> {captures_after}; generate {steady:.3f} s steady, "
            f"{first_after:.3f} s first after load_weights; greedy rows changed by the update {changed:.1%}; vs hf "
            f"with the new weights: first token {first:.1%}, mean equal prefix {mean_prefix:.1f}, rows equal "
            f"{equal:.1%}; argmax-consistent (exact, within {MARGIN}): after {cons_after[0]:.3f}/{cons_after[1]:.3f}, "
            f"hf {cons_hf[0]:.3f}/{cons_hf[1]:.3f}, stale control {cons_stale[0]:.3f}/{cons_stale[1]:.3f}")

    text = render(results, updates, floor, bandwidth, flops, n_params, args, name, rows, new)
    print(text)
    if args.out:
        Path(args.out).write_text(text)
    if any("error" in r for r in results):
        sys.exit(1)


def render(results, updates, floor, bandwidth, flops, n_params, args, name, rows, new) -> str:
    lines = [f"# rlcore rollout engines on {name}", "",
             f"Random Qwen2-0.5B-shaped model ({n_params / 1e6:.0f}M parameters, {args.layers} layers), bfloat16, "
             f"{rows} rows ({args.prompts} random prompts of 8-16 tokens x {args.n}) x {new} new tokens, "
             f"temperature 1, no EOS; median of {args.repeats} generate calls after {args.warmup} warm-up. "
             "`python -m bench.gpu_rollout` reproduces it.", "",
             f"Bound: copy bandwidth {bandwidth / 1e12:.2f} TB/s (read + write); per decode step "
             f"{floor['weight_bytes'] / 1e9:.3f} GB of weights + {floor['kv_bytes_per_step'] / 1e9:.3f} GB of KV cache "
             f"(mean context {floor['mean_ctx']:.0f}) -> **{floor['bw_tok_s']:,.0f} tok/s**. Compute floor at "
             f"{flops / 1e12:.0f} TFLOP/s (measured bf16 matmul): {floor['flop_tok_s']:,.0f} tok/s. Decode graph "
             f"replay: one replay of the largest captured step alone (the forward without sampling; the bound's "
             f"per-step time is {1e3 * floor['bytes_per_step'] / bandwidth:.2f} ms).", "",
             "| engine | tok/s | s per generate (min-max) | ms per token step | share of bandwidth bound | "
             "first call s | graph captures | decode graph replay ms |", "|---|---|---|---|---|---|---|---|"]
    for r in results:
        if "error" in r:
            lines.append(f"| {r['engine']} | failed: {r['error']} | | | | | | |")
            continue
        lines.append(f"| {r['engine']} | {r['tok_s']:,.0f} | {r['median_s']:.3f} ({r['spread'][0]:.3f}-"
                     f"{r['spread'][1]:.3f}) | {r['step_ms']:.2f} | {r['frac_bound']:.1%} | {r['first_s']:.2f} | "
                     f"{r['stats'].get('graph_captures', '-')} | "
                     f"{'-' if r['replay_ms'] is None else format(r['replay_ms'], '.2f')} |")
    if updates:
        lines += ["", "Weight update (`load_weights` of a perturbed state dict, then generate):", "",
                  "| engine | captures before -> after | steady s | first generate after update s | "
                  "greedy rows changed | vs hf (new weights): first token / mean equal prefix / rows equal | "
                  f"argmax-consistent (exact / within {MARGIN}): engine, hf, stale control |",
                  "|---|---|---|---|---|---|---|"]
        for u in updates:
            lines.append(f"| {u['engine']} | {u['captures'][0]} -> {u['captures'][1]} | {u['steady_s']:.3f} | "
                         f"{u['first_after_s']:.3f} | {u['changed']:.1%} | {u['first_equal']:.1%} / "
                         f"{u['mean_prefix']:.1f} / {u['rows_equal']:.1%} | {u['cons_after'][0]:.3f}/"
                         f"{u['cons_after'][1]:.3f}, {u['cons_hf'][0]:.3f}/{u['cons_hf'][1]:.3f}, "
                         f"{u['cons_stale'][0]:.3f}/{u['cons_stale'][1]:.3f} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
