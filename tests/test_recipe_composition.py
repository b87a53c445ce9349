"""rlcore.recipes and `rlcore config use`: recipes hold only what they change, params.yaml is the defaults written
out, and a recipe over the defaults is exactly the config DVC and the stages then read. (The recipes run through
DVC in tests/test_recipes.py.)"""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from rlcore.commands import main
from rlcore.config import Config, load_config
from rlcore.recipes import compose, leaf_keys, merge, read_recipe, render

REPO = Path(__file__).resolve().parents[1]
RECIPES = sorted((REPO / "examples").glob("*.yaml"))


def test_the_repository_params_yaml_is_the_defaults_written_out():
    """So a key added to the schema is a key of params.yaml (and of every recipe's params.yaml) at once: rewrite it
    with `rlcore config use` when this fails."""
    assert (REPO / "params.yaml").read_text() == render(Config()), "params.yaml is stale: run `rlcore config use`"


def dotted(mapping: dict, key: str):
    for part in key.split("."):
        mapping = mapping[part]
    return mapping


@pytest.mark.parametrize("path", RECIPES, ids=[p.stem for p in RECIPES])
def test_a_recipe_sets_only_keys_it_changes_and_reads_the_same_alone_or_over_the_defaults(path):
    recipe = read_recipe(path)
    defaults = Config().model_dump(mode="json")
    for key in leaf_keys(recipe):
        try:
            default = dotted(defaults, key)
        except (KeyError, TypeError):  # under a mapping the defaults leave empty (rm.models.<name>, task.file)
            continue
        assert dotted(recipe, key) != default, f"{path.name}: {key} is set to its default"
    cfg, origin = compose([path])
    assert cfg == load_config(path)
    assert set(origin.values()) <= {str(path)}


@pytest.mark.parametrize("path", [p for p in RECIPES if p.stem != "quick"], ids=lambda p: p.stem)
def test_every_recipe_takes_the_smoke_test_sizes_over_it(path):
    cfg, _ = compose([path, REPO / "examples/quick.yaml"])
    assert cfg.sft.steps == 4 and cfg.ppo.rounds["r1"].steps == 2 and cfg.task.n_test == 16
    kept = compose([path])[0]
    assert cfg.algorithm == kept.algorithm and cfg.reward == kept.reward  # what the recipe is about stays


def test_sections_merge_key_by_key_and_other_values_replace_whole():
    base = Config().model_dump(mode="json")
    over = {"actor": {"lora": {"rank": 8}}, "ppo": {"rounds": {"a": {"init": "models/sft", "steps": 3}}},
            "task": {"ops": ["-"]}}
    merged = merge(base, over)
    assert merged["actor"]["lora"] == {**base["actor"]["lora"], "rank": 8}
    assert merged["actor"]["lr"] == base["actor"]["lr"]
    assert merged["ppo"]["rounds"] == {"a": {"init": "models/sft", "steps": 3}}  # r1 is gone, as in a params file
    assert merged["task"]["ops"] == ["-"]


def test_config_use_writes_the_recipe_over_the_defaults_and_marks_what_it_chose(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(REPO)
    out = tmp_path / "params.yaml"
    assert main(["config", "use", "examples/dapo.yaml", "examples/quick.yaml", "--set", "seed=7",
                 "--out", str(out)]) == 0
    cfg = load_config(out)
    assert cfg.seed == 7 and cfg.ppo.dapo.dynamic_sampling and cfg.sft.steps == 4
    assert cfg.rollout == Config().rollout.model_copy(update={"n": 4})
    text = out.read_text()
    assert "dynamic_sampling: true  # <- examples/dapo.yaml" in text and "seed: 7  # <- --set" in text
    assert "steps: 4  # <- examples/quick.yaml" in text and "  lr: 0.0001\n" in text  # a default: no mark
    assert "examples/dapo.yaml then examples/quick.yaml over the defaults" in capsys.readouterr().out
    # a second recipe over a file that held values of its own says which ones it replaced
    assert main(["config", "use", "examples/rloo.yaml", "--out", str(out)]) == 0
    said = capsys.readouterr().out
    assert "ppo.dapo.dynamic_sampling=True" in said and "seed=7" in said
    assert load_config(out) == compose([REPO / "examples/rloo.yaml"])[0]


def test_a_bad_recipe_is_one_line_naming_the_file_and_key_and_nothing_is_written(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "params.yaml").write_text("seed: 3\n")
    (tmp_path / "mine.yaml").write_text(yaml.safe_dump({"actor": {"lr": -1.0}}))
    (tmp_path / "typo.yaml").write_text(yaml.safe_dump({"actor": {"learning_rate": 0.1}}))
    for name, needle in (("mine.yaml", "mine.yaml: actor.lr = -1.0"), ("typo.yaml", "unknown key 'actor.learning_rate'"),
                         ("missing.yaml", "missing.yaml: recipe file not found")):
        with pytest.raises(SystemExit) as err:
            from rlcore.commands import entry

            monkeypatch.setattr("sys.argv", ["rlcore", "config", "use", name])
            entry()
        assert err.value.code == 2
        lines = capsys.readouterr().err.strip().splitlines()
        assert len(lines) == 1 and needle in lines[0], lines
    assert (tmp_path / "params.yaml").read_text() == "seed: 3\n"


def test_the_recipes_table_gives_each_recipe_its_spread_and_says_which_are_not_measured():
    from bench.recipe_table import table
    rows = [{"seed": 1, "sft": 0.5, "final": 0.75, "gain": 0.25, "minutes": 4.0},
            {"seed": 2, "sft": 0.25, "final": 0.375, "gain": 0.125, "minutes": 6.0}]
    untimed = {k: v for k, v in rows[0].items() if k != "minutes"}
    out = table({"dapo": rows, "rlhf": [{**untimed, "measured": "then"}]}, measured="now").splitlines()
    dapo = next(line for line in out if line.startswith("| `dapo`"))
    # mean (min-max) of the SFT and after-RL columns, each seed's gain, the mean gain, the median minutes
    assert dapo == ("| `dapo` (seeds 1, 2) | 0.375 (0.250-0.500) | 0.562 (0.375-0.750) | +0.250 / +0.125 | "
                    "**+0.188** | 5 | now |")
    assert next(line for line in out if line.startswith("| `rlhf`")).endswith("| not kept | then |")
    assert next(line for line in out if line.startswith("| `grpo`")).startswith("| `grpo` | not measured |")
    assert not any(line.startswith("| `quick`") for line in out)
