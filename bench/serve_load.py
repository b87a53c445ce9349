"""Load test of ``rlcore serve``: requests/s and latency with request batching and without.

    make bench-serve                                    # the defaults below
    .venv/bin/python -m bench.serve_load                # params.yaml's model (the built-in tiny one), 64 clients
    .venv/bin/python -m bench.serve_load --model models/ppo/r1 --requests 512 --max-tokens 32
    .venv/bin/python -m bench.serve_load --out /tmp/r.md                  # quick look, RESULTS.md untouched

Starts ``rlcore serve`` as a child process on 127.0.0.1 (a free port; loopback only) twice: with batching,
then with ``--no-batching`` (every request its own engine call). Each time, ``--concurrency`` clients
(asyncio coroutines sharing one HTTP connection pool) send ``--requests`` chat completions between them,
each as soon as its previous answer came back: a short warm-up that is not measured, then ``--passes``
measured passes, of which the one least disturbed by other processes on the machine is reported. Prompts are
arithmetic questions like the task's; sampling at temperature 1 with no seed (seeded requests run alone
by design), so batched requests share engine calls. The server stops by itself at the end of each run.

Prints, and writes into ``--out`` as the section ``serve-load`` (``bench/sections.py``; ``make bench``
keeps it): requests/s, completion tokens/s, p50 and p99 latency, engine calls and rows per call for each
mode, the CPU that processes outside the benchmark used meanwhile, and batching/no-batching ratios.
The clients run on the same machine as the server and take their share of its cores.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import socket
import statistics
import subprocess
import sys
import time
from datetime import datetime
from pathlib import Path

import httpx2

from bench.monitor import LoadMeter
from bench.sections import write_section

BENCH_DIR = Path(__file__).resolve().parent
REPO_ROOT = BENCH_DIR.parent
SECTION = "serve-load"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.strip().splitlines()[0])
    p.add_argument("--model", default=None, help="model folder for rlcore serve (default: params model.path)")
    p.add_argument("--requests", type=int, default=384, help="measured requests per mode")
    p.add_argument("--concurrency", type=int, default=64, help="clients sending at once")
    p.add_argument("--warmup", type=int, default=64, help="requests before the measured ones (not measured)")
    p.add_argument("--passes", type=int, default=3,
                   help="measured passes per mode; the one least disturbed by other processes is reported")
    p.add_argument("--max-tokens", type=int, default=16, help="max_tokens of every request")
    p.add_argument("--max-batch-size", type=int, default=64, help="rlcore serve --max-batch-size (batching run)")
    p.add_argument("--serve-arg", action="append", default=[], metavar="ARG",
                   help="one more argument for rlcore serve in both runs, e.g. --serve-arg=--set=rollout.engine=hf")
    p.add_argument("--out", default=str(BENCH_DIR / "RESULTS.md"))
    p.add_argument("--startup-timeout", type=float, default=180.0, help="seconds to wait for the server")
    p.add_argument("--quiet-wait", type=float, default=60.0,
                   help="seconds each mode may wait, before it is measured, for other processes to go quiet")
    return p.parse_args(argv)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def question(i: int) -> list[dict]:
    a, b = (i * 37) % 100, (i * 53 + 11) % 100
    return [{"role": "user", "content": f"What is {a} + {b}?"}]


class Server:
    """``rlcore serve`` in a child process, up (``/health`` answers) when the constructor returns."""

    def __init__(self, args: argparse.Namespace, batching: bool):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [sys.executable, "-m", "rlcore", "serve", "--host", "127.0.0.1", "--port", str(self.port),
               "--log-level", "warning", "--max-batch-size", str(args.max_batch_size), *args.serve_arg]
        if args.model:
            cmd += ["--model", args.model]
        if not batching:
            cmd.append("--no-batching")
        self.cmd = cmd
        self.log = open(BENCH_DIR / "_work" / f"serve-{'batching' if batching else 'no-batching'}.log", "w")
        self.proc = subprocess.Popen(cmd, cwd=REPO_ROOT, stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + args.startup_timeout
        while True:
            if self.proc.poll() is not None:
                raise SystemExit(f"bench: rlcore serve exited with code {self.proc.returncode}; see {self.log.name}")
            try:
                self.health = httpx2.get(f"{self.url}/health", timeout=2).json()
                break
            except httpx2.TransportError:
                if time.monotonic() > deadline:
                    self.close()
                    raise SystemExit(f"bench: rlcore serve did not answer within {args.startup_timeout:.0f} s; "
                                     f"see {self.log.name}") from None
                time.sleep(0.2)

    def stats(self) -> dict:
        return httpx2.get(f"{self.url}/health", timeout=10).json()

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()


async def load(url: str, model: str, n_requests: int, concurrency: int, max_tokens: int, offset: int = 0
               ) -> tuple[float, list[float], int]:
    """Wall seconds, per-request latencies and completion tokens of ``n_requests`` chat completions
    sent by ``concurrency`` clients."""
    limits = httpx2.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    latencies: list[float] = []
    tokens = 0
    next_i = 0

    async with httpx2.AsyncClient(base_url=url, limits=limits, timeout=600) as http:
        async def client() -> None:
            nonlocal next_i, tokens
            while next_i < n_requests:
                i = next_i
                next_i += 1
                body = {"model": model, "messages": question(offset + i), "max_tokens": max_tokens, "temperature": 1.0}
                start = time.perf_counter()
                r = await http.post("/v1/chat/completions", json=body)
                latencies.append(time.perf_counter() - start)
                if r.status_code != 200:
                    raise SystemExit(f"bench: request {i} failed with {r.status_code}: {r.text}")
                tokens += r.json()["usage"]["completion_tokens"]

        start = time.perf_counter()
        await asyncio.gather(*(client() for _ in range(concurrency)))
        return time.perf_counter() - start, latencies, tokens


def one_pass(server: Server, meter: LoadMeter, args: argparse.Namespace, batching: bool) -> dict:
    """One measured pass of ``args.requests`` requests, after waiting for the machine to go quiet."""
    waited = meter.wait_quiet(args.quiet_wait)
    before = server.stats()
    meter.start()
    wall, lat, tokens = asyncio.run(load(server.url, before["model"], args.requests, args.concurrency,
                                         args.max_tokens))
    foreign = meter.stop()
    after = server.stats()
    calls = after["engine_calls"] - before["engine_calls"]
    q = statistics.quantiles(lat, n=100, method="inclusive")
    return {"mode": "batching" if batching else "no batching", "model": before["model"], "wall_s": wall,
            "rps": len(lat) / wall, "tokens_per_s": tokens / wall, "p50": statistics.median(lat), "p99": q[98],
            "calls": calls, "rows_per_call": (after["rows"] - before["rows"]) / max(calls, 1),
            "engine_s": after["engine_seconds"] - before["engine_seconds"], "foreign_cores": foreign,
            "quiet_wait_s": waited, "cmd": server.cmd}


def measure(args: argparse.Namespace, batching: bool) -> dict:
    """The server in one mode: warm-up, then ``args.passes`` passes; the one that other processes
    disturbed least (the least foreign CPU) is reported."""
    server = Server(args, batching)
    try:
        if args.warmup:
            asyncio.run(load(server.url, server.health["model"], args.warmup, args.concurrency, args.max_tokens,
                             offset=10_000))
        meter = LoadMeter([server.proc.pid])
        passes = [one_pass(server, meter, args, batching) for _ in range(args.passes)]
    finally:
        server.close()
    for i, p in enumerate(passes):
        print(f"bench: {p['mode']} pass {i + 1}: {p['rps']:.1f} requests/s, p50 {p['p50'] * 1000:.0f} ms, "
              f"other processes {p['foreign_cores']:.2f} cores", file=sys.stderr)
    return min(passes, key=lambda p: p["foreign_cores"])


def render(args: argparse.Namespace, runs: list[dict], argv: list[str]) -> str:
    from bench.machine import cpu_model

    on, off = runs
    rows = ["| mode | requests/s | completion tokens/s | p50 latency | p99 latency | engine calls | rows per call "
            "| engine busy | other processes' CPU |", "|---|---|---|---|---|---|---|---|---|"]
    for r in runs:
        rows.append(f"| {r['mode']} | {r['rps']:.1f} | {r['tokens_per_s']:.0f} | {r['p50'] * 1000:.0f} ms | "
                    f"{r['p99'] * 1000:.0f} ms | {r['calls']} | {r['rows_per_call']:.1f} | "
                    f"{r['engine_s'] / r['wall_s']:.0%} | {r['foreign_cores']:.2f} cores |")
    rows.append(f"| **batching / no batching** | **{on['rps'] / off['rps']:.2f}x** | "
                f"{on['tokens_per_s'] / off['tokens_per_s']:.2f}x | {on['p50'] / off['p50']:.2f}x | "
                f"{on['p99'] / off['p99']:.2f}x | | | | |")
    cmd = " ".join(["python -m bench.serve_load", *argv])
    opts = on["cmd"][on["cmd"].index("serve") + 1:]
    where = ("--port", "--host")  # a free port each run: not part of the recipe
    serve = " ".join(["rlcore serve", *(a for i, a in enumerate(opts) if a not in where and opts[i - 1] not in where)])
    return "\n".join([
        "# `rlcore serve` under load",
        "",
        f"Generated {datetime.now():%Y-%m-%d %H:%M} by `{cmd}` on {cpu_model()}, {os.cpu_count()} logical cores "
        "(clients and server on the same machine).",
        "",
        f"Model `{on['model']}`; {args.requests} measured chat completions per pass (after {args.warmup} warm-up; "
        f"of {args.passes} passes per mode, the one other processes disturbed least is shown), "
        f"max_tokens {args.max_tokens}, temperature 1, no seed; {args.concurrency} concurrent clients on 127.0.0.1. "
        f"Server: `{serve}` on 127.0.0.1 and a free port (batching), the same with `--no-batching`. "
        "Latency: request sent to answer read. "
        "Engine busy: share of the wall time the server spent inside engine calls. Other processes' CPU: cores "
        "used by processes outside the benchmark during the measurement (each pass first waits up to "
        f"{args.quiet_wait:.0f} s for less than 0.3); a busy machine lowers both modes' numbers.",
        "",
        *rows,
        "",
    ])


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    (BENCH_DIR / "_work").mkdir(exist_ok=True)
    runs = [measure(args, batching=True), measure(args, batching=False)]
    text = render(args, runs, argv)
    print(text)
    write_section(args.out, SECTION, text)


if __name__ == "__main__":
    main()
