"""The openai loop (rlcore.agents.openai_loop): agent programs from tests/agents/openai_agents/agents.py run in real
agent processes against the endpoint, over a scripted policy (exact token layouts: tests/agents/scripted.py) or the
tiny model on the static engine (reproducibility)."""

from __future__ import annotations

from pathlib import Path

import psutil
import pytest
import torch

from rlcore.agents.openai_loop import EndpointRuntime
from rlcore.agents.recording import FAILURE_KINDS
from rlcore.agents.spec import EndpointAgentSpec, ToolRef
from rlcore.agents.template import TurnTemplate
from rlcore.agents.trajectory_rows import endpoint_metrics
from rlcore.data.collate import encode_prompts
from rlcore.engine.tiny_model import build_char_tokenizer, build_tiny_model
from rlcore.protocol import Batch
from rlcore.rollout.base import SamplingParams
from rlcore.rollout.static import StaticRolloutEngine
from tests.agents.scripted import ScriptedChatEngine

AGENTS = str(Path(__file__).parent / "openai_agents" / "agents.py")
BUDGET = 96
CALL = '<tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}}</tool_call>'


def scripted_reply(prompt: str) -> str:
    if "<|tool|>" in prompt:
        return "5"
    if "call add" in prompt:
        return CALL
    if "malformed" in prompt:
        return '<tool_call>{"name": add}</tool_call>'
    return "hi"


@pytest.fixture(scope="module")
def tok():
    return build_char_tokenizer()


def ids(tok, text: str) -> list[int]:
    return tok(text, add_special_tokens=False)["input_ids"]


def part_of(tok, questions: list[str], **extra) -> Batch:
    messages = [[{"role": "user", "content": q}] for q in questions]
    prompts, mask = encode_prompts(tok, messages, 32, "test")
    infos = [{"index": i, **{k: v[i] for k, v in extra.items()}} for i in range(len(questions))]
    return Batch({"prompts": prompts, "prompt_mask": mask},
                 {"messages": messages, "data_source": ["test"] * len(questions), "ground_truth": ["5"] * len(questions),
                  "extra_info": infos})


def run_agents(tok, engine, part: Batch, name: str, *, greedy: bool = True, seed: int = 0,
               runtime_options: dict | None = None, **spec) -> Batch:
    runtime = EndpointRuntime(EndpointAgentSpec(agent=ToolRef(AGENTS, name), **{"processes": 1, **spec}), tok,
                              **(runtime_options or {}))
    try:
        return runtime.batch(engine, part, SamplingParams(max_new_tokens=BUDGET, greedy=greedy),
                             torch.Generator().manual_seed(seed), torch.device("cpu"))
    finally:
        runtime.close()


def response_of(out: Batch, i: int) -> list[int]:
    return out["responses"][i][out["response_attention_mask"][i].bool()].tolist()


def test_a_react_agent_is_one_row_of_the_tokens_sampled_and_the_template_between(tok):
    """Call, tool result, answer: one row whose prompt is what the agent sent first and whose response is the first
    completion as sampled (EOS included), the chat template's tokens for the tool message (mask 0), the answer; the
    second engine call's prompt is that row's own token ids (nothing re-tokenized); the log-probs are the engine's;
    the agent's return value is the reward; the call came back in OpenAI's tool_calls format."""
    engine = ScriptedChatEngine(tok, scripted_reply)
    out = run_agents(tok, engine, part_of(tok, ["call add"]), "react")
    eos = tok.eos_token_id
    prompt = ids(tok, "<s><|user|>call add<|assistant|>")
    observation = TurnTemplate(tok).observation_ids([{"role": "tool", "content": "5"}])
    assert tok.decode(observation) == "<|tool|>5<|assistant|>"
    first, answer = ids(tok, CALL) + [eos], ids(tok, "5") + [eos]
    assert out["prompts"][0][out["prompt_mask"][0].bool()].tolist() == prompt
    assert response_of(out, 0) == first + observation + answer
    mask = out["response_mask"][0][: len(first + observation + answer)].tolist()
    assert mask == [1] * len(first) + [0] * len(observation) + [1] * len(answer)
    expected = [-(j + 1) / 100 for j in range(len(first))] + [0.0] * len(observation) + [-0.01, -0.02]
    assert torch.allclose(out["rollout_log_probs"][0][: len(expected)], torch.tensor(expected), atol=0, rtol=0)
    assert [p for p, _ in engine.calls] == [[prompt], [prompt + first + observation]]
    assert out["agent_reward"][0] == 1.0 and out["agent_reward_extras"][0] == {"turns": 4}
    assert out["agent_failure"][0] == "" and out["agent_rows"][0] == 1 and out["agent_turns"][0] == 2
    assert out["agent_tool_calls"][0] == 1 and out["agent_final"][0] == "5"
    assert [m["role"] for m in out["agent_messages"][0]] == ["user", "assistant", "tool", "assistant"]


