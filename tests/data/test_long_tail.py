"""Long-tailed responses: a seeded share of arithmetic problems asks for filler before the number."""

import pytest

from rlcore.config import ConfigError, parse_config
from rlcore.data.arithmetic import (
    FILLER,
    LONG_MARKER,
    add_demonstrator_errors,
    add_long_tail,
    arithmetic_rows,
    available_problems,
    parse_question,
)
from rlcore.data.collate import encode_prompts, encode_responses
from rlcore.data.splits import build_splits
from rlcore.engine.tiny_model import build_char_tokenizer
from rlcore.errors import DataError
from rlcore.rewards.rule import arithmetic_reward

CONFIG = {"min_digits": 1, "max_digits": 2, "ops": ("+",)}
SPLIT_KW = dict(task="arithmetic", seed=3, n_sft=400, n_rl=300, n_test=100, **CONFIG)


def _is_long(row) -> bool:
    return row["extra_info"]["question"].endswith(LONG_MARKER)


def test_marker_and_filler_are_single_tokens_of_the_char_tokenizer():
    tok = build_char_tokenizer()
    for ch in (LONG_MARKER, FILLER):
        ids = tok(ch, add_special_tokens=False)["input_ids"]
        assert len(ids) == 1 and ids[0] != tok.unk_token_id


def test_fraction_drawn_is_close_to_the_param():
    rows = arithmetic_rows(4000, seed=2, split="rl_train", **CONFIG)
    for frac in (0.05, 0.3):
        _, n_long = add_long_tail(rows, frac, 24, seed=5)
        # binomial: 5 standard deviations
        assert abs(n_long - frac * len(rows)) < 5 * (len(rows) * frac * (1 - frac)) ** 0.5


def test_higher_fraction_marks_a_superset_and_draws_are_seeded():
    rows = arithmetic_rows(1000, seed=2, split="rl_train", **CONFIG)
    def long_idx(out):
        return {i for i, r in enumerate(out) if _is_long(r)}

    low, _ = add_long_tail(rows, 0.1, 24, seed=5)
    high, _ = add_long_tail(rows, 0.4, 24, seed=5)
    assert long_idx(low) < long_idx(high)
    assert add_long_tail(rows, 0.1, 24, seed=5) == (low, len(long_idx(low)))
    assert long_idx(add_long_tail(rows, 0.1, 24, seed=6)[0]) != long_idx(low)
    assert add_long_tail(rows, 0.0, 24, seed=5) == (rows, 0)


def test_frac_zero_gives_the_same_rows_as_without_the_param():
    kw = {**SPLIT_KW, "sft_carry_error_rate": 0.6}
    assert build_splits(**kw, long_tail_frac=0.0, long_tail_length=7) == build_splits(**kw)


@pytest.mark.parametrize("length", [1, 24])
def test_long_rows_have_the_marker_and_a_filler_demonstration(length):
    kw = {**SPLIT_KW, "sft_carry_error_rate": 0.6}
    plain = build_splits(**kw)
    long = build_splits(**kw, long_tail_frac=0.3, long_tail_length=length)
    for name in plain:
        n_long = 0
        for before, after in zip(plain[name], long[name], strict=True):
            question, answer = before["extra_info"]["question"], before["extra_info"]["answer"]
            assert after["reward_model"] == before["reward_model"]  # ground truth stays the number
            if _is_long(after):
                n_long += 1
                assert after["extra_info"]["question"] == question + LONG_MARKER
                assert after["prompt"][0]["content"] == before["prompt"][0]["content"] + LONG_MARKER
                # the demonstrated number: the truth, or the demonstrator's carry-free error on sft_train
                assert after["extra_info"]["answer"] == FILLER * length + answer
            else:
                assert after == before
        assert 0 < n_long < len(plain[name])
    # the long splits still never share a problem with test
    test_q = {r["extra_info"]["question"].rstrip(LONG_MARKER) for r in long["test"]}
    for name in ("sft_train", "rl_train"):
        assert not test_q & {r["extra_info"]["question"].rstrip(LONG_MARKER) for r in long[name]}


