"""`rlcore generate` and `rlcore eval` with an agent program (rollout.agent.loop openai): a bad agent file stops the
command before Ray starts, in one line; the agent's own rewards are written with its trajectories and `rlcore eval`
keeps them instead of scoring the responses again."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from rlcore.commands import main

AGENTS = Path(__file__).parents[1] / "agents" / "openai_agents" / "agents.py"


def params_for(tmp_path: Path, name: str) -> Path:
    params = tmp_path / "params.yaml"
    params.write_text("resources: {n_workers: 1}\ntracking: {enabled: false}\n"
                      f"rollout: {{agent: {{loop: openai, agents: [{{path: {AGENTS}, name: {name}}}], processes: 1}}}}\n")
    return params


def prompts(tmp_path: Path) -> Path:
    data = tmp_path / "prompts.jsonl"
    rows = [{"messages": [{"role": "user", "content": f"{i}+{i}"}], "data_source": "arithmetic",
             "reward_model": {"ground_truth": str(2 * i)}} for i in range(3)]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return data


def test_a_bad_agent_function_stops_generate_before_ray_in_one_line(tiny_model_dir, tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        main(["generate", "--model", str(tiny_model_dir), "--data", str(prompts(tmp_path)), "--out",
              str(tmp_path / "o.parquet"), "--params", str(params_for(tmp_path, "plain"))])
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.strip().count("\n") == 0 and "expected an async function" in err


@pytest.mark.integration
def test_generate_runs_the_agent_and_eval_keeps_its_rewards(ray_local, tiny_model_dir, tmp_path, capsys):
    out = tmp_path / "gen.parquet"
    params = params_for(tmp_path, "graded")
    assert main(["generate", "--model", str(tiny_model_dir), "--data", str(prompts(tmp_path)), "--out", str(out),
                 "--n", "2", "--max-new-tokens", "8", "--params", str(params)]) == 0
    rows = pq.read_table(out).to_pylist()
    assert all(r["agent_rewards"] == [0.25, 0.25] and r["agent_failures"] == ["", ""] for r in rows)
    assert all(len(t) == 2 and t[-1]["role"] == "assistant" for r in rows for t in r["trajectories"])
    assert main(["eval", "--generations", str(out), "--k", "2", "--out", str(tmp_path / "e.json"),
                 "--params", str(params)]) == 0
    result = json.loads((tmp_path / "e.json").read_text())
    assert result["mean_reward"] == 0.25 and result["pass@1"] == 1.0  # the agent's, not the rule's on the text
