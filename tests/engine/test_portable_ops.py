"""The portable kernels (rlcore/engine/portable_ops.py, csrc/portable_kernels.cpp), installed in this test process by
tests/conftest.py as in every process rlcore runs: each product element is one fused multiply-add chain, so every
instruction set, thread count and batch gives the same bits; the vector math is NumPy's; MKL is out of the step."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from fractions import Fraction

import numpy as np
import pytest
import torch

from rlcore.engine import portable_ops

from ..conftest import REPO_ROOT

pytestmark = pytest.mark.skipif(not portable_ops.installed(), reason="the portable kernels are not installed here")


def round_to_float32(x: Fraction) -> np.float32:
    """``x`` rounded to the nearest float32, ties to even (computed exactly, not through a double)."""
    guess = np.float32(float(x))
    candidates = [np.nextafter(guess, np.float32(-np.inf)), guess, np.nextafter(guess, np.float32(np.inf))]
    best = min(candidates, key=lambda c: (abs(Fraction(float(c)) - x),
                                          int(np.array(c, np.float32).view(np.int32)) & 1))
    return np.float32(best)


def fma_chain(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """The product as the kernels define it, from exact arithmetic: c = 0; c = round(a_ik * b_kj + c) for k in order."""
    out = np.zeros((a.shape[0], b.shape[1]), np.float32)
    for i in range(a.shape[0]):
        for j in range(b.shape[1]):
            c = np.float32(0)
            for k in range(a.shape[1]):
                c = round_to_float32(Fraction(float(a[i, k])) * Fraction(float(b[k, j])) + Fraction(float(c)))
            out[i, j] = c
    return out


def operands(m: int, k: int, n: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    scale = torch.exp2(torch.randint(-8, 9, (k, 1), generator=g).float())  # magnitudes that make rounding matter
    return torch.randn(m, k, generator=g) * scale.T, torch.randn(k, n, generator=g) * scale


@pytest.fixture
def kernels():
    """The kernels with settings a test may change (instruction set, threads), put back afterwards."""
    yield portable_ops
    portable_ops.install(1)


@pytest.mark.parametrize("m, k, n", [(5, 37, 9), (9, 13, 70)])  # the second: few rows, many columns (B^T A^T)
def test_each_element_is_one_fused_multiply_add_chain_in_order(m, k, n):
    a, b = operands(m, k, n)
    want = fma_chain(a.numpy(), b.numpy())
    assert np.array_equal(torch.mm(a, b).numpy(), want)
    assert np.array_equal(torch.mm(a, b.T.contiguous().T).numpy(), want)  # B as a linear layer's weight holds it


SHAPES = [(1, 1, 1), (3, 7, 5), (14, 256, 32), (15, 257, 33), (37, 600, 45), (200, 64, 300), (130, 1000, 17),
          (1, 64, 80), (7, 300, 150),  # few rows of any width: the small kernels over column chunks
          (64, 256, 300), (9, 70, 77), (128, 33, 1000), (40, 1, 65),  # 8-128 rows, > 64 columns: as C^T = B^T A^T
          (50, 64, 66), (300, 40, 100)]  # <= 128 columns: the small kernels over chunks of 64 (attention's products)


def products(shapes=SHAPES) -> list[bytes]:
    out = []
    for m, k, n in shapes:
        a, b = operands(m, k, n, seed=m + k + n)
        for x, y in ((a, b), (a.T.contiguous().T, b), (a, b.T.contiguous().T)):  # row- and column-major operands
            out.append(torch.mm(x, y).numpy().tobytes())
    return out


def test_every_instruction_set_and_thread_count_gives_the_same_bits(kernels):
    best = products()
    assert kernels.install(1) in kernels.ISAS
    for isa in ("avx2", "scalar"):
        kernels.install(1, isa)
        assert products() == best, isa
    for threads in (2, 3):
        kernels.install(threads)
        assert products() == best, threads


def test_the_blocking_does_not_change_the_bits():
    """What a CPU's caches would choose (how much of k, of the rows and of the columns each packed block holds)."""
    best = products()
    default = torch.ops.rlcore_portable.set_blocking(0, 0, 0)
    try:
        for kc, mc, nc in ((1, 14, 32), (7, 28, 64), (64, 14, 5000), (1000, 140, 96)):
            torch.ops.rlcore_portable.set_blocking(kc, mc, nc)
            assert products() == best, (kc, mc, nc)
    finally:
        torch.ops.rlcore_portable.set_blocking(*default)


