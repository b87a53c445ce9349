"""`rlcore generate` on a Ray worker group: the output file's shape, and greedy responses and their
log-probs checked against transformers' own greedy decoding and a plain forward."""

from __future__ import annotations

import json

import pyarrow.parquet as pq
import pytest
import torch

from rlcore.commands import main


@pytest.fixture(scope="module")
def generated(ray_local, tiny_model_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("generate")
    data = root / "prompts.jsonl"
    rows = [{"prompt": "12+7", "id": 1},
            {"messages": [{"role": "system", "content": "add"}, {"role": "user", "content": "3+4"}], "id": 2},
            {"messages": [{"role": "user", "content": "40+2"}], "id": 3}]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    params = root / "params.yaml"
    params.write_text("resources: {n_workers: 1}\nsft: {batch_size: 64}\ntracking: {enabled: false}\n")
    out = {}
    for name, extra in (("greedy", ["--temperature", "0", "--n", "2"]),):  # sampling: tests/test_e2e_pipeline.py
        path = root / f"{name}.parquet"
        assert main(["generate", "--model", str(tiny_model_dir), "--data", str(data), "--out", str(path),
                     "--max-tokens", "6", "--params", str(params), *extra]) == 0
        out[name] = pq.read_table(path).to_pylist()
    return rows, out


def test_every_input_column_is_kept_and_each_prompt_gets_n_responses(generated):
    _, out = generated
    for name, n in (("greedy", 2),):
        assert [r["id"] for r in out[name]] == [1, 2, 3]
        for r in out[name]:
            assert all(len(r[c]) == n for c in ("responses", "response_tokens", "response_logprobs", "finish_reasons"))
            for tokens, reason in zip(r["response_tokens"], r["finish_reasons"]):
                assert 1 <= tokens <= 6
                assert reason == "stop" or tokens == 6


def greedy_reference(model, tok, messages: list[dict], max_new: int) -> tuple[str, int, float]:
    """Text, token count and summed log-prob of transformers' greedy decoding (EOS included)."""
    text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    ids = torch.tensor([tok(text, add_special_tokens=False)["input_ids"]])
    seq = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new, do_sample=False,
                         eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)[0, ids.shape[1]:]
    seq = seq[: (seq == tok.eos_token_id).nonzero()[0, 0] + 1] if (seq == tok.eos_token_id).any() else seq
    with torch.no_grad():
        logits = model(torch.cat([ids[0], seq])[None]).logits[0, ids.shape[1] - 1:-1]
    logp = torch.log_softmax(logits.float(), -1).gather(1, seq[:, None]).sum()
    return tok.decode(seq, skip_special_tokens=True), len(seq), float(logp)


def test_greedy_responses_and_log_probs_match_transformers(generated, tiny_model_dir, tiny_tokenizer):
    from transformers import AutoModelForCausalLM

    rows, out = generated
    model = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir)).eval()
    for row, got in zip(rows, out["greedy"]):
        messages = ([{"role": "user", "content": row["prompt"]}] if isinstance(row.get("prompt"), str)
                    else row.get("messages") or row["prompt"])
        text, tokens, logp = greedy_reference(model, tiny_tokenizer, messages, 6)
        assert got["responses"] == [text, text]
        assert got["response_tokens"] == [tokens, tokens]
        assert got["response_logprobs"] == pytest.approx([logp, logp], abs=1e-4)


def test_a_prompt_that_leaves_no_room_for_the_response_names_the_row(tiny_model_dir, tmp_path, capsys):
    data = tmp_path / "p.jsonl"
    data.write_text(json.dumps({"prompt": "1+1"}) + "\n" + json.dumps({"prompt": "9" * 70}) + "\n")
    with pytest.raises(SystemExit) as e:
        main(["generate", "--model", str(tiny_model_dir), "--data", str(data), "--out", str(tmp_path / "o.parquet")])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "row 1" in err and "context of 64" in err


@pytest.mark.parametrize("content, words", [
    ('{"prompt": ""}\n', ["row 0", "empty"]),
    ('{"text": "hi"}\n', ["row 0", "'prompt'"]),
    ('{"prompt": 5}\n', ["row 0", "'prompt'", "int"]),
    ("not json\n", ["line 1", "expected one JSON object per line"]),
    ('{"prompt": "1+1"}\n{"prompt": [{"role": "user", "content": "2+2"}]}\n', ["'prompt'", "list, str"]),
])
def test_bad_prompt_rows_stop_before_ray_with_one_line(tiny_model_dir, tmp_path, capsys, content, words):
    data = tmp_path / "p.jsonl"
    data.write_text(content)
    with pytest.raises(SystemExit) as e:
        main(["generate", "--model", str(tiny_model_dir), "--data", str(data), "--out", str(tmp_path / "o.parquet")])
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.strip().count("\n") == 0
    assert all(w in err for w in words), err
