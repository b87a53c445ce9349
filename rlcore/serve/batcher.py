"""Batching concurrent requests onto one rollout engine.

HTTP handlers run on the asyncio event loop; a generation is a blocking call of
:meth:`RolloutEngine.generate` that holds the model for its whole length. :class:`Batcher` sits between
them:

* a handler submits a :class:`Job` (token-id rows, one per completion wanted: a prompt repeated ``n``
  times; the sampling settings; an optional seed) and awaits its future;
* the scheduler task takes every job waiting, plans engine calls and runs them one at a time in a
  single worker thread, so the event loop keeps accepting requests while the model computes; jobs
  that arrive during a call wait for the next round and go in together. When a job finds the engine
  idle, the scheduler first waits ``wait_s`` (or until ``max_batch_rows`` rows wait) so that requests
  sent at the same moment share a call;
* a plan puts jobs with the same :class:`Sampling` (temperature, top-p, top-k, max tokens) into one
  call of at most ``max_batch_rows`` rows, in arrival order; a job is never split over calls;
* each job's future gets its own rows back (:class:`Rows`); an engine exception fails the futures of
  that call only, and the scheduler goes on with the next;
* at most ``max_waiting`` jobs wait for the engine (the call in progress aside): a job past that is refused at
  once with :class:`Busy`, which says when to try again, instead of growing the queue without bound; a job
  whose caller stopped waiting (a request timeout) leaves the queue, or, when its call already runs, its rows
  are dropped when the call ends.

**Seeds.** An unseeded job samples from the server's generator (seeded once, from params ``seed``),
shared with whatever else is in the same call, so its text depends on the traffic around it. A job
with a ``seed`` runs as its own engine call, with a generator seeded by ``seed`` alone: the same
prompt, settings and seed give the same tokens whatever else is in flight (on the same engine,
model and device), at the price of not sharing a call with other requests. A job with ``row_seeds`` (one per
row: the agent endpoint's, :mod:`rlcore.agents.endpoint`) shares calls with other such jobs of the same settings
whatever their ``max_tokens`` (the call generates the most any of them asks, and each job's rows are cut to its
own): each row is sampled from its own seed (the engines' ``seeds``), so its tokens do not depend on the call.

``batching=False`` makes every job its own engine call, for comparison (``bench/serve_load.py``).
"""

from __future__ import annotations

import asyncio
import math
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Callable, Iterator

import torch

from rlcore.rollout import RolloutEngine, SamplingParams


@dataclass(frozen=True)
class Sampling:
    """The settings that rows must share to go through one engine call."""

    max_tokens: int
    temperature: float
    """0 = greedy."""
    top_p: float = 1.0
    top_k: int = 0
    """0 = off."""

    def params(self) -> SamplingParams:
        """The engine's settings. Greedy rows report log-probs under ``softmax(logits)``, sampled rows
        under ``softmax(logits / temperature)`` (the distribution they were drawn from)."""
        greedy = self.temperature == 0
        return SamplingParams(max_new_tokens=self.max_tokens, temperature=1.0 if greedy else self.temperature,
                              top_p=self.top_p, top_k=self.top_k, greedy=greedy)


@dataclass(frozen=True)
class Rows:
    """What the engine generated for a job, row by row: the token ids (EOS last when it was generated)
    and each token's log-prob."""

    tokens: list[list[int]]
    log_probs: list[list[float]]
    prefixes: list | None = None
    """With ``keep_prefixes``: each row's :class:`~rlcore.rollout.base.CachedPrefix` (its keys and values at its end,
    which may run past the tokens it was cut to: an engine uses a prefix only as far as a later prompt matches)."""


class Busy(Exception):
    """The queue of waiting jobs is full; ``retry_after_s`` estimates when there will be room."""

    def __init__(self, waiting: int, retry_after_s: int):
        super().__init__(f"{waiting} requests are waiting for the engine")
        self.waiting, self.retry_after_s = waiting, retry_after_s


