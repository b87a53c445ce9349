"""Options that interact, tested together: every pair of values of the options below appears in at least one real
tiny round on Ray workers (a pairwise covering array), and each round's step checks what its options promise.

The options: ``ppo.mode`` (sync, async), ``actor.lora.rank`` (off, on), the estimator's extra group (grpo: none, gae:
a critic, distill: a teacher), ``rollout.agent.loop`` (single_turn, tool), ``reward.model`` (off, on),
``actor.off_policy.correction`` (none, tis, mis, icepop), the policy loss family (vanilla: a clipped token ratio;
gspo: a sequence ratio; gpg: no ratio; dro: not homogeneous in the advantage; bypass_mode: the rollout's log-probs as
the old policy), ``ppo.async.schedule`` (free, fixed), ``ppo.async.partial_rollout`` (off, on),
``resources.strategy`` (ddp, fsdp) and ``model.packed_forward`` (on, off). Combinations rlcore refuses are left out
here and refused by config validation in one line naming both keys (tests/test_config.py): bypass_mode with an
off-policy correction; partial rollouts outside an asynchronous round, with the fixed schedule or with the tool loop.
A schedule only means something in an asynchronous round, so sync rows take the default one.

Starting worker processes is what costs time, so the rows are built in two levels: the options that shape the worker
groups (LoRA, critic, reward model, strategy, packed forward) take a covering array of their own, each of its
configurations one set of groups; every row of the full array then runs on its configuration's groups, as one
round runner (an asynchronous one starts its generator). The array is built greedily (:func:`covering_rows`), with
asynchronous rows (a generator process each) costing more than synchronous ones, so few are drawn.
"""

from __future__ import annotations

import itertools
import math
import zlib
from collections.abc import Callable, Sequence
from contextlib import ExitStack, nullcontext
from pathlib import Path

import pandas as pd
import pytest
import torch
from safetensors.torch import load_file

from rlcore.algos.losses import POLICY_LOSSES
from rlcore.config import parse_config
from rlcore.data.collate import prompt_batch
from rlcore.engine.model import ModelSpec, load_tokenizer
from rlcore.engine.reward_model import load_reward_model, save_reward_model
from rlcore.engine.tiny_model import materialize_tiny
from rlcore.rewards.rule import RULES
from rlcore.trainer.round.modes import running_async_round
from rlcore.trainer.loop.pool import start_pool
from rlcore.trainer.round.worker_groups import RoundWorkerGroups
from rlcore.trainer.round.modes import sync_round_runner
from rlcore.trainer.round.runner import RoundRunner

SOURCE = "test_option_pairs"
TOOLS = str(Path(__file__).parents[1] / "agents" / "tools_for_tests.py")

GROUP_OPTIONS = {"lora": (False, True), "extra_group": ("none", "critic", "teacher"), "reward_model": (False, True),
                 "strategy": ("ddp", "fsdp"), "packed": (True, False)}
RUN_OPTIONS = {"mode": ("sync", "async"), "agent": ("single_turn", "tool"),
               "correction": ("none", "tis", "mis", "icepop"),
               "loss": ("vanilla", "gspo", "gpg", "dro", "bypass_mode"), "schedule": ("free", "fixed"),
               "partial": (False, True)}
ESTIMATOR_OF = {"none": "grpo", "critic": "gae", "teacher": "distill"}


def supported(row: dict) -> bool:
    """What rlcore runs: bypass_mode corrects for the rollout policy itself (config refuses a correction with it);
    partial rollouts interrupt an asynchronous round's free-running, single-turn generators; sync rounds have no
    schedule."""
    if row.get("loss") == "bypass_mode" and row.get("correction", "none") != "none":
        return False
    if row.get("mode") == "sync" and row.get("schedule") == "fixed":
        return False
    return not row.get("partial") or (row.get("mode", "async") == "async" and row.get("schedule", "free") == "free"
                                      and row.get("agent", "single_turn") == "single_turn")


