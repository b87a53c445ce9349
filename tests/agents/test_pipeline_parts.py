"""The pieces of the pipeline the tool loop touches: the calculator task's demonstrations, multi-turn SFT batches,
rollout.agent in params, the controller's look at the tool files, rewards placed on the model's last token, and
`rlcore generate`'s records of whole trajectories."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch

from rlcore.agents.check import tool_schemas
from rlcore.agents.parsers import PARSERS
from rlcore.agents.template import TurnTemplate
from rlcore.config import parse_config
from rlcore.data.splits import build_splits
from rlcore.engine.tiny_model import build_char_tokenizer
from rlcore.errors import ConfigError, DataError
from rlcore.protocol import Batch
from rlcore.trainer.generate import generation_records
from rlcore.trainer.round.ppo_step import place_scores
from rlcore.trainer.sft import sft_batch
from tests.conftest import REPO_ROOT

TOOLS = str(Path(__file__).with_name("tools_for_tests.py"))
CALCULATOR = REPO_ROOT / "examples" / "calculator" / "calculator.py"


@pytest.fixture(scope="module")
def splits():
    return build_splits("calculator", seed=3, n_sft=2000, n_rl=50, n_test=50, min_digits=2, max_digits=2,
                        sft_tool_rate=0.7, sft_tool_error_rate=0.6)


def test_calculator_demonstrations_use_the_tool_on_a_share_and_slip_on_a_share_of_calls(splits):
    sys.path.insert(0, str(CALCULATOR.parent))
    from calculator import calculator  # the recipe's tool file

    parse = PARSERS.get("hermes").parse
    used = slipped = 0
    for row in splits["sft_train"]:
        a, b = (int(x) for x in row["extra_info"]["question"].split("*"))
        assert row["reward_model"]["ground_truth"] == str(a * b) and row["data_source"] == "arithmetic"
        messages = row["extra_info"]["messages"]
        assert row["extra_info"]["answer"] == messages[-1]["content"]
        if len(messages) == 1:
            assert messages[0]["content"] == str(a * b)
            continue
        used += 1
        (call,) = parse(messages[0]["content"]).calls
        assert call.name == "calculator" and messages[1] == {"role": "tool", "name": "calculator",
                                                             "content": calculator(**call.arguments)}
        assert messages[2]["content"] == messages[1]["content"]
        slipped += call.arguments["expression"] == f"{a}+{b}"
    n = len(splits["sft_train"])
    assert abs(used / n - 0.7) < 4 * (0.7 * 0.3 / n) ** 0.5  # binomial, 4 standard deviations
    assert abs(slipped / used - 0.6) < 4 * (0.6 * 0.4 / used) ** 0.5
    test_questions = {r["extra_info"]["question"] for r in splits["test"]}
    assert not test_questions & {r["extra_info"]["question"] for r in splits["sft_train"] + splits["rl_train"]}


def test_sft_trains_on_the_assistant_turns_of_multi_turn_demonstrations(splits):
    tok = build_char_tokenizer()
    cfg = parse_config({"task": {"name": "calculator", "max_prompt_length": 16, "max_response_length": 112}})
    rows = pd.DataFrame(splits["sft_train"][:20])
    batch = sft_batch(rows, tok, cfg, "sft rows")
    turns = TurnTemplate(tok)
    for i, extra in enumerate(rows["extra_info"]):
        ids, mask = turns.conversation_ids(extra["messages"])
        n = len(ids)
        assert batch["responses"][i, :n].tolist() == ids and batch["response_mask"][i, :n].tolist() == mask
        assert batch["response_attention_mask"][i].tolist() == [1] * n + [0] * (112 - n)
        assert batch["response_mask"][i, n:].eq(0).all()
    mixed = rows.copy()
    mixed.at[3, "extra_info"] = {k: v for k, v in rows["extra_info"][3].items() if k != "messages"}
    with pytest.raises(DataError, match="sft rows: row 3: extra_info.messages is missing"):
        sft_batch(mixed, tok, cfg, "sft rows")


@pytest.mark.parametrize("agent, message", [
    ({"loop": "tool"}, "rollout.agent.loop tool needs rollout.agent.tools"),
    ({"loop": "multi"}, "unknown agent loop 'multi'; allowed: openai, single_turn, tool"),
    ({"parser": "json"}, "unknown tool-call parser 'json'; allowed: hermes"),
    ({"tools": [{"path": "a.py", "name": "f"}, {"path": "b.py", "name": "f"}]}, "name 'f' appears twice"),
    ({"max_turns": 0}, "max_turns"),
])
def test_bad_agent_params_fail_with_one_line_naming_the_key(agent, message):
    with pytest.raises(ConfigError, match=message):
        parse_config({"rollout": {"agent": agent}})


def test_the_controller_describes_the_tool_files_before_ray_starts(tmp_path):
    def agent(*tools):
        return parse_config({"rollout": {"agent": {"loop": "tool", "tools": [
            {"path": p, "name": n} for p, n in tools]}}}).rollout.agent

    assert tool_schemas(parse_config({}).rollout.agent) is None
    (schema,) = tool_schemas(agent((str(CALCULATOR), "calculator")))
    assert schema["function"]["name"] == "calculator" and schema["function"]["parameters"]["required"] == ["expression"]
    with pytest.raises(ConfigError, match="tool file .*nothing.py not found"):
        tool_schemas(agent((str(tmp_path / "nothing.py"), "f")))
    with pytest.raises(ConfigError, match="an environment .* must be the only entry"):
        tool_schemas(agent((TOOLS, "add"), (TOOLS, "Counter")))
    with pytest.raises(ConfigError, match="parameter 'a' has no type hint"):
        tool_schemas(agent((TOOLS, "no_hints")))


def test_scores_go_on_the_models_last_token_of_a_trajectory():
    mask = torch.tensor([[1, 1, 0, 0, 1, 1, 0], [1, 1, 1, 0, 0, 0, 0], [0, 0, 0, 0, 0, 0, 0]])
    out = place_scores(torch.tensor([2.0, 3.0, 4.0]), mask)
    assert out.tolist() == [[0, 0, 0, 0, 0, 2, 0], [0, 0, 3, 0, 0, 0, 0], [0] * 7]


def test_generate_writes_each_trajectory():
    tok = build_char_tokenizer()
    messages = [[{"role": "assistant", "content": "<tool_call>{}</tool_call>"}, {"role": "tool", "name": "f",
                  "content": "e"}, {"role": "assistant", "content": "42"}], [{"role": "assistant", "content": "zz"}]]
    gen = Batch({"responses": torch.zeros((2, 6), dtype=torch.long),
                 "response_mask": torch.tensor([[1, 1, 0, 0, 1, 1], [1, 1, 1, 1, 1, 1]]),
                 "rollout_log_probs": torch.full((2, 6), -0.5), "agent_tool_calls": torch.tensor([1, 0])},
                {"agent_messages": messages, "agent_final": ["42", "zz"], "agent_stop": ["answer", "budget"]})
    (record,) = generation_records([{"prompt": "q"}], gen, tok, n=2)
    assert record["responses"] == ["42", "zz"] and record["finish_reasons"] == ["stop", "length"]
    assert record["response_tokens"] == [4, 6] and record["response_logprobs"] == [-2.0, -3.0]
    assert record["tool_calls"] == [1, 0] and record["trajectories"][0][1] == {"name": "f", "role": "tool",
                                                                                 "content": "e"}


def test_the_calculator_recipe_is_a_valid_params_file_whose_tool_exists():
    import yaml

    cfg = parse_config(yaml.safe_load((REPO_ROOT / "examples" / "calculator.yaml").read_text()))
    assert cfg.task.name == "calculator" and cfg.rollout.agent.loop == "tool"
    (tool,) = cfg.rollout.agent.tools
    assert (REPO_ROOT / tool.path).resolve() == CALCULATOR.resolve()
    # a trajectory of the demonstrator's fits the budget: prompt + call + observation + answer
    tok = build_char_tokenizer()
    from rlcore.data.calculator import demonstration

    ids, _ = TurnTemplate(tok).conversation_ids(demonstration(99, 99, use_tool=True, slip=False))
    assert len(ids) <= cfg.task.max_response_length
    prompt = tok.apply_chat_template([{"role": "user", "content": "99*99"}], add_generation_prompt=True, tokenize=False)
    assert len(tok(prompt, add_special_tokens=False)["input_ids"]) <= cfg.task.max_prompt_length
    assert cfg.task.max_prompt_length + cfg.task.max_response_length <= cfg.model.tiny.max_position_embeddings
