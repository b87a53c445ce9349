"""Guarded reward functions (rlcore.rewards.guard, rlcore.rewards.scoring): a function that raises, returns a
non-score (text, NaN, infinity, a dict without 'score'), hangs or kills its process costs that one (function,
sample) pair, which scores reward.error_score and is counted per function, while everything else keeps its
score; functions from files, batched and async ones, and the built-in rules all go the same way; a batch where
every function fails everywhere stops with one line naming the function and its first error.

The user's functions live in ``user_rewards.py`` beside this file, imported by path in the scoring processes
as ``reward.functions`` entries are.
"""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from rlcore.config import parse_config
from rlcore.errors import ConfigError, UserError
from rlcore.rewards import functions as fns
from rlcore.rewards import guard
from rlcore.rewards.guard import TASKS_CAP, RewardError
from rlcore.rewards.rule import RULES, compute_score
from rlcore.rewards.scoring import RewardScorer, probe, samples_of

USER = str(Path(__file__).with_name("user_rewards.py"))
TIMEOUT_S = 0.5


def user(name: str, **kwargs) -> fns.RewardFunction:
    return fns.from_file(path=USER, name=name, **kwargs)


def rule(weight: float = 1.0) -> fns.RewardFunction:
    return fns.REWARD_FUNCTIONS.get("rule")(weight=weight)


def score(scorer: RewardScorer, texts: list[str], what: str = "a test batch", source: str = "words",
          truth: str = "0", extras=None):
    return scorer.score(samples_of([source] * len(texts), texts, [truth] * len(texts), extras), what=what)


def test_failures_score_error_score_and_are_counted_per_function_while_the_rest_keep_theirs(capsys):
    scorer = RewardScorer([user("faulty", kwargs={"bonus": 0.5}), user("length")], timeout_s=TIMEOUT_S,
                          error_score=-1.0, processes=2)
    texts = ["1", "raise", "0.25", "hang", "text", "nan", "inf", "nodict", "exit", "skip", "2"]
    r = score(scorer, texts)
    faulty = [1.5, -1, 0.75, -1, -1, -1, -1, -1, -1, np.nan, 2.5]  # skip: None, not applicable
    np.testing.assert_array_equal(r.values["faulty"], faulty)
    length = np.array([len(t) / 10 for t in texts])
    np.testing.assert_allclose(r.values["length"], length)
    np.testing.assert_allclose(r.total, np.nan_to_num(faulty) + length)  # weights 1, the None left out
    m = r.metrics()
    assert (m["reward/faulty/errors"], m["reward/faulty/timeouts"]) == (6, 1)  # raise text nan inf nodict exit; hang
    assert (m["reward/length/errors"], m["reward/errors"], m["reward/unscored"]) == (0, 6, 0)
    assert m["reward/faulty/mean"] == pytest.approx(np.nanmean(faulty))
    assert scorer.counts() == (6, 1) and scorer.by_function == {"faulty": [6, 1], "length": [0, 0]}
    err = capsys.readouterr().err
    assert "warning: reward: function 'faulty'" in err and "failed on 7 of 11 samples of a test batch" in err, err
    assert "user_rewards.py" in err and "ValueError: cannot score 'raise'" in err and err.count("Traceback") == 1, err
    score(scorer, ["raise", "3"])
    assert scorer.counts() == (7, 1) and capsys.readouterr().err == ""  # later failures are only counted


def test_extra_values_of_returned_dicts_are_logged_as_means():
    r = score(RewardScorer([user("faulty")], processes=2), ["1", "0.25", "skip", "2", "10"])
    m = r.metrics()
    assert m["reward/faulty/length"] == pytest.approx(np.mean([1, 4, 1, 2]))  # "skip" returned None
    assert "reward/faulty/label" not in m  # not a number: not logged