def test_products_of_few_rows_give_the_same_bits_by_either_path():
    """8-128 rows by more than 64 columns of a transposed B go through C^T = B^T A^T, B read unpacked; the packed
    kernels (set_wide_rows(0)) and that path up to other row counts give the same bits."""
    best = products()
    default = torch.ops.rlcore_portable.set_wide_rows(-1)
    try:
        for rows in (0, 8, 1000):
            torch.ops.rlcore_portable.set_wide_rows(rows)
            assert products() == best, rows
    finally:
        torch.ops.rlcore_portable.set_wide_rows(default)


def test_products_of_few_columns_give_the_same_bits_by_either_path():
    """Up to 128 columns (attention's per-head products at a few dozen keys) go through the small kernels in chunks of
    64 columns; the packed and wide paths (set_small_cols(64), the route before) and the small kernels at any width
    give the same bits."""
    best = products()
    default = torch.ops.rlcore_portable.set_small_cols(-1)
    assert default == 128
    try:
        for cols in (0, 64, 100000):
            torch.ops.rlcore_portable.set_small_cols(cols)
            assert products() == best, cols
    finally:
        torch.ops.rlcore_portable.set_small_cols(default)


def test_a_row_or_column_does_not_depend_on_the_others_in_the_call():
    a, b = operands(300, 300, 200)
    full = torch.mm(a, b)
    assert torch.equal(torch.mm(a[17:40], b), full[17:40])
    assert torch.equal(torch.mm(a[5:6], b), full[5:6])
    assert torch.equal(torch.mm(a, b[:, 31:64]), full[:, 31:64])


def test_the_other_products_keep_torch_semantics():
    g = torch.Generator().manual_seed(1)
    a, b, v = torch.randn(6, 5, generator=g), torch.randn(5, 4, generator=g), torch.randn(5, generator=g)
    c, batch = torch.randn(6, 4, generator=g), torch.randn(3, 6, 5, generator=g)
    exact = a.double() @ b.double()
    close = {"rtol": 1e-5, "atol": 1e-6}
    torch.testing.assert_close(torch.addmm(c, a, b, beta=0.5, alpha=2.0).double(), 0.5 * c.double() + 2 * exact, **close)
    assert torch.isfinite(torch.addmm(torch.full((6, 4), float("nan")), a, b, beta=0)).all()  # beta 0 ignores NaN
    torch.testing.assert_close(torch.bmm(batch, b.expand(3, 5, 4)).double(), batch.double() @ b.double(), **close)
    torch.testing.assert_close(torch.mv(a, v).double(), a.double() @ v.double(), **close)
    torch.testing.assert_close(torch.dot(v, v).double(), v.double() @ v.double(), **close)
    torch.testing.assert_close(torch.nn.functional.linear(a, b.T, torch.ones(4)).double(), exact + 1, **close)
    out = torch.empty(0)
    torch.mm(a, b, out=out)
    assert torch.equal(out, torch.mm(a, b))
    assert torch.equal(torch.mm(a.bfloat16(), b.bfloat16()), torch.mm(a.bfloat16().float(), b.bfloat16().float())
                       .bfloat16())
    ints = torch.randint(-50, 50, (4, 7), generator=g)
    assert torch.equal(torch.mm(ints, ints.T), torch.from_numpy(ints.numpy() @ ints.numpy().T))


def test_gradients_flow_through_the_products():
    a, b = operands(8, 6, 5)
    a.requires_grad_(True)
    b.requires_grad_(True)
    torch.nn.functional.linear(a, b.T).pow(2).sum().backward()
    c = (a @ b).detach()
    torch.testing.assert_close(a.grad, 2 * c @ b.detach().T)
    torch.testing.assert_close(b.grad, 2 * a.detach().T @ c)


def ulps(x: torch.Tensor, exact: torch.Tensor) -> torch.Tensor:
    """How many float32 units in the last place ``x`` is from ``exact`` (float64)."""
    spacing = torch.from_numpy(np.spacing(exact.float().abs().numpy())).double()
    return (x.double() - exact).abs() / spacing


