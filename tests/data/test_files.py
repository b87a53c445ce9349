"""Your own task from files (task.name file, rlcore.data.files): rows of jsonl/parquet files in the pipeline's schema,
with the column mapping, and one line naming file, row and field for each kind of bad row; the prepare stage
reads the files only as DVC recorded them (rlcore.inputs)."""

from __future__ import annotations

import json
import subprocess
import sys

import pandas as pd
import pytest
import yaml

from rlcore.config import FileColumns, parse_config
from rlcore.data.schema import validate_rows
from rlcore.data.splits import build_splits
from rlcore.errors import DataError
from rlcore.inputs import recorded_sha256, sha256_of, write_manifest

from ..conftest import REPO_ROOT

COLUMNS = FileColumns()


def jsonl(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(path)


def split(train, test, sft=None, **kw):
    files = {"train": train, "test": test, **({"sft": sft} if sft else {})}
    options = dict(n_sft=2, n_rl=10, n_test=10, columns=kw.pop("columns", COLUMNS), data_source=kw.pop("ds", "file"))
    return build_splits("file", file=files, **{**options, **kw})


def test_rows_in_the_schema_with_text_and_chat_prompts_numbers_and_extra_columns(tmp_path):
    train = jsonl(tmp_path / "train.jsonl", [
        {"prompt": "Reverse abc", "ground_truth": "cba", "demonstration": "cba", "level": 1},
        {"prompt": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Reverse xy"}],
         "ground_truth": "yx", "demonstration": [{"role": "user", "content": "ignored"},
                                                  {"role": "assistant", "content": "yx"}], "level": 2},
        {"prompt": "How many legs has a cat?", "ground_truth": 4, "index": 77, "extra_info": {"source": "zoo"}},
    ])
    test = jsonl(tmp_path / "test.jsonl", [{"prompt": "Reverse q", "ground_truth": "q"}])
    splits = split(train, test)
    for rows in splits.values():
        validate_rows(rows, "x")
    sft, rl = splits["sft_train"], splits["rl_train"]
    assert [r["extra_info"]["answer"] for r in sft] == ["cba", "yx"]  # text, and the assistant message's content
    assert sft[1]["prompt"][0] == {"role": "system", "content": "Be brief."}
    assert sft[1]["extra_info"]["question"] == "Reverse xy"  # the last user message
    assert [r["extra_info"]["level"] for r in sft] == [1, 2]  # any other column is carried into extra_info
    (row,) = rl  # the SFT split took the first two train rows
    assert row["reward_model"]["ground_truth"] == "4" and row["data_source"] == "file" and row["ability"] == "general"
    assert row["extra_info"]["source"] == "zoo" and row["extra_info"]["file_index"] == 77  # merged; renamed
    assert (row["extra_info"]["split"], row["extra_info"]["index"], row["extra_info"]["answer"]) == ("rl_train", 0, "")


def test_column_mapping_dotted_names_and_a_data_source_column(tmp_path):
    """Files in verl's own schema: the ground truth nested, a data_source per row; an SFT file of its own whose
    demonstration column is named by the mapping."""
    verl = [{"data_source": "math", "prompt": [{"role": "user", "content": f"{i}+1"}], "ability": "math",
             "reward_model": {"style": "rule", "ground_truth": str(i + 1)}, "extra_info": {"orig": i}}
            for i in range(4)]
    pd.DataFrame(verl).to_parquet(tmp_path / "train.parquet")
    sft = jsonl(tmp_path / "sft.jsonl", [{**verl[0], "data_source": "mine", "a": "1"}])
    columns = FileColumns(prompt="prompt", ground_truth="reward_model.ground_truth", demonstration="a",
                          data_source="data_source")
    train = str(tmp_path / "train.parquet")
    splits = split(train, train, sft=sft, columns=columns)
    rl = splits["rl_train"]
    assert [r["reward_model"]["ground_truth"] for r in rl] == ["1", "2", "3", "4"]
    assert {r["data_source"] for r in rl} == {"math"} and {r["ability"] for r in rl} == {"math"}
    assert [r["extra_info"]["orig"] for r in rl] == [0, 1, 2, 3]  # the file's extra_info, merged
    assert "reward_model" not in rl[0]["extra_info"]  # a mapped column is not carried again
    (row,) = splits["sft_train"]
    assert (row["data_source"], row["extra_info"]["answer"]) == ("mine", "1")
    bad = jsonl(tmp_path / "bad.jsonl", [{**verl[0], "data_source": 3}])
    with pytest.raises(DataError, match=r"bad.jsonl: row 0 \(line 1\): field 'data_source' \(task.columns"):
        split(train, bad, sft=sft, columns=columns)


@pytest.mark.parametrize("record, needle", [
    ({"ground_truth": "1"}, "no column 'prompt', which task.columns.prompt names; the file's columns: 'ground_truth'"),
    ({"prompt": None, "ground_truth": "1"}, "field 'prompt' should be text or a list of chat messages, got nothing"),
    ({"prompt": "", "ground_truth": "1"}, "field 'prompt' is empty"),
    ({"prompt": [{"role": "user"}], "ground_truth": "1"}, "field 'prompt'[0] should be a message"),
    ({"prompt": [{"role": "robot", "content": "hi"}], "ground_truth": "1"}, "has role 'robot'"),
    ({"prompt": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "x"}], "ground_truth": "1"},
     "ends with an assistant message"),
    ({"prompt": "hi"}, "no column 'ground_truth', which task.columns.ground_truth names; the file's columns: 'prompt'"),
    ({"prompt": "hi", "ground_truth": None}, "field 'ground_truth' should be text or a number, got nothing"),
    ({"prompt": "hi", "ground_truth": [1, 2]}, "field 'ground_truth' should be text or a number, got list"),
    ({"prompt": "hi", "ground_truth": True}, "field 'ground_truth' should be text or a number, got bool"),
])
def test_each_bad_row_is_one_line_naming_file_row_and_field(tmp_path, record, needle):
    good = {"prompt": "hi", "ground_truth": "1", "demonstration": "1"}
    train = jsonl(tmp_path / "train.jsonl", [good, good, good, record])
    with pytest.raises(DataError) as info:
        split(train, train)
    msg = str(info.value)
    assert msg.startswith(f"{train}: row 3 (line 4): ") and needle in msg and "\n" not in msg, msg


