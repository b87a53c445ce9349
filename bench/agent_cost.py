"""What the tool loop costs on the static engine (``make bench-agent``): a multi-turn rollout against a single-turn
rollout of the same total tokens, on the same rows, model and CPU threads.

* single-turn: ``engine.generate`` of ``T`` tokens per row (EOS never ends a row early);
* multi-turn: the tool loop (``rlcore.agents.loop``, the engine's turn-by-turn rows) over the same prompts: ``K``
  model turns of ``L`` tokens (the last one EOS), a tool call after each but the last (a real call of
  ``bench/agent_tools.py:ping`` in the sandboxed tool processes, parsed from the turn's text by a bench parser that
  reads every turn as one call), and its observation from the chat template (``O`` tokens) appended and prefilled
  from the row's KV cache; ``T = K * L + (K - 1) * O``.

The model is a random tiny decoder (as in ``model.tiny``; ``--hidden``/``--layers`` for a bigger one), greedy. Where a
turn ends is forced (EOS at the turn's last token, never before it) on top of the engine's real logits, so both runs
compute the same forwards over the same number of tokens and only the loop's own work differs: turn ends, parsing,
tool calls, observations as chunked prefills. The multi-turn rollout runs twice: as by default, and with
``rollout.agent.deterministic`` (observations fed token by token inside the decode steps, fixed step shapes). Runs
alternate (single, multi, deterministic, single, ...) and each reports its median over ``--repeats``.

    .venv/bin/python -m bench.agent_cost [--rows 256] [--turns 4] [--turn-tokens 24] [--repeats 5]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch

from rlcore.agents.loop import AgentRuntime
from rlcore.agents.parsers import PARSERS, ParsedTurn, Parser, ToolCall
from rlcore.agents.spec import AgentSpec, ToolRef
from rlcore.engine.model import load_causal_lm, load_tokenizer
from rlcore.engine.tiny_model import materialize_tiny
from rlcore.rollout.base import SamplingParams
from rlcore.rollout.static import StaticRolloutEngine

TOOLS = str(Path(__file__).with_name("agent_tools.py"))
PARSER = "bench_every_turn"
if PARSER not in PARSERS:  # every turn is one call of ping (the bench's turns are the model's random tokens)
    PARSERS.add(PARSER, Parser(lambda text: ParsedTurn("", [ToolCall("ping", {})]), lambda calls: ""))


class ForcedTurns:
    """The static engine's rows with each turn's end forced: EOS at the turn's ``length``-th token, never before
    (the token a row samples next goes to column ``col``; its turn began at ``turn_start``)."""

    def __init__(self, inner, length: int, eos: int, trajectories):
        self.inner, self.length, self.eos, self.t = inner, length, eos, trajectories

    def force(self, rows: list[int], logits: torch.Tensor) -> torch.Tensor:
        last = torch.tensor([self.t.col[r] - self.t.turn_start[r] == self.length - 1 for r in rows])
        logits = logits.clone()  # the engine's are inference tensors
        logits[:, self.eos] = torch.where(last, 1e9, -1e9)
        return logits

    def forward(self, rows: list[int], pending: list[list[int]]) -> torch.Tensor:
        return self.force(rows, self.inner.forward(rows, pending))

    def release(self, row: int) -> None:
        self.inner.release(row)


class ForcedEngine:
    """``open_rows`` of a static engine, turns forced (:class:`ForcedTurns`)."""

    def __init__(self, engine: StaticRolloutEngine, length: int):
        self.engine, self.length = engine, length

    def open_rows(self, input_ids, attention_mask, params, *, budget, generator=None, deterministic=False):
        t = self.engine.open_rows(input_ids, attention_mask, params, budget=budget, generator=generator,
                                  deterministic=deterministic)
        forced = ForcedTurns(t.model, self.length, self.engine.eos_token_id, t)
        t.model = forced
        t.logits = forced.force(list(range(len(t))), t.logits)
        return t


def build(hidden: int, layers: int, folder: Path):
    shape = dict(arch="llama", hidden_size=hidden, num_layers=layers, num_heads=4, intermediate_size=4 * hidden,
                 max_position_embeddings=512)
    path = materialize_tiny(folder, seed=0, **shape)
    return load_causal_lm(path).eval(), load_tokenizer(path)


def measure(args) -> dict:
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as tmp:
        model, tok = build(args.hidden, args.layers, Path(tmp))
    spec = AgentSpec(tools=(ToolRef(TOOLS, "ping"),), parser=PARSER, max_turns=args.turns, processes=2)
    runtime = AgentRuntime(spec, tok)
    exact = AgentRuntime(dataclasses.replace(spec, deterministic=True), tok)
    obs = len(runtime.template.observation_ids([{"role": "tool", "name": "ping", "content": "k"}]))
    total = args.turns * args.turn_tokens + (args.turns - 1) * obs
    prompt = tok.apply_chat_template([{"role": "user", "content": "12*34"}], add_generation_prompt=True, tokenize=False)
    ids = torch.tensor([tok(prompt, add_special_tokens=False)["input_ids"]] * args.rows)
    mask = torch.ones_like(ids)
    multi = ForcedEngine(StaticRolloutEngine(model, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id),
                         args.turn_tokens)
    single = StaticRolloutEngine(model, eos_token_id=-1, pad_token_id=tok.pad_token_id)  # every row runs T tokens
    params = SamplingParams(max_new_tokens=total, greedy=True)
    times: dict[str, list[float]] = {"single": [], "multi": [], "deterministic": []}
    tokens, calls = {}, {}
    try:
        for _ in range(args.repeats + 1):  # the first round warms everything up and is not counted
            start = time.perf_counter()
            out = single.generate(ids, mask, params)
            times["single"].append(time.perf_counter() - start)
            tokens["single"] = int(out["response_mask"].sum())
            for name, rt in (("multi", runtime), ("deterministic", exact)):
                start = time.perf_counter()
                result, trajs = rt.run(multi, ids, mask, params)
                times[name].append(time.perf_counter() - start)
                tokens[name] = int(result["attention"].sum())
                calls[name] = sum(t.tool_calls for t in trajs)
    finally:
        runtime.close()
        exact.close()
    med = {k: statistics.median(v[1:]) for k, v in times.items()}
    return {"rows": args.rows, "hidden": args.hidden, "layers": args.layers, "turns": args.turns,
            "turn_tokens": args.turn_tokens, "observation_tokens": obs, "tokens_per_row": total,
            "tokens": tokens, "tool_calls": calls, "single_s": med["single"], "multi_s": med["multi"],
            "deterministic_s": med["deterministic"], "ratio": med["multi"] / med["single"],
            "deterministic_ratio": med["deterministic"] / med["single"], "threads": torch.get_num_threads()}


def add_shape_arguments(ap: argparse.ArgumentParser, rows: str, turn_tokens: str) -> None:
    """The options of a multi-turn cost bench (this one's and bench.openai_agent_cost's): the rows, their turns,
    the model's size and the repeats; ``rows`` and ``turn_tokens``: what those two mean there."""
    ap.add_argument("--rows", type=int, default=256, help=f"{rows} (default: 32 prompts x 8)")
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--turn-tokens", type=int, default=24, help=turn_tokens)
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--layers", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=5)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_shape_arguments(ap, "rows generated at once", "model tokens per turn, its EOS included")
    args = ap.parse_args(argv)
    r = measure(args)
    print(json.dumps(r))
    assert len(set(r["tokens"].values())) == 1, "every run must generate the same number of tokens"
    print(f"{args.rows} rows x {r['tokens_per_row']} tokens ({args.turns} turns of {args.turn_tokens}, "
          f"{args.turns - 1} observations of {r['observation_tokens']}; {r['tool_calls']['multi']} tool calls): "
          f"single-turn {r['single_s']:.3f} s, multi-turn {r['multi_s']:.3f} s (ratio {r['ratio']:.2f}), "
          f"deterministic {r['deterministic_s']:.3f} s (ratio {r['deterministic_ratio']:.2f})")


if __name__ == "__main__":
    main()
