"""bench.recipe_seeds: the speed columns of a seed's row, worked out by hand from a finished pipeline's files, and
its --copy option refusing what it cannot copy."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from bench.recipe_seeds import main, round_speed

REPO_ROOT = Path(__file__).resolve().parents[1]


def test_the_round_speed_is_every_steps_response_tokens_over_the_rounds_wall_seconds(tmp_path):
    params = yaml.safe_load((REPO_ROOT / "params.yaml").read_text())
    params["rollout"]["n"] = 8
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(params))
    (tmp_path / "metrics").mkdir()
    (tmp_path / "metrics" / "ppo_r1.json").write_text(json.dumps({"ppo/wall_s": 10.0}))
    (tmp_path / "plots").mkdir()
    (tmp_path / "plots" / "ppo_r1.csv").write_text(
        "step,rollout/response_length,rollout/groups_kept\n1,3.0,4\n2,5.0,2\n")
    # 4 groups x 8 responses of 3 tokens, then 2 x 8 of 5: 96 + 80 tokens in 10 s, 2 steps
    assert round_speed(tmp_path) == pytest.approx({"round_s": 10.0, "steps_per_s": 0.2, "trained_tokens_per_s": 17.6})


@pytest.mark.parametrize("copy", ["models/nowhere=models/teacher", "models/sft"])
def test_a_copy_of_no_folder_or_without_a_destination_is_refused_in_one_line(copy, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "models" / "sft").mkdir(parents=True)
    with pytest.raises(SystemExit) as refused:
        main(["--recipe", "examples/distill.yaml", "--copy", copy])
    assert refused.value.code == 2
    assert f"argument --copy: '{copy}': expected SRC=DEST with SRC an existing folder" in capsys.readouterr().err
