"""Guarded reward functions (rlcore.rewards.guard): a sample whose function raises, hangs or kills its
process scores reward.error_score and is counted, the rest of the batch keeps its scores, and a batch
where every sample fails stops with one line naming the data_source and the first exception.

The faulty function below is registered for a test data_source while this module runs; the scoring
process imports this module to get it (as it would a user's reward module).
"""

from __future__ import annotations

import json
import os
import time

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from rlcore.config import parse_config
from rlcore.errors import ConfigError, UserError
from rlcore.rewards import guard
from rlcore.rewards.guard import RewardError, RewardScorer
from rlcore.rewards.rule import REWARD_FNS, compute_score

FAULTY = "test_faulty"
TIMEOUT_S = 0.5


def faulty_reward(text: str, ground_truth: str) -> float:
    """The number the text spells, except: "raise" raises, "hang" never returns, "exit" ends the process,
    "none" returns None."""
    if text == "raise":
        raise ValueError(f"cannot score {text!r}")
    if text == "hang":
        time.sleep(3600)
    if text == "exit":
        os._exit(3)
    if text == "none":
        return None  # type: ignore[return-value]
    return float(text)


@pytest.fixture(scope="module", autouse=True)
def faulty_source():
    REWARD_FNS.register(FAULTY)(faulty_reward)
    yield
    REWARD_FNS._items.pop(FAULTY)


def score(scorer: RewardScorer, texts: list[str], what: str = "a test batch") -> np.ndarray:
    return scorer.score([FAULTY] * len(texts), texts, ["0"] * len(texts), what=what)


def test_failing_samples_get_the_error_score_and_are_counted_while_the_rest_keep_theirs(capsys):
    scorer = RewardScorer(timeout_s=TIMEOUT_S, error_score=-1.0)
    texts = ["1", "raise", "0.25", "hang", "0.5", "none", "exit", "raise", "2"]
    np.testing.assert_array_equal(score(scorer, texts), [1, -1, 0.25, -1, 0.5, -1, -1, -1, 2])
    assert scorer.counts() == (4, 1)  # raise, none, exit, raise; hang
    err = capsys.readouterr().err
    # the first failure's traceback, from inside the function, once
    assert "warning: reward: 5 of 9 samples of a test batch failed" in err and "4 errors, 1 ran past" in err, err
    assert "test_guard.py" in err and "ValueError: cannot score 'raise'" in err and err.count("Traceback") == 1, err
    np.testing.assert_array_equal(score(scorer, ["none", "3"]), [-1, 3])
    assert scorer.counts() == (5, 1)
    assert capsys.readouterr().err == ""  # later failures are only counted


def test_a_hung_function_is_stopped_after_the_timeout():
    scorer = RewardScorer(timeout_s=TIMEOUT_S)
    score(scorer, ["1"])  # the scoring process is up
    hung = guard._SCORER.process
    start = time.monotonic()
    with pytest.raises(RewardError, match="all 1 samples of ppo step 3 failed"):
        score(scorer, ["hang"], what="ppo step 3")
    elapsed = time.monotonic() - start
    assert TIMEOUT_S <= elapsed < TIMEOUT_S + 1.0, elapsed  # 0.52 s on an idle machine
    assert hung.proc.returncode == -9  # SIGKILLed, not left sleeping
    assert scorer.counts() == (0, 1)


def test_a_batch_where_every_sample_fails_stops_with_one_line_naming_the_source_and_the_first_error():
    scorer = RewardScorer(timeout_s=TIMEOUT_S)
    with pytest.raises(RewardError) as info:
        score(scorer, ["raise", "none", "raise"], what="ppo step 7")
    msg = str(info.value)
    assert isinstance(info.value, UserError) and "\n" not in msg
    assert msg.startswith("all 3 samples of ppo step 7 failed in their reward function "
                          f"(data_source '{FAULTY}': 3 errors, the first ValueError: cannot score 'raise' "
                          "(test_guard.py:"), msg
    assert msg.endswith("in faulty_reward)); fix the function"), msg


def test_default_rewards_score_exactly_as_before_over_several_messages():
    """More samples than the scoring process takes per message (guard.CAPACITY), both built-in data
    sources, well-formed and malformed responses: the same floats as calling the functions directly."""
    rng = np.random.default_rng(0)
    n = guard.CAPACITY + 904
    sources = rng.choice(["arithmetic", "gsm8k"], n).tolist()
    numbers = rng.integers(-50, 120, n)
    shapes = ["{}", " {} ", "{}x", "#### {}", "so #### {:,}", "", "-{}", "#### {}.0"]
    texts = [shapes[i % len(shapes)].format(int(x)) for i, x in enumerate(numbers)]
    truths = [str(int(x) if i % 3 else int(x) + 1) for i, x in enumerate(numbers)]
    expected = [compute_score(ds, t, gt) for ds, t, gt in zip(sources, texts, truths)]
    scorer = RewardScorer()
    got = scorer.score(sources, texts, truths, what="defaults")
    assert got.dtype == np.float64 and got.tolist() == expected
    assert 0 < np.mean(expected) < 1 and scorer.counts() == (0, 0)


def test_a_lambda_registered_at_run_time_is_sent_by_value():
    REWARD_FNS.add("test_lambda", lambda text, gt: len(text) / 4)
    try:
        got = RewardScorer().score(["test_lambda"] * 2, ["ab", "abcdef"], ["", ""], what="lambda")
    finally:
        REWARD_FNS._items.pop("test_lambda")
    assert got.tolist() == [0.5, 1.5]


def test_an_unknown_data_source_is_a_key_error_naming_the_registered_ones():
    with pytest.raises(KeyError, match="arithmetic"):
        RewardScorer().score(["nope"], ["1"], ["1"], what="x")


@pytest.mark.parametrize("key, value", [("timeout_s", 0), ("timeout_s", float("inf")), ("error_score", float("nan"))])
def test_reward_params_are_checked(key, value):
    with pytest.raises(ConfigError, match=f"reward.{key}"):
        parse_config({"reward": {key: value}})


def test_rlcore_eval_scores_failures_with_the_params_error_score_and_reports_them(tmp_path, capsys):
    from rlcore.commands import main

    gen, out = tmp_path / "gen.parquet", tmp_path / "eval.json"
    pq.write_table(pa.Table.from_pylist([{"data_source": FAULTY, "reward_model": {"ground_truth": "0"},
                                          "responses": ["1", "raise", "0.5", "raise"]}]), gen)
    params = tmp_path / "params.yaml"
    params.write_text("reward: {error_score: 0.25}\n")
    assert main(["eval", "--generations", str(gen), "--k", "1", "--out", str(out), "--params", str(params)]) == 0
    res = json.loads(out.read_text())
    assert res["mean_reward"] == pytest.approx((1 + 0.25 + 0.5 + 0.25) / 4)
    assert (res["reward_errors"], res["reward_timeouts"]) == (2, 0)
    assert "ValueError: cannot score 'raise'" in capsys.readouterr().err
