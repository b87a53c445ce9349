import json
import re
from pathlib import Path

import pandas as pd
import pytest

from rlcore.data.gsm8k import DEFAULT_INSTRUCTION, final_answer, gsm8k_rows
from rlcore.data.schema import validate_rows
from rlcore.data.splits import build_splits

RECORDS = [
    {"question": "Tom has 2 apples and buys 3. How many?", "answer": "2+3=<<2+3=5>>5\n#### 5"},
    {"question": "A car costs 1,000 dollars twice. Total?", "answer": "2*1000=2000\n#### 2,000"},
    {"question": "How much is 1234?", "answer": "It is 1,234.\n#### 1,234"},
    {"question": "Temperature drops 4 from 1?", "answer": "1-4=-3\n#### -3"},
]


def _write_jsonl(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    return path


def _write_parquet(path, records):
    pd.DataFrame(records).to_parquet(path)
    return path


@pytest.fixture(params=["jsonl", "parquet"])
def fixture_file(request, tmp_path):
    writer = _write_jsonl if request.param == "jsonl" else _write_parquet
    return writer(tmp_path / f"train.{request.param}", RECORDS)


def test_final_answer_strips_commas():
    assert final_answer("so #### 1,234") == "1234"
    assert final_answer("#### -3") == "-3"
    assert final_answer("no marker 42") is None


def test_rows_from_file(fixture_file):
    rows = gsm8k_rows(fixture_file, split="train")
    validate_rows(rows, str(fixture_file))
    assert [r["reward_model"]["ground_truth"] for r in rows] == ["5", "2000", "1234", "-3"]
    first = rows[0]
    assert first["data_source"] == "gsm8k"
    expected_prompt = RECORDS[0]["question"] + " " + DEFAULT_INSTRUCTION
    assert first["prompt"] == [{"role": "user", "content": expected_prompt}]
    assert first["extra_info"] == {
        "split": "train",
        "index": 0,
        "question": RECORDS[0]["question"],
        "answer": RECORDS[0]["answer"],
    }
    assert [r["extra_info"]["index"] for r in rows] == [0, 1, 2, 3]


def test_custom_instruction(tmp_path):
    path = _write_jsonl(tmp_path / "t.jsonl", RECORDS[:1])
    rows = gsm8k_rows(path, split="test", instruction="Answer:")
    assert rows[0]["prompt"][0]["content"] == RECORDS[0]["question"] + " Answer:"


def test_answer_without_marker_names_file_and_row(tmp_path):
    bad = RECORDS[:2] + [{"question": "q", "answer": "forty two"}]
    path = _write_jsonl(tmp_path / "bad.jsonl", bad)
    expected = r"bad\.jsonl: row 2 \(line 3\): expected 'answer' to end in '#### <number>'"
    with pytest.raises(ValueError, match=expected):
        gsm8k_rows(path, split="train")


def test_missing_field_names_file_and_row(tmp_path):
    path = _write_jsonl(tmp_path / "bad.jsonl", [RECORDS[0], {"question": "q"}])
    with pytest.raises(ValueError, match=r"bad\.jsonl: row 1 .*expected string field 'answer'"):
        gsm8k_rows(path, split="train")


def test_invalid_json_names_line(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps(RECORDS[0]) + "\n{not json\n", encoding="utf-8")
    with pytest.raises(ValueError, match=r"bad\.jsonl: row 1 \(line 2\): expected one JSON object"):
        gsm8k_rows(path, split="train")


def test_parquet_bad_row_names_file_and_row(tmp_path):
    path = _write_parquet(tmp_path / "bad.parquet", [RECORDS[0], {"question": "q", "answer": "#### "}])
    with pytest.raises(ValueError, match=r"bad\.parquet: row 1: expected 'answer'"):
        gsm8k_rows(path, split="train")


def test_missing_column(tmp_path):
    path = _write_parquet(tmp_path / "cols.parquet", [{"question": "q", "solution": "#### 1"}])
    with pytest.raises(ValueError, match=r"cols\.parquet: row 0: expected string field 'answer', got nothing"):
        gsm8k_rows(path, split="train")


def test_missing_file_and_unknown_suffix(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope.jsonl"):
        gsm8k_rows(tmp_path / "nope.jsonl", split="train")
    csv = tmp_path / "data.csv"
    csv.write_text("question,answer\n", encoding="utf-8")
    with pytest.raises(ValueError, match=r"data\.csv': unsupported file type '\.csv'; expected \.jsonl or \.parquet"):
        gsm8k_rows(csv, split="train")


def test_gsm8k_splits(tmp_path):
    train = _write_jsonl(tmp_path / "train.jsonl", RECORDS)
    test = _write_parquet(tmp_path / "test.parquet", RECORDS[1:])
    splits = build_splits(
        task="gsm8k", n_sft=2, n_rl=5, n_test=2, file={"train": str(train), "test": str(test)},
    )
    assert [r["extra_info"]["question"] for r in splits["sft_train"]] == [r["question"] for r in RECORDS[:2]]
    # Only 2 train rows remain after SFT, so rl_train gets both instead of 5.
    assert [r["extra_info"]["question"] for r in splits["rl_train"]] == [r["question"] for r in RECORDS[2:]]
    assert [r["extra_info"]["question"] for r in splits["test"]] == [r["question"] for r in RECORDS[1:3]]
    for name, rows in splits.items():
        labels = [(r["extra_info"]["split"], r["extra_info"]["index"]) for r in rows]
        assert labels == [(name, i) for i in range(len(rows))]


def test_gsm8k_sft_file_gives_the_demonstrations_and_train_all_its_rows_to_rl(tmp_path):
    """With task.file.sft the SFT split is that file's rows (their worked answers the demonstrations) and the RL
    prompts start at the train file's first row."""
    sft = _write_jsonl(tmp_path / "sft.jsonl", [{"question": "Q1?", "answer": "wrong\n#### 9"},
                                                {"question": "Q2?", "answer": "also\n#### 8"}])
    train = _write_jsonl(tmp_path / "train.jsonl", RECORDS)
    splits = build_splits(task="gsm8k", n_sft=5, n_rl=3, n_test=1,
                          file={"sft": str(sft), "train": str(train), "test": str(train)})
    assert [r["extra_info"]["question"] for r in splits["sft_train"]] == ["Q1?", "Q2?"]
    assert [r["extra_info"]["answer"] for r in splits["sft_train"]] == ["wrong\n#### 9", "also\n#### 8"]
    assert [r["extra_info"]["question"] for r in splits["rl_train"]] == [r["question"] for r in RECORDS[:3]]
    assert [r["reward_model"]["ground_truth"] for r in splits["rl_train"]] == ["5", "2000", "1234"]


def test_gsm8k_split_with_no_rows_left_fails(tmp_path):
    train = _write_jsonl(tmp_path / "train.jsonl", RECORDS)
    with pytest.raises(ValueError, match=r"train\.jsonl: no rows left for split 'rl_train'"):
        build_splits(
            task="gsm8k", n_sft=4, n_rl=1, n_test=1, file={"train": str(train), "test": str(train)},
        )


def test_gsm8k_takes_no_arithmetic_settings(tmp_path):
    train = _write_jsonl(tmp_path / "train.jsonl", RECORDS)
    with pytest.raises(TypeError, match="'ops'"):
        build_splits(task="gsm8k", n_sft=1, n_rl=1, n_test=1, ops=("+",),
                     file={"train": str(train), "test": str(train)})


def test_a_solution_whose_final_answer_is_right_is_not_a_wrong_demonstration(tmp_path):
    """prepare's ``sft_wrong_demonstrations`` judges a demonstration as the task's rule would: a GSM8K solution by its
    ``#### N`` (not by comparing the whole solution with N), a long-tailed arithmetic answer after its filler; a
    data_source without a rule by the text."""
    from rlcore.trainer.prepare import wrong_demonstration

    rows = gsm8k_rows(_write_jsonl(tmp_path / "train.jsonl", RECORDS), split="train")
    assert [wrong_demonstration(r) for r in rows] == [False] * 4
    off = {**rows[0], "extra_info": {**rows[0]["extra_info"], "answer": "2+3=6\n#### 6"}}
    assert wrong_demonstration(off)

    def row(source, answer, truth):
        return {"data_source": source, "extra_info": {"answer": answer}, "reward_model": {"ground_truth": truth}}

    assert [wrong_demonstration(row("arithmetic", a, "46")) for a in ("....46", "46", "45", "....45")] == \
        [False, False, True, True]
    assert [wrong_demonstration(row("my_task", a, "up")) for a in ("up", "up.")] == [False, True]
    assert wrong_demonstration(row("arithmetic", "46", "forty-six"))  # a truth the rule cannot read


def test_example_files_hold_no_calculation_twice():
    """examples/gsm8k/: the answers the reward checks (train, test) are right, the SFT file's are right or forget
    every carry or borrow (its annotator's slip, on some of the problems that carry or borrow), and no calculation
    (numbers and operation, whatever the names) appears twice across the files, so the recipe's test split cannot
    be passed by recalling a problem trained on."""
    folder = Path(__file__).resolve().parents[2] / "examples" / "gsm8k"
    seen, slips = set(), 0
    for name in ("sft", "train", "test"):
        for line in (folder / f"{name}.jsonl").read_text().splitlines():
            answer = json.loads(line)["answer"]
            a, op, b, c, final = re.fullmatch(r"(\d+) ([+-]) (\d+) = (\d+)\n#### (\d+)", answer).groups()
            assert c == final, answer
            right = int(a) + int(b) if op == "+" else int(a) - int(b)
            digits = [(int(x), int(y)) for x, y in zip(a.zfill(2), b.zfill(2))]
            no_carry = int("".join(str((x + y) % 10 if op == "+" else abs(x - y)) for x, y in digits))
            assert int(c) == right or (name == "sft" and int(c) == no_carry), (name, answer)
            slips += int(c) != right
            assert (op, a, b) not in seen, (name, answer)
            seen.add((op, a, b))
    assert len(seen) == 10500 and 1000 < slips < 2000
