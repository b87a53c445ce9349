"""Malformed dataset files stop a stage at load time, before Ray starts, with one line naming the file,
the row and the field (the rows a PPO round, scoring and evaluation read: ``read_reward_rows`` and
``prompt_batch``). One case runs the real ``ppo`` stage to show the whole path: exit code 2, one line,
no Ray start."""

from __future__ import annotations

import copy
import subprocess
import sys
import time

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from rlcore.data.collate import prompt_batch
from rlcore.data.schema import make_row
from rlcore.errors import DataError
from rlcore.rewards.checks import read_reward_rows
from tests.conftest import REPO_ROOT

GOOD = make_row(data_source="arithmetic", prompt_text="12+30", ability="math", ground_truth="42", split="rl",
                index=0, question="12+30", answer="42")


def edited(change) -> dict:
    row = copy.deepcopy(GOOD)
    change(row)
    return row


def write(path, rows) -> str:
    pq.write_table(pa.Table.from_pylist(rows), path)
    return str(path)


@pytest.mark.parametrize("bad, words", [
    (edited(lambda r: r.pop("reward_model")), ["row 1", "missing field 'reward_model'"]),
    # a parquet column has one type: the index is a string in both rows, the first is reported
    (edited(lambda r: r["extra_info"].update(index="3")), ["row 0", "'extra_info.index' should be int, got str"]),
    (edited(lambda r: r["prompt"][0].update(content="  ")), ["row 1", "'prompt' has no text"]),
    (edited(lambda r: r["reward_model"].update(ground_truth="forty-two")),
     ["row 1", "'reward_model.ground_truth' is 'forty-two'", "an integer"]),
    (edited(lambda r: r.update(data_source="poetry")), ["row 1", "'data_source' is 'poetry'", "arithmetic"]),
])
def test_a_bad_row_is_one_error_naming_file_row_and_field(tmp_path, bad, words):
    first = edited(lambda r: r["extra_info"].update(index="0")) if isinstance(bad["extra_info"]["index"], str) else GOOD
    path = write(tmp_path / "rl.parquet", [first, bad])
    with pytest.raises(DataError) as err:
        read_reward_rows(path)
    message = str(err.value)
    assert message.startswith(path) and "\n" not in message
    assert all(w in message for w in words), message


def test_an_empty_file_and_a_file_that_is_not_parquet_are_named(tmp_path):
    empty = write(tmp_path / "empty.parquet", [])
    with pytest.raises(DataError, match="empty.parquet: no rows"):
        read_reward_rows(empty)
    text = tmp_path / "rl.parquet"
    text.write_text("question,answer\n1+1,2\n")
    with pytest.raises(DataError, match="rl.parquet: not a readable parquet file"):
        read_reward_rows(str(text))


def test_a_prompt_longer_than_the_limit_names_the_row(tmp_path, tiny_tokenizer):
    long = edited(lambda r: r["prompt"][0].update(content="1+" * 20 + "1"))
    path = write(tmp_path / "rl.parquet", [GOOD, long])
    with pytest.raises(DataError, match=r"rl.parquet: row 1: prompt is \d+ tokens .* task.max_prompt_length is 16"):
        prompt_batch(read_reward_rows(path), tiny_tokenizer, 16, path)


def test_the_ppo_stage_stops_before_ray_with_one_line(tmp_path, tiny_model_dir):
    data = write(tmp_path / "rl.parquet", [GOOD, edited(lambda r: r["reward_model"].update(ground_truth="x"))])
    init = tiny_model_dir
    params = tmp_path / "params.yaml"
    params.write_text("tracking: {enabled: false}\n")
    start = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "stages.ppo", "--params", str(params), "--round", "r1", "--init",
                           str(init), "--data", data, "--rewards", str(tmp_path), "--out", str(tmp_path / "out"), "--metrics",
                           str(tmp_path / "m.json")], cwd=REPO_ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    lines = [ln for ln in proc.stderr.strip().splitlines() if ln.strip()]
    assert lines == [f"ppo@r1: error: {data}: row 1: field 'reward_model.ground_truth' is 'x'; "
                     "data_source arithmetic expects an integer such as '46' or '-3'"], proc.stderr
    assert "ray:" not in proc.stdout  # no Ray start
    assert time.monotonic() - start < 60