def test_each_samples_extra_values_land_at_its_own_position_across_processes_and_functions():
    """Two functions with an extra value of the same name over three processes, each skipping other samples (None, a
    failure): each function's values are where its own samples are, NaN elsewhere."""
    texts = ["1", "skip", "22", "raise", "333", "4", "skip", "55555", "6"]
    doubled = fns.from_callable("doubled", lambda ds, text, gt, extra: None if text in ("1", "4") else
                                {"score": 1.0, "length": 2.0 * len(text)})
    scorer = RewardScorer([user("faulty"), doubled], processes=3)
    r = score(scorer, texts)
    np.testing.assert_array_equal(r.extras["faulty"]["length"],
                                  [len(t) if t not in ("skip", "raise") else np.nan for t in texts])
    np.testing.assert_array_equal(r.extras["doubled"]["length"],
                                  [2.0 * len(t) if t not in ("1", "4") else np.nan for t in texts])
    assert list(r.extras["faulty"]) == list(r.extras["doubled"]) == ["length"]
    np.testing.assert_array_equal(r.values["faulty"][[0, 2, 4]], [1.0, 22.0, 333.0])


def test_what_each_bad_return_is_called():
    scorer = RewardScorer([user("faulty")], timeout_s=TIMEOUT_S)
    for text, needle in (("text", "returned 'high' (str), not a number"), ("nan", "returned nan, not a finite"),
                         ("inf", "returned inf, not a finite"), ("nodict", "returned a dict without 'score'")):
        with pytest.raises(RewardError, match=re.escape(needle)):
            probe(scorer, samples_of(["words"], [text], ["0"])[0], where="row 0")


def test_a_hung_function_is_stopped_after_the_timeout_and_its_process_killed():
    scorer = RewardScorer([user("faulty")], timeout_s=TIMEOUT_S, processes=1)
    score(scorer, ["1"])  # the scoring process is up
    hung = scorer.pool.slots[0]
    start = time.monotonic()
    r = score(scorer, ["hang", "2"])
    elapsed = time.monotonic() - start
    # 0.52 s on an idle machine, 1.7 s with the other core busy; a function left running would never return
    assert TIMEOUT_S <= elapsed < TIMEOUT_S + 4.0, elapsed
    assert hung.proc.returncode == -9  # SIGKILLed, not left sleeping
    assert r.values["faulty"].tolist() == [0.0, 2.0] and scorer.counts() == (0, 1)  # the next sample, in a new process


def test_a_batch_where_every_function_fails_everywhere_stops_with_one_line():
    scorer = RewardScorer([user("faulty")], timeout_s=TIMEOUT_S)
    with pytest.raises(RewardError) as info:
        score(scorer, ["raise", "text", "raise"], what="ppo step 7")
    msg = str(info.value)
    assert isinstance(info.value, UserError) and "\n" not in msg
    assert msg.startswith("all 3 samples of ppo step 7 failed in every reward function (the first: function "
                          f"'faulty' ({USER}:faulty): ValueError: cannot score 'raise' (user_rewards.py:"), msg
    assert msg.endswith("in faulty)); fix the function"), msg


def test_batched_and_async_functions_are_called_their_way():
    scorer = RewardScorer([user("lengths_batched", batched=True), user("slow_async"), user("wrong_length_batched",
                                                                                          batched=True)],
                          timeout_s=2.0, processes=2)
    n = 48
    texts = ["7" if i % 3 else "hang" for i in range(n)]
    start = time.monotonic()
    r = score(scorer, texts, truth="7", extras=[{"offset": 10} if i == 0 else {} for i in range(n)])
    elapsed = time.monotonic() - start
    assert r.values["lengths_batched"].tolist() == [14.0] + [len(t) for t in texts[1:]]  # extra_info reaches it
    # async: the hung samples time out alone (asyncio.wait_for), the others run at once: about one timeout of
    # 2 s in all, where one after the other they would take 48 * 0.3 s + 16 * 2 s
    assert r.status["slow_async"].tolist() == [guard.TIMED_OUT if i % 3 == 0 else guard.OK for i in range(n)]
    assert r.values["slow_async"][1] == 1.0 and elapsed < 8, elapsed
    assert (r.status["wrong_length_batched"] == guard.RAISED).all()  # a list of 1 score for 24 samples