def test_an_agent_that_edits_its_history_gets_a_row_per_conversation(tok):
    """The second request does not extend the first completion: its completion is a row of its own (its prompt its
    messages through the template), the first conversation's row goes with it for training, and it is counted."""
    engine = ScriptedChatEngine(tok, scripted_reply)
    out = run_agents(tok, engine, part_of(tok, ["hello"]), "edit_history")
    eos = tok.eos_token_id
    assert out["agent_rows"][0] == 2 and out["agent_reward"][0] == 0.5
    assert out["prompts"][0][out["prompt_mask"][0].bool()].tolist() == ids(tok, "<s><|user|>summary: hi<|assistant|>")
    assert response_of(out, 0) == ids(tok, "hi") + [eos]
    (extra,) = out["agent_extra_rows"][0]
    assert extra["prompt"] == ids(tok, "<s><|user|>hello<|assistant|>") and extra["response"] == ids(tok, "hi") + [eos]
    assert extra["mask"] == [1] * 3
    assert endpoint_metrics(out, FAILURE_KINDS)["split"] == 1.0


def test_a_call_that_cannot_be_read_comes_back_as_plain_content(tok):
    out = run_agents(tok, ScriptedChatEngine(tok, scripted_reply), part_of(tok, ["malformed"]), "malformed")
    assert out["agent_reward"][0] == 1.0 and out["agent_tool_calls"][0] == 0


def test_every_way_an_agent_fails_is_counted_and_the_others_go_on(tok):
    """One batch: each row's agent misbehaves in its own way; each failure has its kind and the failure reward, the
    well-behaved rows (and the one whose agent finds no network) their reward, and the agents' processes are gone
    after the runtime closes."""
    behaviors = ["ok", "raise", "sleep", "bad_return", "bad_request", "budget", "max_turns", "no_call", "network"]
    part = part_of(tok, ["hello"] * len(behaviors), behavior=behaviors)
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    out = run_agents(tok, ScriptedChatEngine(tok, scripted_reply), part, "misbehave", processes=2, timeout_s=3.0,
                     max_requests=3, failure_reward=-1.0)
    kinds = dict(zip(behaviors, out["agent_failure"]))
    assert kinds == {"ok": "", "raise": "raised", "sleep": "timeout", "bad_return": "bad_return",
                     "bad_request": "bad_request", "budget": "budget", "max_turns": "max_turns",
                     "no_call": "no_model_call", "network": ""}
    assert [out["agent_reward"][i] for i in range(len(behaviors))] == [1.0, -1.0, -1.0, -1.0, -1.0, -1.0, -1.0, -1.0, 1.0]
    m = endpoint_metrics(out, FAILURE_KINDS)
    assert m["failures"] == 7 and m["failures/timeout"] == 1 and m["failures/budget"] == 1
    left = {p.pid for p in psutil.Process().children(recursive=True)} - before
    assert not [p for p in left if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]