def test_sft_rows_need_a_demonstration_and_splits_need_rows(tmp_path):
    rows = [{"prompt": "hi", "ground_truth": "1"}] * 3
    train = jsonl(tmp_path / "train.jsonl", rows)
    with pytest.raises(DataError, match=r"train.jsonl: row 0 \(line 1\): no column 'demonstration', which "
                                        r"task.columns.demonstration names \(the SFT demonstration\)"):
        split(train, train)
    sft = jsonl(tmp_path / "sft.jsonl", [{"prompt": "hi", "ground_truth": "1", "demonstration": "1"}])
    assert len(split(train, train, sft=sft)["rl_train"]) == 3  # an SFT file: RL takes the train file from row 0
    with pytest.raises(DataError, match="no rows left for split 'rl_train' after the first 3"):
        split(jsonl(tmp_path / "short.jsonl", [{"prompt": "hi", "ground_truth": "1", "demonstration": "1"}] * 3),
              train, n_sft=5)


def test_task_file_params_are_checked_in_one_line():
    for raw, needle in (({"task": {"name": "file"}}, "task.name file needs task.file.train"),
                        ({"task": {"name": "file", "file": {"train": "a.jsonl", "test": "b.jsonl", "dev": "c"}}},
                         "task.file.dev"),
                        ({"task": {"gsm8k_train_path": "x.jsonl"}}, "task.gsm8k_train_path is now task.file.train")):
        with pytest.raises(Exception, match=needle):
            parse_config(raw)


def test_manifests_record_a_file_and_refuse_a_changed_one(tmp_path):
    data = tmp_path / "train.jsonl"
    data.write_text('{"prompt": "a", "ground_truth": "b"}\n')
    write_manifest(data, tmp_path / "in" / "train.json")
    assert recorded_sha256(tmp_path / "in", "train", data) == sha256_of(data)
    data.write_text('{"prompt": "a", "ground_truth": "c"}\n')
    with pytest.raises(DataError, match="train.jsonl changed after DVC recorded it"):
        recorded_sha256(tmp_path / "in", "train", data)
    with pytest.raises(DataError, match="records .*train.jsonl, not .*other.jsonl"):
        recorded_sha256(tmp_path / "in", "train", tmp_path / "other.jsonl")
    with pytest.raises(FileNotFoundError, match="no record of .*test.jsonl"):
        recorded_sha256(tmp_path / "in", "test", tmp_path / "test.jsonl")


def test_the_prepare_stage_writes_a_file_task_and_its_metrics(tmp_path):
    rows = [{"prompt": f"Reverse {w}", "ground_truth": w[::-1], "demonstration": w[::-1]} for w in
            ("abc", "de", "fgh", "ij", "klm")]
    train, test = jsonl(tmp_path / "train.jsonl", rows), jsonl(tmp_path / "test.jsonl", rows[3:])
    params = tmp_path / "params.yaml"
    params.write_text(yaml.safe_dump({"task": {"name": "file", "file": {"train": train, "test": test}, "n_sft": 2,
                                               "n_rl": 10, "n_test": 10}}))
    for key, path in (("train", train), ("test", test)):
        subprocess.run([sys.executable, "-m", "stages.track", "--file", path, "--out", str(tmp_path / "in" / f"{key}.json")],
                       cwd=REPO_ROOT, check=True, capture_output=True)
    out = tmp_path / "processed"
    proc = subprocess.run([sys.executable, "-m", "stages.prepare", "--params", str(params), "--inputs",
                           str(tmp_path / "in"), "--out-dir", str(out), "--metrics", str(tmp_path / "m.json")],
                          cwd=REPO_ROOT, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    metrics = json.loads((tmp_path / "m.json").read_text())
    assert metrics["prepare/sft_train_rows"] == 2 and metrics["prepare/rl_train_rows"] == 3
    assert metrics["prepare/test_prompts_seen_in_training"] == 2  # "Reverse ij" and "Reverse klm" are RL prompts too
    assert pd.read_parquet(out / "test.parquet")["data_source"].tolist() == ["file", "file"]