@dataclass(eq=False)
class Job:
    rows: list[list[int]]
    """Prompt token ids, one entry per completion (a prompt with ``n`` completions is here ``n`` times)."""
    sampling: Sampling
    seed: int | None
    future: asyncio.Future = field(repr=False)
    row_seeds: list[int] | None = None
    """Each row's own seed (module docstring)."""
    prefixes: list | None = None
    """Each row's :class:`~rlcore.rollout.base.CachedPrefix` to continue from, or None (engines with
    ``reuses_prefixes``)."""
    keep_prefixes: bool = False
    """Return each row's keys and values at its end (:attr:`Rows.prefixes`)."""

    def call_key(self) -> Sampling | tuple[str, Sampling]:
        """What the jobs of one engine call share: the settings (for row-seeded jobs, all but ``max_tokens``)."""
        if self.row_seeds is None:
            return self.sampling
        return "row_seeds", Sampling(0, self.sampling.temperature, self.sampling.top_p, self.sampling.top_k)


def _fits(call: list[Job], job: Job, max_rows: int, context_length: int | None) -> bool:
    """Whether ``job`` may join ``call``: the rows stay within ``max_rows``, and (row-seeded jobs, which run the most
    tokens any of them asks) the longest prompt plus those tokens within ``context_length``."""
    if sum(len(j.rows) for j in call) + len(job.rows) > max_rows:
        return False
    if context_length is None or job.row_seeds is None:
        return True
    jobs = [*call, job]
    longest = max(len(r) for j in jobs for r in j.rows)
    return longest + max(j.sampling.max_tokens for j in jobs) <= context_length


def plan(jobs: list[Job], max_rows: int, batching: bool = True, context_length: int | None = None
         ) -> Iterator[list[Job]]:
    """The engine calls for ``jobs``, each a list of jobs, in the order of their first job's arrival.

    Seeded jobs, and every job when not ``batching``, are calls of their own; other jobs share a call
    with earlier jobs of the same :class:`Sampling` while the call stays within ``max_rows`` rows (a
    job larger than that runs alone) and, for row-seeded jobs, ``context_length`` (:func:`_fits`)."""
    open_calls: dict[Sampling | tuple[str, Sampling], list[Job]] = {}
    calls: list[list[Job]] = []
    for job in jobs:
        if not batching or job.seed is not None:
            calls.append([job])
            continue
        call = open_calls.get(job.call_key())
        if call is None or not _fits(call, job, max_rows, context_length):
            call = open_calls[job.call_key()] = []
            calls.append(call)
        call.append(job)
    return iter(calls)