def test_an_agent_that_holds_its_process_is_a_timeout_and_its_neighbours_are_lost(tok):
    """Row 0 never yields (time.sleep): past its time limit its process ends itself naming it; the rows that shared
    the process are lost, the other process's rows finish; the next call gets a fresh process."""
    part = part_of(tok, ["hello"] * 4)
    out = run_agents(tok, ScriptedChatEngine(tok, scripted_reply), part, "block", processes=2, timeout_s=2.0)
    assert list(out["agent_failure"]) == ["timeout", "", "lost", ""]
    out = run_agents(tok, ScriptedChatEngine(tok, scripted_reply), part, "exits", processes=1, timeout_s=30.0)
    assert set(out["agent_failure"]) == {"exited"}


@pytest.fixture(scope="module")
def tiny_engine(tok):
    model = build_tiny_model(tok, arch="llama", hidden_size=64, num_layers=2, num_heads=4, intermediate_size=128,
                             max_position_embeddings=256, seed=3).eval()
    return StaticRolloutEngine(model, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)


def test_agents_give_the_same_rows_however_their_requests_interleave(tok, tiny_engine):
    """The same agents, seed and model: the same tokens, masks, log-probs and rewards, bit for bit, with one agent
    process or three, the engine batching everything it can or each request alone, and agents that pause for
    random times before each request (each request is sampled with its own seed, and the static engine's rows do
    not depend on their company)."""
    part = part_of(tok, [f"what is {i}+{i}?" for i in range(6)])
    runs = []
    for processes, rows, wait_s in ((1, 512, 0.5), (3, 1, 0.0)):
        reused = tiny_engine.stats["prefix_tokens"]
        runs.append(run_agents(tok, tiny_engine, part, "chatty", greedy=False, seed=5, processes=processes,
                               runtime_options={"max_batch_rows": rows, "fill_wait_s": wait_s}))
        # every second request continued from its first completion's keys and values
        assert tiny_engine.stats["prefix_tokens"] - reused >= 6 * len(part["prompts"][0].nonzero()), "no reuse"
    first, second = runs
    for key in ("prompts", "responses", "response_mask", "rollout_log_probs"):
        assert torch.equal(first[key], second[key]), key
    assert list(first["agent_reward"]) == list(second["agent_reward"])
    assert len({tuple(r) for r in first["responses"].tolist()}) > 1  # the rows differ from each other



def test_requests_that_continue_from_kept_keys_and_values_sample_what_whole_histories_would(tok, tiny_engine):
    """The static engine keeps each trajectory's keys and values after a completion, and its next request computes
    only what the agent added: the same tokens as the loop that computes every request's whole history
    (``prefix_cache_bytes=0``), log-probs within float rounding; the kept ones are let go when the trajectories
    end. With no room for them (a 1-byte cap) every request computes its whole history: the rows of the loop
    without them, bit for bit, and the endpoint counts the completions it could not keep."""
    part = part_of(tok, [f"what is {i}+{i}?" for i in range(5)])
    runs, reused, full = {}, {}, {}
    for name, cap in (("kept", None), ("whole", 0), ("no_room", 1)):
        before = tiny_engine.stats["prefix_tokens"]
        runtime = EndpointRuntime(EndpointAgentSpec(agent=ToolRef(AGENTS, "chatty"), processes=1), tok,
                                  **({} if cap is None else {"prefix_cache_bytes": cap}))
        try:
            runs[name] = runtime.batch(tiny_engine, part, SamplingParams(max_new_tokens=BUDGET, greedy=True),
                                       torch.Generator().manual_seed(2), torch.device("cpu"))
            assert runtime.endpoint.prefixes == {} and runtime.endpoint.prefix_bytes == 0
            full[name] = runtime.endpoint.prefix_stats["full"]
        finally:
            runtime.close()
        reused[name] = tiny_engine.stats["prefix_tokens"] - before
    assert reused["whole"] == reused["no_room"] == 0 and reused["kept"] > 0
    assert full["kept"] == full["whole"] == 0 and full["no_room"] >= len(part["prompts"])
    # each trajectory counts its own, and the step's metric says the cap binds
    assert runs["no_room"]["agent_kv_not_kept"].tolist() == runs["no_room"]["agent_turns"].tolist()
    assert runs["kept"]["agent_kv_not_kept"].sum() == 0
    assert endpoint_metrics(runs["no_room"], FAILURE_KINDS)["kv_not_kept"] == full["no_room"]
    for key in ("prompts", "responses", "response_mask", "rollout_log_probs"):
        assert torch.equal(runs["no_room"][key], runs["whole"][key]), key
    for key in ("prompts", "responses", "response_mask"):
        assert torch.equal(runs["kept"][key], runs["whole"][key]), key
    torch.testing.assert_close(runs["kept"]["rollout_log_probs"], runs["whole"]["rollout_log_probs"], atol=1e-4,
                               rtol=0)


