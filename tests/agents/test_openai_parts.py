"""The openai loop's parts without agent processes: where a request's tokens go (rlcore.agents.recording), the
training rows of split and failed trajectories (rlcore.agents.trajectory_rows), the agents' rewards
(rlcore.rewards.agent_rewards), and what is refused before Ray starts (params, the agent file)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

from rlcore.agents.check import check_agent_program
from rlcore.agents.recording import BudgetError, TrajectoryRecord, message_key
from rlcore.agents.trajectory_rows import EXTRA, MAIN, PAD, main_rows, mini_batch_rows, training_rows
from rlcore.config import parse_config
from rlcore.errors import ConfigError
from rlcore.protocol import Batch
from rlcore.rewards.agent_rewards import with_agent_rewards
from rlcore.rewards.guard import NOT_APPLICABLE, OK
from rlcore.rewards.scoring import Rewards
from tests.conftest import REPO_ROOT

AGENTS = Path(__file__).parent / "openai_agents" / "agents.py"


# ------------------------------------------------------------------------------------------------ recording
def keys(*messages: dict) -> list[str]:
    return [message_key(m) for m in messages]


USER = {"role": "user", "content": "2+3?"}
CALL = {"role": "assistant", "content": None, "tool_calls": [
    {"id": "call_1", "type": "function", "function": {"name": "add", "arguments": "{\"a\": 2, \"b\": 3}"}}]}


def test_a_message_is_the_same_whatever_json_spelling_ids_or_empty_content_it_comes_back_with():
    echoed = {"role": "assistant", "content": "", "tool_calls": [
        {"id": "call_other", "type": "function", "function": {"name": "add", "arguments": "{\"b\":3,\"a\":2}"}}]}
    assert message_key(CALL) == message_key(echoed)
    assert message_key({"role": "user", "content": [{"type": "text", "text": "2+"}, {"type": "text", "text": "3?"}]}) \
        == message_key(USER)
    changed = json.loads(json.dumps(echoed))
    changed["tool_calls"][0]["function"]["arguments"] = "{\"a\": 2, \"b\": 4}"
    assert message_key(changed) != message_key(CALL)
    assert message_key({**USER, "role": "system"}) != message_key(USER)


def record_with_first_completion() -> TrajectoryRecord:
    record = TrajectoryRecord(seed=1, budget=20, prompt_width=30, eos=0)
    plan = record.plan(keys(USER), "[]", lambda n: None, lambda: [5, 6, 7])
    assert plan.row is None and plan.prompt == [5, 6, 7] and plan.room == 20
    record.add(plan, keys(USER), "[]", [8, 9, 0], [-0.1, -0.2, -0.3], message_key(CALL), at_eos=True)
    return record


def test_a_request_that_extends_the_last_completion_continues_its_row_from_its_own_tokens():
    record = record_with_first_completion()
    tool = {"role": "tool", "tool_call_id": "call_1", "content": "5"}
    seen = []

    def observation(start: int) -> list[int]:
        seen.append(start)
        return [3, 4]

    plan = record.plan(keys(USER, CALL, tool), "[]", observation, lambda: pytest.fail("re-tokenized"))
    assert seen == [2] and plan.row is record.rows[0]
    assert plan.prompt == [5, 6, 7, 8, 9, 0, 3, 4] and plan.observation == [3, 4] and plan.room == 20 - 3 - 2
    record.add(plan, keys(USER, CALL, tool), "[]", [11, 0], [-1.0, -2.0], message_key({"role": "assistant",
                                                                                        "content": "5"}), at_eos=True)
    (row,) = record.rows
    assert row.response == [8, 9, 0, 3, 4, 11, 0] and row.mask == [1, 1, 1, 0, 0, 1, 1]
    assert row.log_probs == [-0.1, -0.2, -0.3, 0.0, 0.0, -1.0, -2.0]


def test_a_completion_cut_before_eos_gets_the_eos_the_template_shows_as_a_template_token():
    record = TrajectoryRecord(seed=1, budget=20, prompt_width=30, eos=0)
    plan = record.plan(keys(USER), "[]", lambda n: None, lambda: [5])
    answer = {"role": "assistant", "content": "xy"}
    record.add(plan, keys(USER), "[]", [8, 9], [-0.1, -0.2], message_key(answer), at_eos=False)
    plan = record.plan(keys(USER, answer, USER), "[]", lambda n: [3], lambda: [])
    assert plan.observation == [0, 3]


def test_edited_history_other_tools_and_too_long_a_conversation_go_elsewhere():
    record = record_with_first_completion()
    tool = {"role": "tool", "tool_call_id": "call_1", "content": "5"}
    edited = {"role": "user", "content": "2+3? (again)"}
    assert record.plan(keys(edited, CALL, tool), "[]", lambda n: [3], lambda: [1, 2]).row is None
    assert record.plan(keys(USER, CALL, tool), "[{\"other\": 1}]", lambda n: [3], lambda: [1, 2]).row is None
    assert record.plan(keys(USER, CALL), "[]", lambda n: [3], lambda: [1, 2]).row is None  # nothing new after it
    with pytest.raises(BudgetError, match="leave no room in the trajectory's budget of 20"):
        record.plan(keys(USER, CALL, tool), "[]", lambda n: [3] * 17, lambda: [])
    with pytest.raises(BudgetError, match="the prompt is 31 tokens"):
        record.plan(keys(edited), "[]", lambda n: [3], lambda: [1] * 31)


def test_each_request_has_its_own_seed_from_the_trajectorys_and_its_content():
    a, b = TrajectoryRecord(seed=1, budget=1, prompt_width=1), TrajectoryRecord(seed=1, budget=1, prompt_width=1)
    first, second = a.request_seed("x"), a.request_seed("y")
    assert (b.request_seed("y"), b.request_seed("x")) == (second, first)  # whatever the order they come in
    assert a.request_seed("x") != first  # the same request again: another draw
    assert TrajectoryRecord(seed=2, budget=1, prompt_width=1).request_seed("x") != first


# ------------------------------------------------------------------------------------------------ training rows
def generated(n: int, *, extra: dict[int, list[dict]] | None = None, dropped: tuple[int, ...] = ()) -> Batch:
    """``n`` one-row trajectories (prompt [7, 7], response [i + 1, 0] of which the first token is sampled)."""
    extra = extra or {}
    return Batch({"prompts": torch.tensor([[0, 7, 7]] * n), "prompt_mask": torch.tensor([[0, 1, 1]] * n),
                  "responses": torch.tensor([[i + 1, 0, 0] for i in range(n)]),
                  "response_mask": torch.tensor([[1, 0, 0]] * n), "response_attention_mask": torch.tensor([[1, 1, 0]] * n),
                  "rollout_log_probs": torch.full((n, 3), -0.5), "scores": torch.arange(n, dtype=torch.float32),
                  "agent_dropped": torch.tensor([int(i in dropped) for i in range(n)])},
                 {"uid": [f"p{i // 2}" for i in range(n)], "agent_extra_rows": [extra.get(i, []) for i in range(n)]})


def test_a_trajectorys_other_rows_follow_it_with_its_group_and_reward():
    other = {"prompt": [9], "response": [4, 5, 0], "mask": [1, 1, 0], "log_probs": [-1.0, -2.0, 0.0], "pad": 0}
    rows, scale = training_rows(generated(4, extra={1: [other]}), ranks=1)
    assert len(rows) == 5 and scale == 5 / 4
    assert rows["agent_row_kind"].tolist() == [MAIN, MAIN, EXTRA, MAIN, MAIN]
    assert rows["prompts"][2].tolist() == [0, 0, 9] and rows["prompt_mask"][2].tolist() == [0, 0, 1]
    assert rows["responses"][2].tolist() == [4, 5, 0] and rows["response_mask"][2].tolist() == [1, 1, 0]
    assert rows["rollout_log_probs"][2].tolist() == [-1.0, -2.0, 0.0]
    assert rows["uid"][2] == "p0" and float(rows["scores"][2]) == 1.0
    assert torch.equal(main_rows(rows)["responses"], generated(4)["responses"])


def test_dropped_trajectories_train_nothing_and_leave_their_group_and_padding_fills_the_ranks():
    other = {"prompt": [9], "response": [4], "mask": [1], "log_probs": [-1.0], "pad": 0}
    rows, _ = training_rows(generated(4, extra={1: [other]}, dropped=(1,)), ranks=3)
    assert len(rows) == 6 and rows["agent_row_kind"].tolist() == [MAIN, MAIN, MAIN, MAIN, PAD, PAD]
    assert rows["response_mask"][1].sum() == 0 and rows["uid"][1] != "p0" and rows["uid"][0] == "p0"
    assert rows["response_mask"][4:].sum() == 0 and len(set(rows["uid"][4:])) == 2
    assert len(main_rows(rows)) == 4


def test_a_batch_of_another_loop_is_left_as_it_is_and_mini_batches_grow_with_the_rows():
    batch = Batch({"responses": torch.zeros((2, 3), dtype=torch.long)})
    assert training_rows(batch, ranks=2) == (batch, 1.0) and main_rows(batch) is batch
    assert mini_batch_rows(8, 1.0) == 8 and mini_batch_rows(8, 1.25) == 10 and mini_batch_rows(8, 1.1) == 9


# ------------------------------------------------------------------------------------------------ rewards
def test_the_agents_rewards_stand_and_the_reward_functions_score_only_the_others():
    asked = []

    def score(index: np.ndarray) -> Rewards:
        asked.append(index.tolist())
        k = len(index)
        return Rewards(np.full(k, 0.25), np.full(k, 1.0), {"rule": np.full(k, 0.25)}, {"rule": np.full(k, OK)},
                       {"rule": {"x": np.full(k, 3.0)}}, {"rule": 1.0})

    r = with_agent_rewards([0.5, None, -1.0, None], ["", "", "raised", ""], [{"acc": 1}, {}, {}, {}], score,
                           {"rule": 1.0})
    assert asked == [[1, 3]]
    assert r.total.tolist() == [0.5, 0.25, -1.0, 0.25] and r.acc.tolist() == [1.0, 1.0, 0.0, 1.0]
    assert np.isnan(r.values["rule"][[0, 2]]).all() and r.status["rule"].tolist() == [NOT_APPLICABLE, OK,
                                                                                      NOT_APPLICABLE, OK]
    assert r.metrics()["reward/rule/mean"] == 0.25 and r.metrics()["reward/rule/x"] == 3.0
    every = with_agent_rewards([1.0], [""], [{}], lambda index: pytest.fail("nothing to score"), {"rule": 1.0})
    assert every.total.tolist() == [1.0] and every.acc.tolist() == [1.0] and list(every.values) == ["rule"]


# ------------------------------------------------------------------------------------------------ before Ray
@pytest.mark.parametrize("agent, message", [
    ({"loop": "openai"}, "rollout.agent.loop openai needs one agent in rollout.agent.agents"),
    ({"loop": "openai", "agents": [{"path": "agent.py"}]}, "put the agent file in a folder of its own"),
    ({"loop": "openai", "agents": [{"path": "a/agent.py", "name": "1run"}]}, "name"),
])
def test_bad_openai_loop_params_fail_with_one_line_naming_the_key(agent, message):
    with pytest.raises(ConfigError, match=message):
        parse_config({"rollout": {"agent": agent}})


def openai_agent(path, name="run"):
    return parse_config({"rollout": {"agent": {"loop": "openai", "agents": [{"path": str(path), "name": name}]}}}
                        ).rollout.agent


@pytest.mark.parametrize("name, message", [
    ("plain", "agent 'plain' .*: expected an async function `async def plain\\(client, row\\)`, got a plain def"),
    ("nothing", "agent file .*agents.py has no 'nothing' \\(it defines: block, chatty, edit_history, exits, graded, "
                "malformed, misbehave, plain, react\\)"),
])
def test_a_bad_agent_function_is_one_line_before_ray_starts(name, message):
    with pytest.raises(ConfigError, match=f"^rollout.agent.agents\\[0\\]: {message}$"):
        check_agent_program(openai_agent(AGENTS, name))


def test_an_agent_file_that_is_missing_or_raises_is_one_line_and_leaves_no_bytecode(tmp_path):
    with pytest.raises(ConfigError, match="agent file .*missing.py not found"):
        check_agent_program(openai_agent(tmp_path / "missing.py"))
    (tmp_path / "bad.py").write_text("import helper\nasync def run(client, row):\n    return 1.0\n")
    (tmp_path / "helper.py").write_text("raise RuntimeError('broken helper')\n")
    with pytest.raises(ConfigError, match="importing it raised RuntimeError: broken helper$"):
        check_agent_program(openai_agent(tmp_path / "bad.py"))
    (tmp_path / "helper.py").write_text("X = 1\n")
    check_agent_program(openai_agent(tmp_path / "bad.py"))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.py", "helper.py"]  # no __pycache__ beside them


def test_the_agent_file_stage_records_its_folder_so_a_module_beside_it_counts(tmp_path, monkeypatch):
    """The manifest the agent_file stage writes for ``<folder>/agent.py/..`` (its dvc.yaml command) is the folder's
    hash: it changes with a module beside the agent, and not with a bytecode cache."""
    from stages.track import main

    folder = tmp_path / "agent"
    folder.mkdir()
    (folder / "agent.py").write_text("async def run(client, row):\n    return 1.0\n")
    (folder / "helper.py").write_text("X = 1\n")
    monkeypatch.chdir(tmp_path)
    out = tmp_path / "m.json"
    main(["--file", "agent/agent.py/..", "--out", str(out)])
    first = json.loads(out.read_text())
    assert first["path"] == "agent"
    (folder / "__pycache__").mkdir()
    (folder / "__pycache__" / "helper.cpython-311.pyc").write_bytes(b"x")
    main(["--file", "agent/agent.py/..", "--out", str(out)])
    assert json.loads(out.read_text()) == first
    (folder / "helper.py").write_text("X = 2\n")
    main(["--file", "agent/agent.py/..", "--out", str(out)])
    assert json.loads(out.read_text())["sha256"] != first["sha256"]


def test_the_calculator_openai_recipe_is_valid_and_its_agent_imports_nothing_of_rlcore():
    cfg = parse_config(yaml.safe_load((REPO_ROOT / "examples" / "calculator-openai.yaml").read_text()))
    assert cfg.rollout.agent.loop == "openai"
    (agent,) = cfg.rollout.agent.agents
    source = (REPO_ROOT / agent.path).read_text()
    assert "import openai" in source and "rlcore" not in source.split('"""', 2)[2]
    check_agent_program(cfg.rollout.agent, REPO_ROOT)
    assert cfg.task.max_prompt_length + cfg.task.max_response_length <= cfg.model.tiny.max_position_embeddings