def test_marked_questions_parse_and_exclude_their_problem():
    assert parse_question("37+85" + LONG_MARKER, **CONFIG) == (37, "+", 85)
    assert available_problems(exclude={"37+85", "37+85" + LONG_MARKER}, **CONFIG) == 100 * 100 - 1
    exclude = {f"{a}+{b}{LONG_MARKER}" for a in range(100) for b in range(100) if (a, b) != (4, 5)}
    assert [r["extra_info"]["question"] for r in arithmetic_rows(1, seed=0, split="x", exclude=exclude, **CONFIG)] == ["4+5"]


def test_demonstrator_errors_keep_the_filler_of_a_long_row():
    rows, _ = add_long_tail(arithmetic_rows(200, seed=1, split="sft_train", **CONFIG), 1.0, 5, seed=0)
    out, changed = add_demonstrator_errors(rows, 1.0, seed=0)
    assert changed > 0
    for row in out:
        answer = row["extra_info"]["answer"]
        assert answer.startswith(FILLER * 5) and answer[5:].isdigit()


@pytest.mark.parametrize("response, truth, want", [
    (FILLER * 24 + "122", "122", 1.0),   # filler + correct
    (FILLER * 3 + "122", "122", 1.0),    # any filler count
    (" " + FILLER * 24 + "122\n", "122", 1.0),
    ("122", "122", 1.0),                 # bare number still fine
    (FILLER * 24 + "121", "122", 0.0),   # filler + wrong
    (FILLER * 10 + "#" + FILLER * 10 + "122", "122", 0.0),  # mixed filler
    ("#" * 24 + "122", "122", 0.0),      # another character as filler
    (FILLER * 12 + " 122", "122", 0.0),  # filler, space, number
    ("122" + FILLER * 3, "122", 0.0),    # filler after the number
    (FILLER * 24, "122", 0.0),           # filler only
])
def test_reward_scores_filler_then_number_by_the_number(response, truth, want):
    assert arithmetic_reward(response, truth) == want


def _cfg(**task):
    return parse_config({"task": task}, "test")


def test_too_short_max_response_length_is_a_config_error():
    with pytest.raises(ConfigError) as err:
        _cfg(long_tail_frac=0.1, long_tail_length=24, max_response_length=27)
    msg = str(err.value)
    assert "task.long_tail_frac" in msg and "task.max_response_length" in msg and ">= 28" in msg
    # 24 filler + 3 digits (99+99) + EOS fits exactly; frac 0 needs no room
    assert _cfg(long_tail_frac=0.1, long_tail_length=24, max_response_length=28).task.long_tail_frac == 0.1
    assert _cfg(long_tail_frac=0.0, max_response_length=6).task.long_tail_frac == 0.0
    # "*" on 2-digit operands: up to 4 answer digits
    with pytest.raises(ConfigError, match=">= 29"):
        _cfg(long_tail_frac=0.1, ops=["*"], max_response_length=28)


@pytest.mark.parametrize("key, value", [("long_tail_frac", 1.5), ("long_tail_frac", -0.1), ("long_tail_length", 0)])
def test_out_of_range_params_fail(key, value):
    with pytest.raises(ConfigError, match=key):
        _cfg(**{key: value, "max_response_length": 64})


def test_long_rows_fit_the_configured_lengths_after_tokenizing():
    tok = build_char_tokenizer()
    cfg = _cfg(long_tail_frac=0.5, long_tail_length=24, max_response_length=28).task
    splits = build_splits(**SPLIT_KW, long_tail_frac=cfg.long_tail_frac, long_tail_length=cfg.long_tail_length)
    rows = [r for rows in splits.values() for r in rows]
    encode_responses(tok, [r["extra_info"]["answer"] for r in rows], cfg.max_response_length, "x")
    encode_prompts(tok, [r["prompt"] for r in rows], cfg.max_prompt_length, "x")
    # the marker costs a prompt token: a limit one below the longest marked prompt is caught
    longest = max(len(r["prompt"][0]["content"]) for r in rows if _is_long(r))
    with pytest.raises(DataError, match="task.max_prompt_length"):
        encode_prompts(tok, [r["prompt"] for r in rows if _is_long(r)], longest + 3 - 1, "x")
