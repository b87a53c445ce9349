"""What the openai loop costs (``make bench-agent``): agent programs talking to the policy through the endpoint,
against a single-turn rollout of the same total tokens, on the same rows, model and CPU threads (static engine).

* single-turn: ``engine.generate`` of ``T`` tokens per row (EOS never ends a row early);
* openai loop: ``rows`` agents (``bench/openai_agent.py``: ``K`` requests of ``max_tokens=L``, a tool message after
  each but the last, the history sent back each time), run by the loop's agent processes against the worker's
  endpoint: every request is a chat completion over HTTP, its prompt the row's own tokens (the previous
  completions and the template's ``O`` tokens for the tool message, EOS included: the turns end at ``max_tokens``),
  the agents' requests batched into one engine call per turn; ``T = K * L + (K - 1) * O``;

The model is a random tiny decoder (``--hidden``/``--layers`` for a bigger one), sampled at temperature 1 (each
agent's rows with their own seeds). Runs alternate (single, openai, single, ...) after a first round that warms
up everything (the agent processes and the endpoint start once, as in a worker); each reports its median over
``--repeats``, the openai loop's also its seconds in the engine and its engine calls. The tokens are checked: every
agent's turns sampled their ``L`` tokens, and both runs cover the same number of tokens (but for a turn whose last
token happened to be EOS, after which the template adds none).

``--client-floor`` adds the CPU time the official ``openai`` client itself takes for the same requests, answered
in-process (no endpoint, no model): the part of the loop's cost that is the agent's own, in any framework.

    .venv/bin/python -m bench.openai_agent_cost [--rows 256] [--turns 4] [--turn-tokens 24] [--repeats 5]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch

from bench.agent_cost import add_shape_arguments, build
from rlcore.agents.openai_loop import EndpointRuntime
from rlcore.agents.spec import EndpointAgentSpec, ToolRef
from rlcore.agents.template import TurnTemplate
from rlcore.protocol import Batch
from rlcore.rollout.base import SamplingParams
from rlcore.rollout.static import StaticRolloutEngine

AGENT = str(Path(__file__).with_name("openai_agent.py"))


def measure(args) -> dict:
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as tmp:
        model, tok = build(args.hidden, args.layers, Path(tmp))
    messages = [{"role": "user", "content": "12*34"}]
    obs_ids = TurnTemplate(tok).observation_ids([{"role": "tool", "content": "k"}])
    obs = len(obs_ids) + 1  # the template's EOS after a turn cut at max_tokens, then the tool message
    total = args.turns * args.turn_tokens + (args.turns - 1) * obs
    prompt = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    ids = torch.tensor([tok(prompt, add_special_tokens=False)["input_ids"]] * args.rows)
    mask = torch.ones_like(ids)
    part = Batch({"prompts": ids, "prompt_mask": mask},
                 {"messages": [messages] * args.rows, "extra_info": [{"turns": args.turns,
                                                                      "turn_tokens": args.turn_tokens}] * args.rows})
    never_stops = StaticRolloutEngine(model, eos_token_id=-1, pad_token_id=tok.pad_token_id)
    spec = EndpointAgentSpec(agent=ToolRef(AGENT, "run"), max_requests=args.turns, processes=args.processes)
    loops = {"openai": EndpointRuntime(spec, tok)}  # each request continues from its trajectory's kept keys/values
    if args.compare_whole_history:
        loops["openai_whole"] = EndpointRuntime(spec, tok, prefix_cache_bytes=0)  # each computes its whole history
    single = SamplingParams(max_new_tokens=total, temperature=1.0)
    times: dict[str, list[float]] = {"single": [], **{f"{k}{part}": [] for k in loops
                                                       for part in ("", "_engine", "_engine_calls", "_reused")}}
    tokens: dict[str, int] = {}
    try:
        for i in range(args.repeats + 1):  # the first round warms everything up and is not counted
            g = torch.Generator().manual_seed(i)
            start = time.perf_counter()
            out = never_stops.generate(ids, mask, single, g)
            times["single"].append(time.perf_counter() - start)
            tokens["single"] = int(out["response_mask"].sum())
            for name, agents in loops.items():
                before = dict(agents.endpoint.batcher.stats) if agents.endpoint is not None else {}
                reused = never_stops.stats["prefix_tokens"]
                start = time.perf_counter()
                out = agents.batch(never_stops, part, SamplingParams(max_new_tokens=total, temperature=1.0),
                                   torch.Generator().manual_seed(i), torch.device("cpu"))
                times[name].append(time.perf_counter() - start)
                stats = agents.endpoint.batcher.stats
                times[f"{name}_engine"].append(stats["engine_seconds"] - before.get("engine_seconds", 0.0))
                times[f"{name}_engine_calls"].append(stats["engine_calls"] - before.get("engine_calls", 0))
                times[f"{name}_reused"].append(never_stops.stats["prefix_tokens"] - reused)
                assert not any(out["agent_failure"]), set(out["agent_failure"])
                tokens[name] = int(out["response_attention_mask"].sum())
                tokens[f"{name}_sampled"] = int(out["response_mask"].sum())
    finally:
        for agents in loops.values():
            agents.close()
    med = {k: statistics.median(v[1:]) for k, v in times.items()}
    out = {"rows": args.rows, "hidden": args.hidden, "layers": args.layers, "turns": args.turns,
           "turn_tokens": args.turn_tokens, "observation_tokens": obs, "tokens_per_row": total, "tokens": tokens,
           "single_s": med["single"], "agent_processes": args.processes, "threads": torch.get_num_threads()}
    for name in loops:
        out.update({f"{name}_s": med[name], f"{name}_ratio": med[name] / med["single"],
                    f"{name}_engine_s": med[f"{name}_engine"], f"{name}_engine_calls": med[f"{name}_engine_calls"],
                    f"{name}_reused_tokens": med[f"{name}_reused"]})
    return out


def client_floor(args) -> dict:
    """The official client's own CPU time for the loop's requests: the same agent program (``bench/openai_agent.py``)
    for ``rows`` agents on one event loop in this process, its client answered at once by an in-process transport
    (a canned completion of ``L`` characters, no endpoint, no model): what any server leaves the agents to pay.
    Median over ``--repeats`` of the process's CPU seconds."""
    import asyncio

    import httpx2
    import openai

    from rlcore.agents.agent_process import load_agent

    run = load_agent(AGENT, "run")
    answer = json.dumps({"id": "c", "object": "chat.completion", "created": 0, "model": "policy",
                         "choices": [{"index": 0, "finish_reason": "length",
                                      "message": {"role": "assistant", "content": "7" * args.turn_tokens}}],
                         "usage": {"prompt_tokens": 1, "completion_tokens": args.turn_tokens,
                                   "total_tokens": 1 + args.turn_tokens}}).encode()

    def handle(request):
        request.read()
        return httpx2.Response(200, content=answer, headers={"content-type": "application/json"})

    row = {"messages": [{"role": "user", "content": "12*34"}],
           "extra_info": {"turns": args.turns, "turn_tokens": args.turn_tokens}}

    async def one(row):
        http = openai.DefaultAsyncHttpxClient(transport=httpx2.MockTransport(handle))
        client = openai.AsyncOpenAI(base_url="http://rlcore/t/x/v1", api_key="x", http_client=http, max_retries=0)
        try:
            await run(client, row)
        finally:
            await http.aclose()

    async def all_agents():
        await asyncio.gather(*(one(row) for _ in range(args.rows)))

    cpu = []
    for _ in range(args.repeats + 1):
        start = time.process_time()
        asyncio.run(all_agents())
        cpu.append(time.process_time() - start)
    requests = args.rows * args.turns
    median = statistics.median(cpu[1:])
    return {"client_cpu_s": median, "client_cpu_ms_per_request": 1000 * median / requests}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_shape_arguments(ap, "agents (rows) at once", "tokens the model samples per turn")
    ap.add_argument("--processes", type=int, default=2, help="agent processes (rollout.agent.processes)")
    ap.add_argument("--compare-whole-history", action="store_true",
                    help="also the loop with no kept keys and values (each request computes its whole history), "
                         "alternating with the others")
    ap.add_argument("--client-floor", action="store_true",
                    help="also the official client's own CPU time for the same requests, answered in-process")
    args = ap.parse_args(argv)
    r = measure(args)
    if args.client_floor:
        r.update(client_floor(args))
    print(json.dumps(r))
    # (a turn whose last sampled token happens to be EOS gets no template EOS after it: a token fewer)
    loops = [k[:-len("_ratio")] for k in r if k.endswith("_ratio")]
    for name in loops:
        assert r["tokens"][f"{name}_sampled"] == args.rows * args.turns * args.turn_tokens
        assert abs(r["tokens"]["single"] - r["tokens"][name]) <= args.rows * (args.turns - 1) // 10
    print(f"{args.rows} agents x {r['tokens_per_row']} tokens ({args.turns} requests of {args.turn_tokens} tokens, "
          f"{args.turns - 1} tool messages of {r['observation_tokens']} template tokens): single-turn "
          f"{r['single_s']:.3f} s")
    for name in loops:
        what = "history from kept keys/values" if name == "openai" else "whole history computed per request"
        print(f"  openai loop ({what}): {r[f'{name}_s']:.3f} s (ratio {r[f'{name}_ratio']:.2f}; in the engine "
              f"{r[f'{name}_engine_s']:.3f} s over {r[f'{name}_engine_calls']:g} calls; "
              f"{r[f'{name}_reused_tokens']:g} prompt tokens reused)")
    if args.client_floor:
        print(f"  the openai client alone, answered in-process: {r['client_cpu_s']:.3f} s of CPU for the "
              f"{args.rows * args.turns} requests ({r['client_cpu_ms_per_request']:.2f} ms each; "
              f"{r['client_cpu_s'] / r['single_s']:.2f} of the single-turn rollout's wall time)")


if __name__ == "__main__":
    main()
