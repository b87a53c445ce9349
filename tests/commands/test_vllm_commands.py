"""`rlcore generate` with `rollout.engine: vllm` on a Ray worker group: the same greedy responses as the `hf` engine,
log-probs to float tolerance. Runs where vLLM is installed (`make test-vllm`, CI)."""

from __future__ import annotations

import importlib.util
import json

import pyarrow.parquet as pq
import pytest

from rlcore.commands import main
from rlcore.engine.tiny_model import materialize_tiny

pytestmark = [pytest.mark.vllm,
              pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM is not installed (make test-vllm)")]


def test_rlcore_generate_with_vllm_gives_the_hf_engines_greedy_responses(ray_local, tmp_path):
    model = materialize_tiny(tmp_path / "models", seed=0, arch="llama", hidden_size=64, num_layers=2, num_heads=2,
                             intermediate_size=128, max_position_embeddings=64)
    data = tmp_path / "prompts.jsonl"
    data.write_text("".join(json.dumps({"prompt": p, "id": i}) + "\n" for i, p in enumerate(["12+7", "3+4", "40+2"])))
    params = tmp_path / "params.yaml"
    params.write_text("resources: {n_workers: 1}\nsft: {batch_size: 64}\ntracking: {enabled: false}\n"
                      "model: {tiny: {hidden_size: 64, num_heads: 2}}\n")
    out = {}
    for engine in ("hf", "vllm"):
        path = tmp_path / f"{engine}.parquet"
        assert main(["generate", "--model", str(model), "--data", str(data), "--out", str(path), "--max-new-tokens",
                     "8", "--temperature", "0", "--params", str(params), "--set", f"rollout.engine={engine}"]) == 0
        out[engine] = pq.read_table(path).to_pylist()
    for hf, vllm in zip(out["hf"], out["vllm"]):
        assert vllm["responses"] == hf["responses"] and vllm["finish_reasons"] == hf["finish_reasons"]
        assert vllm["response_tokens"] == hf["response_tokens"]
