"""The log-prob and entropy of an update at a real vocabulary: the plain tensor expressions against the chunked
function (``rlcore.engine.logits``), time and peak memory of forward + backward (not part of `make bench`).

    python -m bench.logits_memory                               # CUDA: [64, 128, 151,936] bfloat16 logits
    python -m bench.logits_memory --rows 4 --len 32 --vocab 32000   # a CPU-sized check of the same

The logits stand for an autocast forward's (bfloat16, requiring grad); each variant computes the sampled tokens'
log-probs and the entropy (with and without an entropy gradient) and backpropagates ``sum(lp) + 0.01 sum(H)``.
Peak is the memory above the logits themselves during the variant (CUDA: the caching allocator's peak; CPU: not
measured). Median of ``--repeat`` runs after one warm-up.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from rlcore.engine.logits import token_log_probs_and_entropy


def plain(logits, tokens, entropy_grad):
    """The expressions rlcore used before the chunked function (``SequenceModel`` at the last commit)."""
    z = logits.float() / 1.0
    lp = torch.log_softmax(z, -1).gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
    src = z if entropy_grad else z.detach()
    finite = torch.where(torch.isneginf(src), torch.zeros((), dtype=src.dtype, device=src.device), src)
    ent = torch.logsumexp(src, -1) - (torch.softmax(src, -1) * finite).sum(-1)
    return lp, ent


def chunked(logits, tokens, entropy_grad):
    return token_log_probs_and_entropy(logits, tokens, with_entropy=True, entropy_grad=entropy_grad)


def run_once(fn, logits, tokens, entropy_grad, device):
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    start = time.perf_counter()
    lp, ent = fn(logits, tokens, entropy_grad)
    loss = lp.sum() + 0.01 * ent.sum() if entropy_grad else lp.sum()
    loss.backward()
    if cuda:
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    peak = (torch.cuda.max_memory_allocated() - base) / 2**30 if cuda else float("nan")
    logits.grad = None
    return seconds, peak


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.strip().splitlines()[0])
    p.add_argument("--rows", type=int, default=64)
    p.add_argument("--len", type=int, default=128)
    p.add_argument("--vocab", type=int, default=151_936)
    p.add_argument("--repeat", type=int, default=5)
    args = p.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch.manual_seed(0)
    logits = torch.randn(args.rows, args.len, args.vocab, device=device, dtype=torch.bfloat16).requires_grad_()
    tokens = torch.randint(0, args.vocab, (args.rows, args.len), device=device)
    size_gib = logits.numel() * 2 / 2**30
    print(f"logits [{args.rows}, {args.len}, {args.vocab:,}] bfloat16 = {size_gib:.2f} GiB on {device}")
    print("| variant | entropy gradient | median s (fwd+bwd) | peak GiB above the logits |")
    print("|---|---|---:|---:|")
    for entropy_grad in (False, True):
        for name, fn in (("plain", plain), ("chunked", chunked)):
            run_once(fn, logits, tokens, entropy_grad, device)
            runs = [run_once(fn, logits, tokens, entropy_grad, device) for _ in range(args.repeat)]
            print(f"| {name} | {'yes' if entropy_grad else 'no'} | {statistics.median(r[0] for r in runs):.4f} | "
                  f"{max(r[1] for r in runs):.2f} |")


if __name__ == "__main__":
    main()