def test_the_vector_math_is_accurate_and_sqrt_exact():
    x = torch.randn(10_001, generator=torch.Generator().manual_seed(2)) * 6
    p = x.abs() + 1e-3
    for op, arg in ((torch.exp, x), (torch.log, p), (torch.tanh, x), (torch.log2, p), (torch.atan, x)):
        assert ulps(op(arg), op(arg.double())).max() <= 1.0, op.__name__  # SLEEF's u10: within 1.0 ulp
    assert np.array_equal(torch.sqrt(p).numpy(), np.sqrt(p.numpy()))  # correctly rounded: one right answer
    y, out = p.clone(), torch.empty(3)
    y.exp_()
    torch.exp(p, out=out)
    assert torch.equal(y, torch.exp(p)) and torch.equal(out, torch.exp(p))
    assert torch.exp(torch.arange(3)).dtype == torch.float32  # integers promote, as torch does


STEP = """
import hashlib, json, sys
from rlcore import kernels
kernels.pin("portable"); kernels.activate()
import torch
from transformers import LlamaConfig, LlamaForCausalLM
torch.manual_seed(0)
cfg = LlamaConfig(vocab_size=40, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  intermediate_size=128, max_position_embeddings=64, attn_implementation="sdpa")
model = LlamaForCausalLM(cfg)
opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=True)
ids = torch.randint(0, 40, (24, 20))
for _ in range(2):
    logits = model(input_ids=ids).logits
    logp = torch.log_softmax(logits, -1)
    loss = -(torch.exp(logp - logp.detach() + 0.01) * logp).mean() + 0.01 * torch.logsumexp(logits, -1).mean()
    loss.backward(); opt.step(); opt.zero_grad()
print(json.dumps(hashlib.sha256(b"".join(p.detach().numpy().tobytes() for p in model.parameters())).hexdigest()))
"""


def step_hash(env: dict[str, str]) -> str:
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("MKL_", "ATEN_", "RLCORE_CPU", "NPY_"))}
    done = subprocess.run([sys.executable, "-c", STEP], env={**clean, **env}, capture_output=True, text=True,
                          cwd=REPO_ROOT, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_a_training_step_does_not_depend_on_mkl_or_the_environment_of_the_other_libraries():
    """Two AdamW steps of a small Llama (products, attention, exp, logsumexp, sqrt) under MKL's other code paths and
    an environment that asks the other libraries for other kernels: the same parameters to the bit."""
    first = step_hash({"MKL_CBWR": "AVX512,STRICT", "ATEN_CPU_CAPABILITY": "avx512", "NPY_DISABLE_CPU_FEATURES": ""})
    assert step_hash({"MKL_ENABLE_INSTRUCTIONS": "SSE4_2", "RLCORE_PORTABLE_ISA": "avx2"}) == first


@pytest.mark.integration
def test_the_sft_stage_gives_one_model_whatever_differs_between_cpus_and_native_does_not():
    """bench.kernels at 40 SFT steps: every portable row (AVX2 and scalar products, another CPU's or the AVX-512
    code of PyTorch, MKL and oneDNN, two threads per rank) one model; native changes with the environment."""
    from bench import kernels as bench_kernels

    rows = bench_kernels.main(["--steps", "40"])
    portable = {r["model sha256"] for r in rows if r["cpu_kernels"] == "portable"}
    native = [r["model sha256"] for r in rows if r["cpu_kernels"] == "native"]
    assert len(portable) == 1 and len(native) == 2 and native[0] != native[1] and not portable & set(native), rows


def test_no_compiler_to_build_the_kernels_is_one_line_naming_the_setting(monkeypatch, tmp_path):
    from rlcore.errors import ConfigError

    monkeypatch.setattr(portable_ops, "library_path", lambda: tmp_path / "kernels.so")
    monkeypatch.setenv("CXX", "no-such-compiler")
    with pytest.raises(ConfigError, match="resources.cpu_kernels: native") as info:
        portable_ops.build()
    assert "\n" not in str(info.value) and "no-such-compiler" in str(info.value)
