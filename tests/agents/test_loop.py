"""The tool loop (rlcore.agents.loop) with a scripted policy (tests/agents/scripted.py) and real tool processes:
exact token layouts and masks, the budget, the turn cap, every error counted, rows that do not wait for each
other's tools, and an environment's steps and rewards."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from rlcore.agents.batch import agent_metrics, trajectory_batch
from rlcore.agents.loop import AgentRuntime
from rlcore.agents.spec import AgentSpec, ToolRef
from rlcore.engine.tiny_model import build_char_tokenizer
from rlcore.protocol import Batch
from rlcore.rollout.base import SamplingParams
from tests.agents.scripted import ScriptedEngine

TOOLS = str(Path(__file__).with_name("tools_for_tests.py"))
BUDGET = 160


def call(name: str, **args) -> str:
    return f"<tool_call>{json.dumps({'name': name, 'arguments': args}, separators=(',', ':'))}</tool_call>"


def call_of_length(n: int) -> str:
    """An echo call of exactly ``n`` characters (tokens: the tokenizer is per character)."""
    return call("echo", text="q" * (n - len(call("echo", text="", times=1))), times=1)


SCRIPT = [
    ["7"],                                                  # 0 answers at once
    [call("add", a=2, b=3), "5"],                           # 1 a call, its result, the answer
    [call("add", a=1), call("add", a=1)],                   # 2 still calling at the last allowed turn
    ["<tool_call>{add}</tool_call>", "0"],                  # 3 malformed
    [call("nope"), "0"],                                    # 4 unknown tool
    ["z" * 200],                                            # 5 a turn longer than the budget
    [call("echo", text="abcdefghij", times=20), "x"],       # 6 an observation too long for the budget: cut
    [call("raise_error", message="bad"), "x"],              # 7 the tool raises
    [call("sleep_forever"), "late"],                        # 8 the tool times out
    [call("add", a=1), "y" * 40],                           # 9 a fast tool, then a long turn
    [call_of_length(BUDGET - 13), "x"],                     # 10 a call that leaves room for no observation
    [call("raise_error", message="m" * 40), "x"],           # 11 an error too long for the budget: cut, then read
]
MIN_ANSWER = 8  # AgentSpec's default


@pytest.fixture(scope="module")
def tok():
    return build_char_tokenizer()


@pytest.fixture(scope="module")
def runtime(tok):
    names = ("add", "echo", "raise_error", "sleep_forever")
    rt = AgentRuntime(AgentSpec(tools=tuple(ToolRef(TOOLS, n) for n in names), max_turns=2, timeout_s=1.0,
                                max_tool_response_chars=300), tok)
    yield rt
    rt.close()


@pytest.fixture(scope="module")
def ran(tok, runtime):
    engine = ScriptedEngine(tok, SCRIPT)
    prompts = Batch({"prompts": torch.ones((len(SCRIPT), 3), dtype=torch.long),
                     "prompt_mask": torch.ones((len(SCRIPT), 3), dtype=torch.long)})
    out = trajectory_batch(runtime, engine, prompts, SamplingParams(max_new_tokens=BUDGET, greedy=True),
                           torch.Generator().manual_seed(0), torch.device("cpu"))
    return out, engine.rows


def ids(tok, text: str) -> list[int]:
    return tok(text, add_special_tokens=False)["input_ids"]


def test_a_call_its_observation_and_the_answer_are_laid_out_exactly(tok, runtime, ran):
    out, _ = ran
    eos = tok.eos_token_id
    first = ids(tok, SCRIPT[1][0]) + [eos]
    obs = runtime.template.observation_ids([{"role": "tool", "name": "add", "content": "5"}])
    assert tok.decode(obs) == "<|tool|>5<|assistant|>"
    want = first + obs + ids(tok, "5") + [eos]
    n = len(want)
    assert out["responses"][1, :n].tolist() == want and out["responses"][1, n:].eq(tok.pad_token_id).all()
    assert out["response_mask"][1].tolist() == [1] * len(first) + [0] * len(obs) + [1, 1] + [0] * (BUDGET - n)
    assert out["response_attention_mask"][1].tolist() == [1] * n + [0] * (BUDGET - n)
    assert out["rollout_log_probs"][1][out["response_mask"][1] == 0].eq(0).all()
    assert out["agent_final"][1] == "5" and out["agent_stop"][1] == "answer"
    assert out["agent_messages"][1] == [{"role": "assistant", "content": SCRIPT[1][0]},
                                        {"role": "tool", "name": "add", "content": "5"},
                                        {"role": "assistant", "content": "5"}]
    assert (out["agent_turns"][1], out["agent_tool_calls"][1], out["agent_tool_errors"][1]) == (2, 1, 0)


def test_the_model_saw_exactly_the_tokens_of_its_trajectory(ran):
    out, rows = ran
    for r in range(len(SCRIPT)):  # fed = the trajectory less its last sampled token (never fed back)
        n = int(out["response_attention_mask"][r].sum())
        assert rows.fed[r] == out["responses"][r, :n - 1].tolist(), r


def test_stops_truncation_and_the_budget(tok, ran):
    out, _ = ran
    assert out["agent_stop"].tolist() == ["answer", "answer", "max_turns", "answer", "answer", "budget", "answer",
                                          "answer", "answer", "answer", "budget", "answer"]
    assert out["agent_truncated"].tolist() == [0, 0, 1, 0, 0, 1, 0, 0, 0, 0, 1, 0]
    # row 2: two calling turns; only the first call ran
    assert (out["agent_turns"][2], out["agent_tool_calls"][2]) == (2, 1)
    # row 5: the turn is cut at the budget, every column the model's
    assert out["response_mask"][5].sum() == BUDGET and out["responses"][5].tolist() == ids(tok, "z" * BUDGET)
    # row 10: after its call, 12 columns are left: the tool message's template alone (9 tokens) and the 8 kept for
    # the answer do not fit, so the trajectory ends there, unobserved
    first = len(ids(tok, SCRIPT[10][0])) + 1
    assert BUDGET - first == 12
    assert out["response_attention_mask"][10].sum() == first == out["response_mask"][10].sum()
    assert [m["role"] for m in out["agent_messages"][10]] == ["assistant"] and out["agent_tool_calls"][10] == 1


def test_an_observation_too_long_for_the_budget_is_cut_to_leave_room_for_the_answer(tok, runtime, ran):
    """Row 6: the echo's 200 characters do not fit after the call: the observation is the longest prefix of them
    (and "...") that leaves ``min_answer_tokens`` of the budget, and the model answers after it."""
    out, _ = ran
    first = len(ids(tok, SCRIPT[6][0])) + 1
    room = BUDGET - first - MIN_ANSWER
    tool = out["agent_messages"][6][1]
    assert tool["role"] == "tool" and tool["content"].endswith("...")
    kept = tool["content"][:-3]
    assert ("abcdefghij" * 20).startswith(kept) and len(kept) > 0
    observation = runtime.template.observation_ids([tool])
    assert len(observation) <= room
    longer = {**tool, "content": ("abcdefghij" * 20)[:len(kept) + 1] + "..."}
    assert len(runtime.template.observation_ids([longer])) > room  # one character more would not fit
    n = first + len(observation) + 2  # then the answer "x" and EOS
    assert out["response_attention_mask"][6].sum() == n and out["responses"][6, n - 2] == ids(tok, "x")[0]
    assert out["agent_cut_observations"].tolist() == [0] * 6 + [1] + [0] * 4 + [1]
    # row 11: the same rule for an error: the model reads its start, then answers
    error = out["agent_messages"][11][1]["content"]
    assert error.startswith("error: ValueError: mmm") and error.endswith("...")
    assert [m["role"] for m in out["agent_messages"][11]] == ["assistant", "tool", "assistant"]


def test_every_failure_is_an_error_observation_counted_by_kind(ran):
    out, _ = ran
    errors = list(out["agent_errors"])
    assert errors[3] == {"malformed": 1} and errors[4] == {"unknown_tool": 1}
    assert errors[7] == {"raised": 1} and errors[8] == {"timeout": 1} and errors[11] == {"raised": 1}
    assert out["agent_messages"][4][1]["content"] == "error: unknown tool 'nope' (tools: add, echo, raise_error, " \
                                                     "sleep_forever)"
    assert out["agent_messages"][7][1]["content"] == "error: ValueError: bad"
    assert out["agent_messages"][3][1]["content"].startswith("error: malformed tool call: not valid JSON")
    m = agent_metrics(out)
    assert m["agent/tool_errors"] == 5.0 and m["agent/tool_errors/timeout"] == 1.0
    assert m["agent/tool_calls_per_sample"] == pytest.approx(10 / 12)  # rows 1-4 and 6-11 ran one call each
    assert m["agent/truncated"] == pytest.approx(3 / 12) and m["agent/turns"] == pytest.approx(21 / 12)
    # every error became an observation the model read (rows 3, 4, 7, 8 and 11), one of them cut; two cuts in all
    assert m["agent/error_observations"] == pytest.approx(5 / 12) and m["agent/observations_cut"] == pytest.approx(2 / 12)


def test_a_row_waiting_for_its_tool_does_not_hold_the_others(ran):
    _, rows = ran
    # row 9's call returned at once and it wrote 41 more tokens while row 8's tool ran into its 1 s timeout
    assert rows.released[9] < rows.released[8]
    assert rows.released[0] < rows.released[8] and rows.released[1] < rows.released[8]


def test_an_environment_steps_with_each_turn_and_its_rewards_reach_extra_info(tok):
    runtime = AgentRuntime(AgentSpec(tools=(ToolRef(TOOLS, "Counter"),), max_turns=4), tok)
    try:
        engine = ScriptedEngine(tok, [["go", "go", "go"], ["stop"], ["go"] * 5])
        rows = [{"extra_info": {"limit": 2}, "ground_truth": "bonus"}, {}, {"extra_info": {"limit": 9}}]
        result, trajs = runtime.run(engine, torch.ones((3, 2), dtype=torch.long), torch.ones((3, 2), dtype=torch.long),
                                    SamplingParams(max_new_tokens=BUDGET, greedy=True), rows=rows)
    finally:
        runtime.close()
    done, stopped, capped = trajs
    # row 0: step 1 answers "step 1" (user message), step 2 ends the episode (its last observation not appended)
    assert [(m["role"], m["content"]) for m in done.messages] == [("assistant", "go"), ("user", "step 1"),
                                                                   ("assistant", "go")]
    assert done.stop == "answer" and done.turn_rewards == [0.5, 0.5] and done.env_reward == 12.0
    assert stopped.stop == "answer" and stopped.turns == 1 and stopped.env_reward == 1.0  # step returned None
    assert capped.stop == "max_turns" and capped.turns == 4 and capped.env_reward == 3.0  # the 4th turn is not a step
    obs = runtime.template.observation_ids([{"role": "user", "content": "step 1"}])
    assert tok.decode(obs) == "<|user|>step 1<|assistant|>"
    assert result["response_mask"][0].tolist()[:3 + len(obs) + 3] == [1, 1, 1] + [0] * len(obs) + [1, 1, 1]