def covering_rows(options: dict[str, Sequence], allowed: Callable[[dict], bool],
                  cost: Callable[[dict], float] = lambda row: 1.0) -> list[dict]:
    """Rows over ``options`` in which every pair of values of two options that ``allowed`` admits together appears
    at least once: greedily, each next row the admitted one that covers the most pairs not yet covered per unit of
    ``cost`` (ties: the first in the options' order), until none is left. Deterministic."""
    names = list(options)
    candidates = [dict(zip(names, values)) for values in itertools.product(*(options[n] for n in names))]
    candidates = [c for c in candidates if allowed(c)]

    def pairs(row: dict) -> set:
        return {((a, row[a]), (b, row[b])) for a, b in itertools.combinations(names, 2)}

    todo = set().union(*(pairs(c) for c in candidates))
    rows = []
    while todo:
        best = max(candidates, key=lambda c: len(pairs(c) & todo) / cost(c))
        rows.append(best)
        todo -= pairs(best)
    return rows


def test_the_covering_array_covers_every_admitted_pair_and_only_admitted_rows():
    rows = covering_rows({"a": (0, 1, 2), "b": ("x", "y"), "c": (True, False)}, lambda r: not (r["a"] == 2 and r["c"]))
    assert all(not (r["a"] == 2 and r["c"]) for r in rows)
    seen = {frozenset({(k1, r[k1]), (k2, r[k2])}) for r in rows for k1, k2 in itertools.combinations(r, 2)}
    for (k1, v1s), (k2, v2s) in itertools.combinations({"a": (0, 1, 2), "b": ("x", "y"), "c": (True, False)}.items(), 2):
        for v1, v2 in itertools.product(v1s, v2s):
            if {k1: v1, k2: v2} != {"a": 2, "c": True}:
                assert frozenset({(k1, v1), (k2, v2)}) in seen, (k1, v1, k2, v2)


GROUP_CONFIGS = covering_rows(GROUP_OPTIONS, lambda r: True)
ROWS = covering_rows({"group": tuple(range(len(GROUP_CONFIGS))), **RUN_OPTIONS}, supported,
                     cost=lambda r: 4.0 if r["mode"] == "async" else 1.0)


def hash_reward(text: str, ground_truth: str) -> float:
    """A reward of the text alone with a spread in every group of a random tiny model's samples."""
    return (zlib.crc32(text.encode()) % 1000) / 1000.0


@pytest.fixture(scope="module", autouse=True)
def reward():
    RULES.register(SOURCE)(hash_reward)
    yield
    RULES._items.pop(SOURCE)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """The tiny policy, a reward model over it with a random head, a teacher (another seed), their tokenizer and the
    prompts."""
    base = tmp_path_factory.mktemp("policy")
    shape = {"arch": "llama", "hidden_size": 32, "num_layers": 1, "num_heads": 2, "intermediate_size": 64,
             "max_position_embeddings": 96}
    folder = materialize_tiny(base, seed=0, **shape)
    teacher = materialize_tiny(tmp_path_factory.mktemp("teacher"), seed=1, **shape)
    tok = load_tokenizer(folder)
    torch.manual_seed(3)
    rm = tmp_path_factory.mktemp("rm") / "rm"
    save_reward_model(load_reward_model(ModelSpec(str(folder)), torch.device("cpu"), frozen=True), rm, rank=0,
                      tokenizer=tok, stats={"mean": 0.5, "std": 0.3})
    rows = pd.DataFrame([{"data_source": SOURCE, "prompt": [{"role": "user", "content": f"{i}+{i}"}], "ability": "t",
                          "reward_model": {"style": "rule", "ground_truth": "0"},
                          "extra_info": {"split": "rl", "index": i, "question": f"{i}+{i}", "answer": ""}}
                         for i in range(8)])
    return folder, rm, tok, rows, teacher


def config(group: dict, run: dict, rm_dir: Path, teacher: Path):
    """The config of one row: one rank per group (the wrappers of either strategy run the same code at any world
    size; two-rank numerics are tests/engine/test_data_parallel.py's), a batch of 4 prompts x 2 samples, one
    optimizer step per RL step."""
    proximal = run["correction"] != "none"
    stale = proximal or run["partial"]  # partial rollouts need a newer version to come: max_staleness >= 1
    raw = {"ray": {"num_cpus": 2}, "tracking": {"enabled": False},
           "model": {"packed_forward": group["packed"]},
           "resources": {"n_workers": 1, "cpus_per_worker": 1, "strategy": group["strategy"]},
           "task": {"max_response_length": 24 if run["agent"] == "tool" else 5},
           "rollout": {"n": 2, "n_workers": 1,
                       "agent": ({"loop": "tool", "tools": [{"path": TOOLS, "name": "add"}], "max_turns": 2,
                                  "processes": 1} if run["agent"] == "tool" else {})},
           "algorithm": {"adv_estimator": ESTIMATOR_OF[group["extra_group"]]}, "distill": {"teacher": str(teacher)},
           "actor": {"ppo_mini_batch_size": 4, "lr": 0.01, "loss": {"name": run["loss"]},
                     "recompute_log_prob": proximal and run["mode"] == "sync",
                     "off_policy": {"correction": run["correction"], "low": 0.5, "high": 2.0, "cap": 2.0},
                     "lora": {"rank": 4 if group["lora"] else 0}},
           "ppo": {"train_batch_size": 4, "mode": run["mode"],
                   "async": {"max_staleness": 1 if stale else 0, "queue_size": 1, "schedule": run["schedule"],
                             "partial_rollout": run["partial"]}},
           "reward": {"model": {"path": str(rm_dir), "weight": 0.5}} if group["reward_model"] else {}}
    return parse_config(raw)


