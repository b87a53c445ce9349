import copy
import re

import numpy as np
import pandas as pd
import pytest

from rlcore.data.schema import make_row, read_rows, validate_rows, write_rows


def _rows(n=3):
    return [
        make_row(
            data_source="arithmetic",
            prompt_text=f"{i}+1",
            ability="math",
            ground_truth=str(i + 1),
            split="test",
            index=i,
            question=f"{i}+1",
            answer=str(i + 1),
        )
        for i in range(n)
    ]


def test_parquet_round_trip_keeps_nested_structure(tmp_path):
    rows = _rows()
    path = tmp_path / "deep" / "dir" / "test.parquet"
    write_rows(rows, path)
    df = read_rows(path)
    assert len(df) == 3
    row = df.iloc[1]
    assert isinstance(row["prompt"], list)
    assert row["prompt"] == [{"role": "user", "content": "1+1"}]
    assert row["reward_model"] == {"style": "rule", "ground_truth": "2"}
    assert row["extra_info"] == {"split": "test", "index": 1, "question": "1+1", "answer": "2"}
    assert df.to_dict("records") == rows


def test_validate_reads_a_dataframe_from_plain_pandas_parquet_and_finds_its_bad_row(tmp_path):
    # pandas returns list<struct> columns as numpy arrays, not lists: validation must look inside them, accepting
    # the good rows and naming the bad one (a message whose content is missing, an empty prompt)
    good = tmp_path / "good.parquet"
    write_rows(_rows(), good)
    frame = pd.read_parquet(good)
    assert isinstance(frame["prompt"].iloc[0], np.ndarray)  # the layout this test is about
    validate_rows(frame, str(good))
    for prompt, problem in [([{"role": "user", "content": "1+1"}, {"role": "assistant", "content": None}],
                             "missing field 'prompt[1].content'"),
                            ([], "field 'prompt' is an empty list; expected at least one message")]:
        rows = _rows()
        rows[1]["prompt"] = prompt
        bad = tmp_path / "bad.parquet"
        pd.DataFrame(rows).to_parquet(bad)  # pandas' own writer: no validation on the way
        with pytest.raises(ValueError, match=rf"^{re.escape(str(bad))}: row 1: {re.escape(problem)}$"):
            validate_rows(pd.read_parquet(bad), str(bad))


def test_missing_ground_truth_names_row_and_field():
    rows = _rows()
    del rows[2]["reward_model"]["ground_truth"]
    expected = r"^data/x\.parquet: row 2: missing field 'reward_model\.ground_truth'$"
    with pytest.raises(ValueError, match=expected):
        validate_rows(rows, "data/x.parquet")


def test_wrong_types_are_named():
    rows = _rows()
    bad_index = copy.deepcopy(rows)
    bad_index[0]["extra_info"]["index"] = "0"
    with pytest.raises(ValueError, match=r"row 0: field 'extra_info\.index' should be int, got str"):
        validate_rows(bad_index, "src")
    bad_prompt = copy.deepcopy(rows)
    bad_prompt[1]["prompt"] = "0+1"
    with pytest.raises(ValueError, match=r"row 1: field 'prompt' should be list, got str"):
        validate_rows(bad_prompt, "src")
    bad_message = copy.deepcopy(rows)
    bad_message[1]["prompt"] = [{"role": "user"}]
    with pytest.raises(ValueError, match=r"row 1: missing field 'prompt\[0\]\.content'"):
        validate_rows(bad_message, "src")


def test_missing_top_level_field():
    rows = _rows()
    del rows[1]["data_source"]
    with pytest.raises(ValueError, match=r"src: row 1: missing field 'data_source'"):
        validate_rows(pd.DataFrame(rows), "src")


def test_empty_rows_rejected():
    with pytest.raises(ValueError, match="no rows"):
        validate_rows([], "src")


def test_write_refuses_bad_rows(tmp_path):
    rows = _rows()
    rows[0]["ability"] = 3
    path = tmp_path / "bad.parquet"
    with pytest.raises(ValueError, match="row 0: field 'ability' should be str, got int"):
        write_rows(rows, path)
    assert not path.exists()


def test_missing_file_message(tmp_path):
    path = tmp_path / "missing.parquet"
    with pytest.raises(FileNotFoundError, match="dataset file not found: .*missing.parquet"):
        read_rows(path)