def left_pad(rows: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``[rows, longest]`` ids and attention mask, each row right-aligned (the engines' prompt layout)."""
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, width - len(r):] = torch.tensor(r, dtype=torch.long)
        mask[i, width - len(r):] = 1
    return ids, mask


class Batcher:
    """Runs submitted jobs on ``engine``, batched (see the module docstring). Start it on the event
    loop that will submit (:meth:`start`), and :meth:`stop` it there."""

    def __init__(self, engine: RolloutEngine, *, device: torch.device, pad_token_id: int, max_batch_rows: int = 64,
                 wait_s: float = 0.005, batching: bool = True, seed: int = 0, max_waiting: int = 128,
                 context_length: int | None = None, expected_rows: Callable[[], int] | None = None,
                 quiet_s: float | None = None):
        """``context_length``: row-seeded jobs share a call only while its longest prompt plus the most tokens any
        of them asks fit it. ``expected_rows()``: how many rows are worth waiting for when the engine was idle
        (default ``max_batch_rows``): the agent endpoint's count of running agents, with which the scheduler waits so
        before every call, not only when the engine was idle. ``quiet_s``: that wait (at most ``wait_s``) also ends
        once no job has come in for this long (both longer with ``expected_rows``: :meth:`patience`)."""
        self.engine = engine
        self.context_length, self.expected_rows, self.quiet_s = context_length, expected_rows, quiet_s
        self.device = device
        self.pad_token_id = pad_token_id
        self.max_batch_rows = max_batch_rows
        self.wait_s = wait_s
        self.batching = batching
        self.max_waiting = max_waiting
        self.generator = torch.Generator(device=device).manual_seed(seed)
        self.last_call_s = 0.0
        """Seconds the last engine call took."""
        self.stats = {"requests": 0, "engine_calls": 0, "rows": 0, "engine_errors": 0, "engine_seconds": 0.0,
                      "refused_busy": 0, "abandoned": 0}
        """Counters since start: jobs submitted, engine calls made, rows generated, calls that raised,
        seconds spent in the engine, jobs refused because the queue was full, jobs whose caller stopped waiting."""
        self._pending: deque[Job] = deque()
        self._arrived: asyncio.Event | None = None
        self._task: asyncio.Task | None = None
        self._executor: ThreadPoolExecutor | None = None

    async def start(self) -> None:
        self._arrived = asyncio.Event()
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="rlcore-engine")
        self._task = asyncio.create_task(self._schedule(), name="rlcore-batcher")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
            self._task = None
        while self._pending:
            job = self._pending.popleft()
            if not job.future.done():
                job.future.set_exception(RuntimeError("the server is shutting down"))
        if self._executor is not None:
            self._executor.shutdown(wait=True)
            self._executor = None

    @property
    def waiting(self) -> int:
        """Jobs waiting for an engine call (the call in progress aside)."""
        return len(self._pending)

    def retry_after_s(self) -> int:
        """Whole seconds until the waiting jobs have probably gone through the engine (at least 1): the calls they
        need, plus the one in progress, at the mean engine seconds per call so far."""
        calls = math.ceil(sum(len(j.rows) for j in self._pending) / self.max_batch_rows) + 1
        per_call = self.stats["engine_seconds"] / max(self.stats["engine_calls"], 1)
        return max(1, math.ceil(calls * per_call))

    async def generate(self, rows: list[list[int]], sampling: Sampling, seed: int | None = None,
                       row_seeds: list[int] | None = None, prefixes: list | None = None,
                       keep_prefixes: bool = False) -> Rows:
        """The engine's rows for these prompts (awaits the scheduler). Raises :class:`Busy` at once when
        ``max_waiting`` jobs are already waiting. Cancelled (the caller's timeout), the job leaves the queue.
        ``row_seeds``: one seed per row (module docstring). ``prefixes``, ``keep_prefixes``: the keys and values to
        continue each row from, and whether to return each row's (:class:`Job`; the engine must reuse prefixes)."""
        if row_seeds is not None and len(row_seeds) != len(rows):
            raise ValueError(f"{len(row_seeds)} row seeds for {len(rows)} rows")
        if prefixes is not None and len(prefixes) != len(rows):
            raise ValueError(f"{len(prefixes)} prefixes for {len(rows)} rows")
        if self._task is None or self._arrived is None:
            raise RuntimeError("Batcher.start() was not called")
        if self._task.done():  # a bug in the scheduler: surface it rather than hang
            self._task.result()
        if len(self._pending) >= self.max_waiting:
            self.stats["refused_busy"] += 1
            raise Busy(len(self._pending), self.retry_after_s())
        job = Job(rows, sampling, seed, asyncio.get_running_loop().create_future(), row_seeds, prefixes, keep_prefixes)
        self._pending.append(job)
        self.stats["requests"] += 1
        self._arrived.set()
        try:
            return await job.future
        except asyncio.CancelledError:
            self.stats["abandoned"] += 1
            if job in self._pending:  # not started: it leaves the queue (a running call's rows are dropped at its end)
                self._pending.remove(job)
            raise

    async def _schedule(self) -> None:
        assert self._arrived is not None
        loop = asyncio.get_running_loop()
        while True:
            idle = not self._pending
            while not self._pending:
                self._arrived.clear()
                await self._arrived.wait()
            # the engine was idle: give the jobs sent with this one a moment; with expected_rows, also when jobs
            # wait but fewer than expected (those that came late for the last call, while the others are answered)
            if self.batching and (idle or self.expected_rows is not None):
                await self._fill(loop)
            # a job stays in the queue (and counts as waiting) until its call starts
            for call in plan(list(self._pending), self.max_batch_rows, self.batching, self.context_length):
                for job in call:
                    if job in self._pending:
                        self._pending.remove(job)
                call = [job for job in call if not job.future.done()]  # a caller that stopped waiting is skipped
                if call:
                    await self._run(call)

    def patience(self) -> tuple[float, float | None]:
        """How long the wait for more jobs lasts at most, and how long it goes on once none comes in (None: to the
        end): ``wait_s`` and ``quiet_s``; with ``expected_rows``, each at least as long as the last engine call
        took. Rows that come later than the call go through a call of their own, which costs about a call more:
        waiting up to that long for them costs at most twice the best choice made knowing when they come. (Fixed
        short waits fail on a loaded machine, where the agents' processes may wait longer than ``quiet_s`` for a
        core, and answering the last call's requests takes longer than ``wait_s``.)"""
        if self.expected_rows is None:
            return self.wait_s, self.quiet_s
        return max(self.wait_s, self.last_call_s), None if self.quiet_s is None else max(self.quiet_s,
                                                                                          self.last_call_s)

    async def _fill(self, loop: asyncio.AbstractEventLoop) -> None:
        """Wait until the rows worth waiting for are pending (``expected_rows()``, else ``max_batch_rows``), or
        for as long as :meth:`patience` allows."""
        assert self._arrived is not None
        longest, quiet = self.patience()
        deadline = loop.time() + longest
        want = self.max_batch_rows if self.expected_rows is None else \
            max(1, min(self.max_batch_rows, self.expected_rows()))
        while sum(len(j.rows) for j in self._pending) < want:
            left = deadline - loop.time()
            if left <= 0:
                return
            self._arrived.clear()
            try:
                async with asyncio.timeout(min(left, quiet or left)):  # (a timeout scope: no task per wait)
                    await self._arrived.wait()
            except TimeoutError:
                return

    async def _run(self, call: list[Job]) -> None:
        rows = [r for job in call for r in job.rows]
        seed = call[0].seed
        generator = self.generator if seed is None else torch.Generator(device=self.device).manual_seed(seed)
        sampling, seeds = call[0].sampling, None
        if call[0].row_seeds is not None:  # the most tokens any job asks (each job's rows are cut to its own below)
            sampling = Sampling(max(j.sampling.max_tokens for j in call), sampling.temperature, sampling.top_p,
                                sampling.top_k)
            seeds = [s for job in call for s in job.row_seeds or ()]
        prefixes, keep = None, any(job.keep_prefixes for job in call)
        if keep or any(job.prefixes is not None for job in call):
            prefixes = [p for job in call for p in (job.prefixes or [None] * len(job.rows))]
        loop = asyncio.get_running_loop()
        self.stats["engine_calls"] += 1
        self.stats["rows"] += len(rows)
        start = time.perf_counter()
        try:
            out = await loop.run_in_executor(self._executor, self._generate, rows, sampling, generator, seeds,
                                             prefixes, keep)
        except Exception as err:  # noqa: BLE001 - the requests of this call fail, the server goes on
            self.stats["engine_errors"] += 1
            for job in call:
                if not job.future.done():
                    job.future.set_exception(err)
            return
        finally:
            self.last_call_s = time.perf_counter() - start
            self.stats["engine_seconds"] += self.last_call_s
        i = 0
        for job in call:
            n = len(job.rows)
            if not job.future.done():  # a cancelled request (client gone) is skipped
                cut = job.sampling.max_tokens if job.row_seeds is not None else None
                job.future.set_result(Rows([t[:cut] for t in out.tokens[i:i + n]],
                                           [lp[:cut] for lp in out.log_probs[i:i + n]],
                                           out.prefixes[i:i + n] if job.keep_prefixes and out.prefixes else None))
            i += n

    def _generate(self, rows: list[list[int]], sampling: Sampling, generator: torch.Generator,
                  seeds: list[int] | None = None, prefixes: list | None = None, keep: bool = False) -> Rows:
        """One engine call (in the worker thread): pad, generate, and cut each row at its mask."""
        ids, mask = left_pad(rows, self.pad_token_id)
        kwargs: dict = {} if seeds is None else {"seeds": seeds}  # (engines without per-row seeds never get any)
        if prefixes is not None:  # (nor engines that keep no prefixes)
            kwargs.update(prefixes=prefixes, keep_prefixes=keep)
        out = self.engine.generate(ids.to(self.device), mask.to(self.device), sampling.params(), generator=generator,
                                   **kwargs)
        lengths = out["response_mask"].sum(-1).tolist()
        tokens = out["responses"].cpu().tolist()
        log_probs = out["log_probs"].float().cpu().tolist()
        return Rows([t[:n] for t, n in zip(tokens, lengths)], [lp[:n] for lp, n in zip(log_probs, lengths)],
                    out.get("prefixes"))