def test_the_built_in_rules_score_exactly_as_called_directly_over_several_messages():
    """More (function, sample) pairs than a process takes per message (guard.TASKS_CAP), every built-in data
    source, well-formed and malformed responses: the same floats as calling the rules directly."""
    rng = np.random.default_rng(0)
    n = TASKS_CAP + 904
    sources = rng.choice(["arithmetic", "gsm8k"], n).tolist()
    numbers = rng.integers(-50, 120, n)
    shapes = ["{}", " {} ", "{}x", "#### {}", "so #### {:,}", "", "-{}", "#### {}.0"]
    texts = [shapes[i % len(shapes)].format(int(x)) for i, x in enumerate(numbers)]
    truths = [str(int(x) if i % 3 else int(x) + 1) for i, x in enumerate(numbers)]
    expected = [compute_score(ds, t, gt) for ds, t, gt in zip(sources, texts, truths)]
    scorer = RewardScorer(processes=1)
    r = scorer.score(samples_of(sources, texts, truths), what="defaults")
    assert r.total.dtype == np.float64 and r.total.tolist() == expected and r.acc.tolist() == expected
    assert 0 < np.mean(expected) < 1 and scorer.counts() == (0, 0)


def test_the_math_rule_accepts_equivalent_forms_and_rejects_wrong_answers():
    """math-verify in the scoring process (its signal.alarm timeouts need a main thread), gold answer first."""
    cases = [("0.5", "\\frac{1}{2}", 1.0), ("1/2", "0.5", 1.0), ("so \\boxed{\\frac{1}{2}}", "1/2", 1.0),
             ("The answer is $\\frac12$.", "0.5", 1.0), ("\\boxed{1+x}", "x+1", 1.0), ("1,000", "1000", 1.0),
             ("\\boxed{0.6}", "0.5", 0.0), ("\\boxed{0.333}", "\\frac13", 0.0), ("\\boxed{2} then 3", "3", 0.0),
             ("no answer here", "1", 0.0), ("", "1", 0.0)]
    r = RewardScorer(processes=1).score(samples_of(["math"] * len(cases), [c[0] for c in cases],
                                                   [c[1] for c in cases]), what="math")
    assert r.total.tolist() == [c[2] for c in cases]


def test_weights_the_rule_at_weight_0_and_accuracy():
    """The rule still decides accuracy where it applies (auto) when its weight is 0; elsewhere the first of
    the user's functions that applies does."""
    scorer = RewardScorer([rule(0.0), user("length", weight=2.0)], processes=1)
    r = scorer.score(samples_of(["arithmetic", "words", "nowhere"], ["46", "12345", "x"], ["46", "0", "0"]),
                     what="mixed")
    np.testing.assert_allclose(r.total, [0.0, 1.0, 0.0])  # arithmetic: rule 1 x 0 (length skips it)
    np.testing.assert_allclose(r.acc, [1.0, 0.5, 0.0])
    assert r.metrics()["reward/unscored"] == 1  # no function applies to "nowhere"


def test_a_rule_registered_at_run_time_is_sent_by_value():
    RULES.add("test_lambda", lambda text, gt: len(text) / 4)
    try:
        r = RewardScorer(processes=1).score(samples_of(["test_lambda"] * 2, ["ab", "abcdef"], ["", ""]), what="x")
    finally:
        RULES._items.pop("test_lambda")
    assert r.total.tolist() == [0.5, 1.5]


