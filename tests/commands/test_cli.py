"""The `rlcore` command: help for every subcommand, config show/check, eval's numbers, init-model, export.

Everything here runs in-process and without Ray; generation is in test_generate.py and the
generate -> eval agreement with the evaluate stage in tests/test_e2e_pipeline.py.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from rlcore.commands import COMMANDS, _module, main
from tests.conftest import REPO_ROOT


def run_cli(argv: list[str], capsys) -> tuple[int, str, str]:
    try:
        code = main(argv)
    except SystemExit as e:  # argparse (--help, usage errors) and stage_errors exit this way
        code = e.code if isinstance(e.code, int) else 1
    out = capsys.readouterr()
    return code, out.out, out.err


def test_top_level_help_lists_every_command_with_its_line_and_starts_nothing_heavy():
    code = ("import sys, contextlib, io\n"
            "from rlcore.commands import main\n"
            "buf = io.StringIO()\n"
            "with contextlib.redirect_stdout(buf):\n"
            "    try: main(['--help'])\n"
            "    except SystemExit: pass\n"
            "heavy = sorted(m for m in ('torch', 'ray', 'pandas', 'pyarrow', 'transformers', 'fastapi') if m in sys.modules)\n"
            "print(buf.getvalue()); print('HEAVY', heavy)\n")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True, check=True).stdout
    flat = "".join(out.split())  # argparse wraps lines (at spaces and after hyphens)
    for name in COMMANDS:
        line = "".join(f"{name} {_module(name).HELP}".split())
        assert line in flat, f"{name} and its line missing from rlcore --help:\n{out}"
    assert out.strip().endswith("HEAVY []"), out


@pytest.mark.parametrize("name", COMMANDS)
def test_every_command_has_help_with_an_example(name, capsys):
    code, out, _ = run_cli([name, "--help"], capsys)
    assert code == 0
    assert "example:\n  rlcore " in out


def test_config_show_marks_an_override_with_its_default_and_doc(capsys):
    code, out, _ = run_cli(["config", "show", "algorithm", "--params", str(REPO_ROOT / "params.yaml"),
                            "--set", "algorithm.adv_estimator=rloo", "--json"], capsys)
    assert code == 0
    rows = {r["key"]: r for r in json.loads(out)}
    assert all(k.startswith("algorithm.") for k in rows)
    est = rows["algorithm.adv_estimator"]
    assert (est["value"], est["default"], est["changed"]) == ("rloo", "grpo", True)
    assert est["doc"].startswith("Advantage estimator")
    assert rows["algorithm.gamma"]["changed"] is False
    assert rows["algorithm.kl_ctrl.type"]["value"] == "fixed"  # nested sections are flattened

    code, out, _ = run_cli(["config", "show", "algorithm.adv_estimator", "--set", "algorithm.adv_estimator=rloo",
                            "--params", str(REPO_ROOT / "params.yaml")], capsys)
    line = [ln for ln in out.splitlines() if "adv_estimator" in ln and ln.startswith(("* ", "  "))]  # table rows
    assert len(line) == 1 and line[0].startswith("* algorithm.adv_estimator") and "rloo" in line[0] and "grpo" in line[0]
    # one key: then its type, default and whole doc, as the docs' params reference has them
    assert out.splitlines()[-1].startswith("algorithm.adv_estimator (str; default grpo): Advantage estimator from ")


def test_config_show_of_an_unknown_key_suggests_the_close_one(capsys):
    code, _, err = run_cli(["config", "show", "rollout.topp", "--params", str(REPO_ROOT / "params.yaml")], capsys)
    assert code == 2
    assert err.strip().count("\n") == 0 and "rollout.top_p" in err


def test_config_show_changed_on_the_defaults_says_so(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)  # no params.yaml: the built-in defaults
    code, out, _ = run_cli(["config", "show", "--changed"], capsys)
    assert code == 0 and out.strip() == "# built-in defaults: every key is at its default (`rlcore config show` lists " \
        "them all)"
    code, out, _ = run_cli(["config", "show", "rollout", "--changed", "--set", "rollout.top_p=0.9"], capsys)
    assert code == 0 and "* rollout.top_p" in out and "every key" not in out


def test_config_check_exits_0_on_valid_params_and_2_with_one_line_on_bad_ones(tmp_path, capsys):
    params = REPO_ROOT / "params.yaml"
    assert run_cli(["config", "check", "--params", str(params)], capsys)[0] == 0
    code, _, err = run_cli(["config", "check", "--params", str(params), "--set", "ppo.train_batch_size=-3"], capsys)
    assert code == 2 and "ppo.train_batch_size" in err and err.strip().count("\n") == 0
    code, _, err = run_cli(["config", "check", "--params", str(params), "--set", "seed.x=1"], capsys)
    assert code == 2 and "seed" in err
    bad = tmp_path / "p.yaml"
    bad.write_text("rollout: {engine: vllm}\n")
    code, _, err = run_cli(["config", "check", "--params", str(bad)], capsys)
    assert code == 2 and "rollout.engine" in err and "vllm" in err


USER_REWARDS = REPO_ROOT / "tests" / "rewards" / "user_rewards.py"


@pytest.mark.parametrize("function, needle", [
    ("faulty", None),
    ("no_such", "user_rewards.py has no function 'no_such' (it defines: "),
    ("two_arguments", "cannot be called as fn(data_source, solution_str, ground_truth, extra_info)"),
])
def test_config_check_calls_each_reward_function_once_on_a_task_row(tmp_path, capsys, function, needle):
    """The task's rows and the reward files, before any stage: a file task's first row, then each function
    called on it with its ground truth as the answer (here "7" and "x": faulty returns the number, or raises)."""
    train = tmp_path / "train.jsonl"
    train.write_text('{"prompt": "3+4", "ground_truth": "7", "demonstration": "7"}\n')
    params = tmp_path / "p.yaml"
    params.write_text(json.dumps({"task": {"name": "file", "file": {"train": str(train), "test": str(train)}},
                                  "reward": {"functions": [{"path": str(USER_REWARDS), "name": function}]}}))
    code, out, err = run_cli(["config", "check", "--params", str(params)], capsys)
    if needle is None:
        assert code == 0 and f"reward function faulty ({USER_REWARDS}:faulty): imports, called once on {train}: " \
            "row 0: ok" in out and f"task.file.train: {train}: readable, first row ok" in out, out
        return
    assert code == 2 and needle in err and f"fails on {train}: row 0" in err and err.strip().count("\n") == 0, err
    train.write_text('{"prompt": "3+4", "ground_truth": "x"}\n')
    code, _, err = run_cli(["config", "check", "--params", str(params)], capsys)
    assert code == 2 and "train.jsonl: row 0 (line 1): no column 'demonstration', which task.columns.demonstration " \
        "names (the SFT demonstration); the file's columns: 'prompt', 'ground_truth'" in err, err


def write_generations(path: Path, rows: list[dict]) -> None:
    pq.write_table(pa.Table.from_pylist(rows), path)


def arithmetic(gt: str, responses: list[str]) -> dict:
    return {"data_source": "arithmetic", "prompt": [{"role": "user", "content": "?"}],
            "reward_model": {"style": "rule", "ground_truth": gt}, "responses": responses}


def test_eval_reports_pass_at_k_per_data_source_with_the_unbiased_estimator(tmp_path, capsys):
    gen = tmp_path / "gen.parquet"
    write_generations(gen, [
        arithmetic("5", ["5", "6", "5", " 5 "]),             # 3 of 4 correct
        arithmetic("10", ["1", "2", "10", "x"]),             # 1 of 4
        {**arithmetic("42", ["#### 42", "no", "#### 41", "so #### 42"]), "data_source": "gsm8k"},  # 2 of 4
    ])
    out_json = tmp_path / "eval.json"
    code, out, _ = run_cli(["eval", "--generations", str(gen), "--k", "2", "--out", str(out_json)], capsys)
    assert code == 0
    res = json.loads(out_json.read_text())
    # pass@2 = 1 - C(n-c, 2) / C(4, 2): c=3 -> 1, c=1 -> 1 - 3/6, c=2 -> 1 - 1/6
    assert res["pass@1"] == pytest.approx((3 / 4 + 1 / 4 + 2 / 4) / 3)
    assert res["pass@k"] == pytest.approx((1 + 0.5 + 5 / 6) / 3)
    assert res["mean_reward"] == pytest.approx(6 / 12)
    assert (res["n_prompts"], res["k"]) == (3, 2)
    ar, gs = res["by_data_source"]["arithmetic"], res["by_data_source"]["gsm8k"]
    assert (ar["n_prompts"], ar["pass@1"], ar["pass@k"]) == (2, pytest.approx(0.5), pytest.approx(0.75))
    assert (gs["n_prompts"], gs["pass@1"], gs["pass@k"]) == (1, pytest.approx(0.5), pytest.approx(5 / 6))
    table = out.splitlines()
    assert table[0].split() == ["data_source", "prompts", "responses", "mean_reward", "pass@1", "pass@2"]
    assert [ln.split()[0] for ln in table[1:4]] == ["arithmetic", "gsm8k", "all"]


@pytest.mark.parametrize("row, k, words", [
    ({"prompt": "1+1", "responses": ["2"], "reward_model": {"ground_truth": "2"}}, 1, ["row 0", "data_source"]),
    ({**arithmetic("2", ["2"]), "data_source": "nope"}, 1, ["row 0", "'nope'", "arithmetic"]),
    ({**arithmetic("2", ["2"]), "reward_model": {"style": "rule"}}, 1, ["row 0", "ground_truth"]),
    (arithmetic("2", ["2", "3"]), 4, ["row 0", "2 responses", "k=4"]),
])
def test_eval_stops_on_a_bad_row_with_one_line_naming_it(tmp_path, capsys, row, k, words):
    gen = tmp_path / "gen.parquet"
    write_generations(gen, [row])
    code, _, err = run_cli(["eval", "--generations", str(gen), "--k", str(k)], capsys)
    assert code == 2 and err.strip().count("\n") == 0, err
    assert all(w in err for w in words), err


def test_eval_of_a_file_that_is_not_parquet_names_it(tmp_path, capsys):
    gen = tmp_path / "gen.parquet"
    gen.write_text("not parquet")
    code, _, err = run_cli(["eval", "--generations", str(gen), "--k", "1"], capsys)
    assert code == 2 and str(gen) in err and "not a parquet file" in err


def test_init_model_writes_a_folder_the_stages_load_and_generate_from(tmp_path, capsys):
    import torch

    from rlcore.engine.model import ModelSpec, load_rollout_model, load_tokenizer, resolve_model_path
    from rlcore.rollout import EngineSpec, SamplingParams, make_engine

    out = tmp_path / "qwen"
    code, text, _ = run_cli(["init-model", "--arch", "qwen2", "--hidden-size", "48", "--num-layers", "2",
                             "--num-heads", "4", "--max-position-embeddings", "64", "--out", str(out)], capsys)
    assert code == 0 and "model.path=" in text
    config = json.loads((out / "config.json").read_text())
    assert (config["model_type"], config["hidden_size"], config["num_hidden_layers"],
            config["num_attention_heads"], config["intermediate_size"]) == ("qwen2", 48, 2, 4, 192)
    folder = resolve_model_path(str(out), tiny_shape={}, seed=0)
    tok = load_tokenizer(folder)
    model = load_rollout_model(ModelSpec(path=str(folder)), torch.device("cpu"))
    engine = make_engine(model, EngineSpec(name="static"), eos_token_id=tok.eos_token_id,
                         pad_token_id=tok.pad_token_id)
    ids = torch.tensor([tok(tok.apply_chat_template([{"role": "user", "content": "1+2"}], add_generation_prompt=True,
                                                    tokenize=False), add_special_tokens=False)["input_ids"]])
    out_ids = engine.generate(ids, torch.ones_like(ids), SamplingParams(max_new_tokens=5, greedy=True))["responses"]
    reference = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=5, do_sample=False,
                               eos_token_id=None, pad_token_id=tok.pad_token_id)[:, ids.shape[1]:]
    assert torch.equal(out_ids[:, :reference.shape[1]], reference)  # a random model: EOS is unlikely, 5 tokens

    assert run_cli(["init-model", "--arch", "llama", "--hidden-size", "48", "--num-layers", "1", "--num-heads", "5",
                    "--out", str(tmp_path / "bad")], capsys)[0] == 2
    code, _, err = run_cli(["init-model", "--arch", "llama", "--hidden-size", "48", "--num-layers", "1",
                            "--num-heads", "4", "--out", str(out)], capsys)
    assert code == 2 and "exists" in err


def test_export_reloads_with_from_pretrained_and_gives_the_same_logits(tiny_model_dir, tmp_path, capsys):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = tmp_path / "exported"
    code, text, _ = run_cli(["export", "--model", str(tiny_model_dir), "--out", str(out)], capsys)
    assert code == 0 and "max |logit difference| 0" in text
    tok = AutoTokenizer.from_pretrained(str(out))
    ids = torch.tensor([tok("<s><|user|>12+30<|assistant|>", add_special_tokens=False)["input_ids"]])
    src = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir))
    dst = AutoModelForCausalLM.from_pretrained(str(out))
    with torch.no_grad():
        assert torch.equal(src(ids).logits, dst(ids).logits)

    half = tmp_path / "bf16"
    assert run_cli(["export", "--model", str(tiny_model_dir), "--out", str(half), "--dtype", "bfloat16"], capsys)[0] == 0
    assert AutoModelForCausalLM.from_pretrained(str(half)).dtype == torch.bfloat16


def test_export_refuses_a_critic_folder_and_a_missing_one(tiny_model_dir, tmp_path, capsys):
    from transformers import AutoModelForTokenClassification

    critic = tmp_path / "critic"
    AutoModelForTokenClassification.from_pretrained(str(tiny_model_dir), num_labels=1).save_pretrained(critic)
    code, _, err = run_cli(["export", "--model", str(critic), "--out", str(tmp_path / "x")], capsys)
    assert code == 2 and "not a causal LM" in err
    # the positional model is --model's old spelling: still taken, with a note
    code, _, err = run_cli(["export", str(tmp_path / "nothing"), "--out", str(tmp_path / "y")], capsys)
    assert code == 2 and "config.json" in err and "the old spelling of --model" in err
    code, _, err = run_cli(["export", "--out", str(tmp_path / "z")], capsys)
    assert code == 2 and "--model DIR" in err and err.count("\n") == 1


def test_the_commands_that_generate_spell_their_flags_alike(capsys):
    """generate, serve and export take the model as --model; generate and serve the response cap as --max-tokens
    (the API's max_tokens); the old spellings still parse."""
    from rlcore.commands import build_parser

    parser = build_parser()
    common = ["--model", "m", "--max-tokens", "5"]
    assert parser.parse_args(["generate", *common, "--data", "d", "--out", "o"]).max_tokens == 5
    assert parser.parse_args(["serve", *common]).max_tokens == 5
    assert parser.parse_args(["generate", "--model", "m", "--data", "d", "--out", "o", "--max-new-tokens", "7"]
                             ).max_tokens == 7
    assert parser.parse_args(["export", "--model", "m", "--out", "o"]).model == "m"


def test_init_model_names_what_is_missing_once(tmp_path, capsys):
    code, _, err = run_cli(["init-model", "--out", str(tmp_path / "m")], capsys)
    assert code == 2 and err.startswith("rlcore init-model: error: give --arch, --hidden-size") and \
        err.count("init-model") == 1, err
