"""A stage's step metrics: to MLflow and the plot CSV every step (:class:`StepLog`), the divergence stop they decide
(:func:`stop_if_diverged`), and the timings of a step's phases (:func:`timer`)."""

from __future__ import annotations

import csv
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from rlcore.errors import TrainingDiverged


class StepLog:
    """Per-step metrics to MLflow and to a CSV (the stage's DVC plot), written every step: a row is
    appended, and the file rewritten only when a step brings a metric the header lacks."""

    def __init__(self, tracker, csv_path: str | Path | None):
        self.tracker = tracker
        self.path = Path(csv_path) if csv_path else None
        self.rows: list[dict[str, float]] = []
        self.columns: list[str] = []

    def log(self, step: int, metrics: dict[str, float]) -> None:
        row = {"step": step, **metrics}
        self.rows.append(row)
        self.tracker.log_metrics(metrics, step=step)
        if self.path is None:
            return
        new = [k for k in row if k not in self.columns]
        if new:  # always on the first row ("step" is new then)
            self.columns += new
            self._rewrite()
        else:
            with self.path.open("a", newline="") as f:
                csv.DictWriter(f, fieldnames=self.columns).writerow(row)

    def flush(self) -> None:
        """Write the tracker's buffered metrics now (before a step checkpoint)."""
        flush = getattr(self.tracker, "flush", None)
        if flush is not None:
            flush()

    def restore(self, rows: list[dict[str, float]], *, to_tracker: bool) -> None:
        """Continue after the rows of a resumed checkpoint: the CSV is written with them, and they go to
        the tracker only when ``to_tracker`` (a new MLflow run; a continued run already has them)."""
        self.rows = [dict(r) for r in rows]
        self.columns = list(dict.fromkeys(k for r in self.rows for k in r))
        if to_tracker:
            for r in self.rows:
                self.tracker.log_metrics({k: v for k, v in r.items() if k != "step"}, step=int(r["step"]))
        if self.path is not None and self.rows:
            self._rewrite()

    def _rewrite(self) -> None:
        assert self.path is not None
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with self.path.open("w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=self.columns)
            w.writeheader()
            w.writerows(self.rows)


def stop_if_diverged(rows: list[dict[str, float]], section: str, limit: int, shown: tuple[str, ...],
                     hint: str) -> None:
    """Raise :class:`~rlcore.errors.TrainingDiverged` when the last rows of a step log skipped ``limit`` or more
    optimizer steps of ``section`` in a row for a non-finite loss or gradient norm (``limit`` 0: never).

    The count is ``{section}/nonfinite_steps`` summed over the trailing rows that skipped any: exactly the
    consecutive skipped optimizer steps when those steps skipped all theirs (a diverged run); a row where
    ``section`` did not train (no such key: a critic warm-up step) neither counts nor ends the run. The count
    is a function of the logged rows, so a stage resumed from a step checkpoint (which restores them) counts
    on from where it was. The message names the last row's step, the ``shown`` metrics of the last row that
    skipped nothing, and the ``hint``."""
    if not limit:
        return
    key = f"{section}/nonfinite_steps"
    skipped, finite = 0, None
    for row in reversed(rows):
        if key not in row:
            continue
        if not row[key]:
            finite = row
            break
        skipped += int(row[key])
    if skipped < limit:
        return
    if finite is None:
        last = "no step before them was finite"
    else:
        last = f"last finite at step {int(finite['step'])}: " + ", ".join(
            f"{k}={finite[k]:.4g}" for k in shown if k in finite)
    raise TrainingDiverged(f"step {int(rows[-1]['step'])}: {skipped} consecutive optimizer steps skipped for a "
                           f"non-finite loss or gradient norm ({section}.max_nonfinite_steps: {limit}; {last}); "
                           f"{hint}")


@contextmanager
def timer(store: dict[str, float], name: str) -> Iterator[None]:
    start = time.perf_counter()
    yield
    store[f"timing_s/{name}"] = time.perf_counter() - start