@pytest.mark.parametrize("spec, needle", [
    (dict(path="no_such_file.py", name="f"), "reward file no_such_file.py: not found"),
    (dict(path=__file__, name="no_such_function"), "test_guard.py has no function 'no_such_function' (it defines: "),
    (dict(path=USER, name="two_arguments"), "two_arguments(solution_str, ground_truth) cannot be called as fn("),
])
def test_a_function_that_cannot_be_used_is_one_line_naming_file_and_function(spec, needle):
    scorer = RewardScorer([fns.from_file(**spec)], timeout_s=TIMEOUT_S)
    with pytest.raises(RewardError) as info:
        probe(scorer, samples_of(["words"], ["1"], ["1"])[0], where="train.jsonl: row 0")
    msg = str(info.value)
    assert needle in msg and "train.jsonl: row 0" in msg and "\n" not in msg, msg


def test_a_file_that_does_not_import_names_the_error(tmp_path):
    bad = tmp_path / "broken.py"
    bad.write_text("import no_such_module_anywhere\n\ndef f(a, b, c, d):\n    return 1.0\n")
    with pytest.raises(RewardError, match=r"broken.py does not import: ModuleNotFoundError: No module named "
                                          r"'no_such_module_anywhere' \(broken.py:1"):
        probe(RewardScorer([fns.from_file(path=str(bad), name="f")]), ("words", "1", "1", {}), where="row 0")


def test_a_missing_file_opened_while_importing_is_an_import_error_not_a_missing_reward_file(tmp_path):
    bad = tmp_path / "reads_a_table.py"
    bad.write_text("open('no_such_table.csv')\n\ndef f(a, b, c, d):\n    return 1.0\n")
    with pytest.raises(RewardError, match=r"reads_a_table.py does not import: FileNotFoundError: .*no_such_table.csv"):
        probe(RewardScorer([fns.from_file(path=str(bad), name="f")]), ("words", "1", "1", {}), where="row 0")


@pytest.mark.parametrize("key, value", [("timeout_s", 0), ("timeout_s", float("inf")), ("error_score", float("nan"))])
def test_reward_params_are_checked(key, value):
    with pytest.raises(ConfigError, match=f"reward.{key}"):
        parse_config({"reward": {key: value}})


def test_rlcore_eval_scores_with_the_params_reward_functions_and_reports_failures(tmp_path, capsys):
    from rlcore.commands import main

    gen, out = tmp_path / "gen.parquet", tmp_path / "eval.json"
    pq.write_table(pa.Table.from_pylist([{"data_source": "words", "reward_model": {"ground_truth": "0"},
                                          "responses": ["1", "raise", "0.5", "raise"]}]), gen)
    params = tmp_path / "params.yaml"
    params.write_text(f"reward: {{error_score: 0.25, functions: [{{path: {USER}, name: faulty}}]}}\n")
    assert main(["eval", "--generations", str(gen), "--k", "1", "--out", str(out), "--params", str(params)]) == 0
    res = json.loads(out.read_text())
    assert res["mean_reward"] == pytest.approx((1 + 0.25 + 0.5 + 0.25) / 4)
    assert res["faulty/mean"] == res["mean_reward"] and res["pass@1"] == pytest.approx(0.25)  # "1" scores >= 1
    assert (res["reward_errors"], res["reward_timeouts"]) == (2, 0)
    assert "ValueError: cannot score 'raise'" in capsys.readouterr().err


def test_agreement_counts_the_correct_incorrect_pairs_ranked_right_within_each_group():
    from rlcore.rewards.scoring import agreement

    scores = np.array([3.0, 1, 2, 0, 1, 2, 3, 4, 5, 6, 7, 8])
    correct = np.array([1, 0, 1, 0, 1, 0, 0, 0, 0, 0, 0, 0], bool)
    assert agreement(scores, correct, 4) == pytest.approx(4 / 7)  # 4 of 4 pairs right, 0 of 3, no pair
    assert agreement(scores, np.zeros(12, bool), 4) is None
