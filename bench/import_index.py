"""What transformers' lazy-import table and the memory estimate's meta model cost a process, with and without the
files ``rlcore.import_index`` and ``rlcore.engine.footprint`` keep in rlcore's cache folder.

    .venv/bin/python -m bench.import_index              # 5 pairs of each kind: the "import-index" section
    .venv/bin/python -m bench.import_index --pairs 3 --out /tmp/index.md

The two kinds of child process of ``bench.heap`` (a ppo stage's driver without Ray, run as a stage script; an actor
rank's process up to its first call, started as a worker group starts it), each run alternately

* ``scan``: ``RLCORE_IMPORT_INDEX=0`` and an empty cache folder of its own, so transformers scans its models folder
  twice and the driver builds its meta model, as before these caches;
* ``cached``: one cache folder all ``cached`` children share (written by a child before the first pair).
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

from bench.heap import child, child_cpu_lines, rank_child, timing_rows
from bench.sections import write_section
from bench.settings import BENCH_DIR

SECTION = "import-index"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.strip().splitlines()[0])
    p.add_argument("--pairs", type=int, default=5, help="children of each kind, alternating (default 5)")
    p.add_argument("--out", default=str(BENCH_DIR / "RESULTS.md"), help="markdown file whose section to write")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    from rlcore.config import Config
    from rlcore.engine.tiny_model import materialize_tiny

    began = time.perf_counter()
    kinds = {"driver": {"scan": [], "cached": []}, "rank": {"scan": [], "cached": []}}
    with tempfile.TemporaryDirectory(prefix="bench-index-") as tmp:
        model_dir = str(materialize_tiny(Path(tmp) / "model", seed=0, **Config().model.tiny.model_dump()))
        shared = {"RLCORE_CACHE": f"{tmp}/cache", "RLCORE_IMPORT_INDEX": "1"}
        child(model_dir, f"{tmp}/warm.db", "heap", shared)  # writes the shared cache (and compiles the bytecode)

        def env(mode: str, tag: str) -> dict:
            return shared if mode == "cached" else {"RLCORE_CACHE": f"{tmp}/empty-{tag}", "RLCORE_IMPORT_INDEX": "0"}

        for i in range(args.pairs):
            for mode in ("scan", "cached") if i % 2 == 0 else ("cached", "scan"):
                for kind, run in (("driver", lambda: child(model_dir, f"{tmp}/{mode}{i}.db", "heap", env(mode, f"d{i}"))),
                                  ("rank", lambda: rank_child(model_dir, "heap", env(mode, f"r{i}")))):
                    r = run()
                    kinds[kind][mode].append(r)
                    print(f"{kind:6s} {mode:6s} cpu {r['cpu_s']:.2f} s wall {r['wall_s']:.2f} s", flush=True)
    lines = [
        "# transformers' lazy-import table and the model-shape count, from rlcore's cache",
        "",
        f"Generated {datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC by `python -m bench.import_index --pairs "
        f"{args.pairs}` in {time.perf_counter() - began:.0f} s on {os.cpu_count()} CPUs, the tiny built-in model. "
        "`bench.heap`'s two kinds of child (a ppo stage's driver without Ray, run as a stage script; an actor rank's "
        "process up to its first call), each run alternately with an empty cache folder and `RLCORE_IMPORT_INDEX=0` "
        "(`scan`: transformers reads its models folder twice, the driver builds a meta model) and with a warm one "
        "(`cached`); medians of each.",
        "",
        "| child | measure | scan | cached | cached/scan |",
        "|---|---|---|---|---|",
    ]
    for kind, results in kinds.items():
        lines += timing_rows(kind, results, "scan", "cached")[0]
    text = "\n".join(lines + child_cpu_lines(kinds, "scan", "cached"))
    print(text)
    write_section(args.out, SECTION, text)


if __name__ == "__main__":
    main()