def test_the_endpoints_http_answers_what_openais_api_would_for_each_kind_of_request(tok, tiny_engine, tmp_path):
    """The chat route answered below FastAPI (rlcore.agents.endpoint_app.ChatRoute) keeps the API's answers: a
    completion; 400 naming the field of a body that does not validate, which fails the trajectory (bad_request);
    404 at a base URL with no trajectory; 413 for a body over the limit, before it is read; 500 without internals
    for a bug, which the endpoint keeps for the caller to raise; other routes still FastAPI's."""
    import httpx2 as httpx  # (what the openai client brings)

    from rlcore.agents.endpoint import AgentEndpoint, EndpointServer
    from rlcore.agents.endpoint_app import agent_app
    from rlcore.agents.recording import TrajectoryRecord
    from rlcore.serve.batcher import Sampling

    endpoint = AgentEndpoint(tok, tiny_engine, device=torch.device("cpu"), context_length=256,
                             vocab_size=len(tok), fill_wait_s=0.0, prefix_cache_bytes=1 << 20)
    socket = str(tmp_path / "endpoint.sock")
    chat = {"model": "policy", "messages": [{"role": "user", "content": "2+3?"}], "max_tokens": 4}
    with EndpointServer(agent_app(endpoint), socket) as server, \
            httpx.Client(transport=httpx.HTTPTransport(uds=socket), base_url="http://rlcore") as http:
        ok, bad, buggy = server.call(endpoint.open, [TrajectoryRecord(seed=i, budget=64, prompt_width=32)
                                                     for i in range(3)], Sampling(1, 1.0), max_requests=4)
        answer = http.post(f"/t/{ok}/v1/chat/completions", json=chat)
        assert answer.status_code == 200, answer.text
        assert answer.json()["choices"][0]["message"]["role"] == "assistant"
        assert answer.json()["usage"]["completion_tokens"] == 4
        assert http.get(f"/t/{ok}/v1/models").json()["data"][0]["id"] == "policy"

        invalid = http.post(f"/t/{bad}/v1/chat/completions", json={"model": "policy", "max_tokens": 4})
        assert invalid.status_code == 400 and invalid.json()["error"]["param"] == "messages", invalid.text
        assert endpoint.records[bad].failure == "bad_request"

        assert http.post("/t/nobody/v1/chat/completions", json=chat).json()["error"]["code"] == "not_found"
        too_big = http.post(f"/t/{ok}/v1/chat/completions", content=b"x" * (endpoint.options.max_body_bytes + 1),
                            headers={"content-type": "application/json"})
        assert too_big.status_code == 413 and too_big.json()["error"]["code"] == "request_too_large"

        def broken(*args):
            raise RuntimeError("internal detail")

        endpoint._plan = broken
        crash = http.post(f"/t/{buggy}/v1/chat/completions", json=chat)
        assert crash.status_code == 500 and "internal detail" not in crash.text, crash.text
        assert crash.json()["error"]["type"] == "server_error"
        assert [str(e) for e in endpoint.bugs] == ["internal detail"]
        assert endpoint.records[ok].completions == 1 and endpoint.records[ok].failure is None