def policy_weights(runner: RoundRunner, folder: Path) -> dict[str, torch.Tensor]:
    runner.save(str(folder))
    files = sorted(folder.glob("*.safetensors"))
    return {k: v for f in files for k, v in load_file(str(f)).items()}


@pytest.mark.parametrize("index", range(len(GROUP_CONFIGS)), ids=lambda i: "-".join(
    f"{k}={v}" for k, v in GROUP_CONFIGS[i].items()))
@pytest.mark.integration
def test_every_row_of_a_group_configuration_trains(index, models, ray_local, tmp_path):
    folder, rm_dir, tok, prompt_rows, teacher = models
    group = GROUP_CONFIGS[index]
    rows = [r for r in ROWS if r["group"] == index]
    with ExitStack() as stack:
        first = config(group, {**rows[0], "mode": "sync", "agent": "single_turn", "correction": "none",
                               "loss": "vanilla", "schedule": "free", "partial": False}, rm_dir, teacher)
        pool = stack.enter_context(start_pool(first))
        groups = RoundWorkerGroups.start(first, pool, str(folder))
        stack.callback(groups.shutdown)
        for n, run in enumerate(rows):
            cfg = config(group, run, rm_dir, teacher)
            prompts = prompt_batch(prompt_rows, tok, 16, "rows")
            rounding = running_async_round(cfg, groups, init_dir=str(folder), tokenizer=tok, prompts=prompts, seed=n,
                                           steps=1) if run["mode"] == "async" else nullcontext(
                sync_round_runner(cfg, groups, tokenizer=tok, prompts=prompts, seed=n))
            with rounding as runner:
                before = policy_weights(runner, tmp_path / f"before{n}")
                m = runner.step(0)
                after = policy_weights(runner, tmp_path / f"after{n}")
            what = f"{group} {run}"
            assert all(math.isfinite(v) for v in m.values()), (what, {k: v for k, v in m.items()
                                                                     if not math.isfinite(v)})
            assert any(not torch.equal(before[k], after[k]) for k in before), f"{what}: the policy did not move"
            if group["lora"]:  # the adapter trains, the base it was saved over does not
                assert all("lora_" in k for k in before if not torch.equal(before[k], after[k])), what
            assert ("critic/vf_loss" in m) == (group["extra_group"] == "critic"), what
            assert ("distill/reverse_kl" in m) == (group["extra_group"] == "teacher"), what
            assert ("async/token_staleness_mean" in m) == run["partial"], what
            assert ("reward/rm/mean" in m) == group["reward_model"], what
            assert ("agent/turns" in m) == (run["agent"] == "tool"), what
            corrected = run["correction"] != "none"
            # the off-policy statistics come with every proximal policy that is not the rollout's: a correction's, or
            # a stale async batch's (partial rollouts run at max_staleness 1; correction none weighs every token 1);
            # a loss whose old policy is the behaviour policy (bypass_mode, correction none) has no proximal one
            proximal = not POLICY_LOSSES.get(run["loss"]).old_is_behaviour
            assert ("off_policy/is_weight_mean" in m) == (proximal and (corrected or (run["mode"] == "async"
                                                                                       and run["partial"]))), what
            if not corrected and "off_policy/is_weight_mean" in m:
                assert m["off_policy/is_weight_mean"] == m["off_policy/is_weight_max"] == 1.0, what
            assert ("async/staleness" in m) == (run["mode"] == "async"), what
            if run["loss"] == "bypass_mode":
                assert "actor/is_weight_mean" in m, what
