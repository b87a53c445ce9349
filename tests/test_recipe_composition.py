"""rlcore.recipes and `rlcore config use` / `refresh`: a recipe is a whole params file whose changes from the defaults
are marked, every recipe is current with this rlcore's keys, params.yaml is the defaults written out, and recipes
stack by what they change. (The recipes run through DVC in tests/test_recipes.py.)"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import yaml

from rlcore.commands import main
from rlcore.config import Config, load_config
from rlcore.recipes import changes, compose, leaf_keys, marked, merge, read_recipe, refresh, render

REPO = Path(__file__).resolve().parents[1]
RECIPES = sorted((REPO / "examples").glob("*.yaml"))


def test_the_repository_params_yaml_is_the_defaults_written_out():
    """So a key added to the schema is a key of params.yaml (and of every recipe's params.yaml) at once: rewrite it
    with `rlcore config use` when this fails."""
    assert (REPO / "params.yaml").read_text() == render(Config()), "params.yaml is stale: run `rlcore config use`"


@pytest.mark.parametrize("path", RECIPES, ids=[p.stem for p in RECIPES])
def test_every_recipe_holds_every_key_and_marks_exactly_what_it_changes(path, monkeypatch):
    """What `cp examples/<recipe>.yaml params.yaml && dvc repro` needs: every key of this rlcore (a key added to
    the schema, or a default changed, fails this until `make recipes` has written it into every recipe), the file as
    `rlcore config refresh --follow-defaults` writes it, and a `<-` mark on exactly the keys whose value is not the
    default."""
    monkeypatch.chdir(REPO)
    text = path.read_text()
    assert text == refresh(path.relative_to(REPO), follow_defaults=True), f"{path.name}: not current: `make recipes`"
    assert leaf_keys(read_recipe(path)) == leaf_keys(Config().model_dump(mode="json"))
    marks = set(marked(text))
    changed = leaf_keys(changes(path))
    related = lambda a, b: a == b or a.startswith(b + ".") or b.startswith(a + ".")  # noqa: E731
    assert all(any(related(m, c) for c in changed) for m in marks), (marks, changed)
    assert all(any(related(m, c) for m in marks) for c in changed), (marks, changed)
    assert load_config(path) == compose([path])[0]


def test_refresh_brings_a_file_from_an_older_rlcore_up_to_date_and_refuses_a_key_it_no_longer_has(
        tmp_path, monkeypatch, capsys):
    """A params file written before a key existed (here: without `actor.loss.clip_ratio_high` and the whole `evaluate`
    section) gets those keys at their defaults, keeps its own values, marks and leading comment."""
    monkeypatch.chdir(tmp_path)
    text = (REPO / "examples/dapo.yaml").read_text()
    old = [line for line in text.splitlines() if not line.startswith("    clip_ratio_high")]
    old = old[: next(i for i, line in enumerate(old) if line.startswith("evaluate:")) - 1]
    assert "clip_ratio_high" not in "\n".join(old) and "evaluate:" not in "\n".join(old)
    (tmp_path / "mine.yaml").write_text("\n".join(old) + "\n")
    assert main(["config", "refresh", "--check", "mine.yaml"]) == 1
    assert main(["config", "refresh", "mine.yaml"]) == 0
    new = (tmp_path / "mine.yaml").read_text()
    assert new.splitlines()[0] == text.splitlines()[0]  # its own header
    cfg = load_config(tmp_path / "mine.yaml")
    assert cfg.actor.loss.clip_ratio_high == Config().actor.loss.clip_ratio_high and cfg.evaluate == Config().evaluate
    assert cfg.actor.loss.clip_ratio_low == 0.2 and cfg.ppo.dapo.dynamic_sampling  # what the file changed stays
    assert "    clip_ratio_low: 0.2  # <- examples/dapo.yaml" in new  # each mark keeps its source
    assert main(["config", "refresh", "--check", "mine.yaml"]) == 0
    capsys.readouterr()
    (tmp_path / "gone.yaml").write_text(new.replace("seed: 42", "seed: 42\nold_knob: 1"))
    (tmp_path / "mine.yaml").write_text("\n".join(old) + "\n")  # stale again: an error anywhere writes nothing
    with pytest.raises(SystemExit) as err:
        main(["config", "refresh", "mine.yaml", "gone.yaml"])
    assert err.value.code == 2
    assert capsys.readouterr().err.strip() == "rlcore config: error: gone.yaml: unknown key 'old_knob'"
    assert (tmp_path / "mine.yaml").read_text() == "\n".join(old) + "\n"


def test_a_copied_recipe_stays_current_and_a_changed_default_reaches_the_recipes_only_with_follow_defaults(
        tmp_path, monkeypatch):
    """`cp examples/dapo.yaml params.yaml`: refresh finds it current (its marks keep their source). A default that
    changed since a recipe was written (here: the file holds 0.5 for `sft.grad_clip`, unmarked, where today's
    default is 1.0): `--follow-defaults` (make recipes) gives the key today's default and keeps the marked ones;
    a plain refresh keeps the value and marks it, as it would a value set by hand."""
    monkeypatch.chdir(tmp_path)
    text = (REPO / "examples/dapo.yaml").read_text()
    (tmp_path / "params.yaml").write_text(text)
    assert main(["config", "refresh", "--check", "params.yaml"]) == 0
    assert refresh("params.yaml") == text
    assert "  grad_clip: 1.0\n" in text
    (tmp_path / "params.yaml").write_text(text.replace("  grad_clip: 1.0\n", "  grad_clip: 0.5\n", 1))
    followed = refresh("params.yaml", follow_defaults=True)
    assert followed == text
    kept = load_config_text(refresh("params.yaml"), tmp_path)
    assert kept.sft.grad_clip == 0.5 and kept.actor.loss.clip_ratio_high == 0.28
    assert "  grad_clip: 0.5  # <- params.yaml\n" in refresh("params.yaml")


def load_config_text(text: str, folder: Path):
    (folder / "shown.yaml").write_text(text)
    return load_config(folder / "shown.yaml")


def test_a_value_at_its_default_changes_nothing_so_whole_recipes_stack():
    """A whole recipe over another keeps the first one's changes (it holds their keys at their defaults); an
    override is how a key goes back to its default."""
    dapo, _ = compose([REPO / "examples/dapo.yaml"])
    assert compose([REPO / "examples/dapo.yaml", REPO / "examples/grpo.yaml"])[0] == dapo
    assert compose([REPO / "examples/grpo.yaml", REPO / "examples/dapo.yaml"])[0] == dapo
    back, origin = compose([REPO / "examples/dapo.yaml"], {"actor.loss.clip_ratio_high": Config().actor.loss.clip_ratio_high})
    assert back.actor.loss.clip_ratio_high == Config().actor.loss.clip_ratio_high
    assert origin["actor.loss.clip_ratio_high"] == "--set"


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
    # mean (min-max) of the SFT and after-RL columns, each seed's gain, the mean gain with its 95% interval
    # (0.1875 ± t(0.975, 1) sd / sqrt(2) = 0.1875 ± 12.7062 * 0.0625), the median minutes
    assert dapo == ("| `dapo` (seeds 1, 2) | 0.375 (0.250-0.500) | 0.562 (0.375-0.750) | +0.250 / +0.125 | "
                    "**+0.188 [-0.607, +0.982]** | 5 | now |")
    assert next(line for line in out if line.startswith("| `rlhf`")).endswith("| not kept | then |")
    assert next(line for line in out if line.startswith("| `grpo`")).startswith("| `grpo` | not measured |")
    assert not any(line.startswith("| `quick`") for line in out)


def test_the_recipes_are_compared_with_grpo_seed_by_seed_where_they_share_its_task_and_machine():
    """rloo - grpo: 0.25, 0, 0.25 (mean 1/6, sd 0.1443, t = 2 with 2 degrees of freedom: p = 1 - 2 / sqrt(6));
    gsm8k has another task, lora another machine, dapo no rows, distill a control of its own (distill_grpo): all left
    out, each with its reason, so Holm's correction is over one test."""
    from bench.recipe_table import against_grpo
    here = "2026-11-27, 2-core AMD EPYC (AVX2), portable kernels"
    there = "2026-11-26, 2-core Intel Xeon, native kernels"

    def rows(gains, measured=here):
        return [{"seed": s, "sft": 0.5, "final": 0.5 + g, "gain": g, "measured": measured}
                for s, g in enumerate(gains, 1)]

    out = "\n".join(against_grpo({"grpo": rows([0.25, 0.125, 0.25]), "rloo": rows([0.5, 0.125, 0.5]),
                                   "gsm8k": rows([0.1, 0.1, 0.1]), "lora": rows([0.2, 0.2, 0.2], there),
                                   "distill": rows([0.3, 0.3, 0.3]), "distill_grpo": rows([0.2, 0.2, 0.2])}))
    assert "## Against `grpo`" in out and "adjusted for the 1 test by" in out
    p = f"{1 - 2 / math.sqrt(6):.3f}"
    assert f"| rloo | 3 | +0.167 [-0.192, +0.525] | {p} | {p} | no |" in out
    left_out = out.rsplit("Not compared with `grpo`: ", 1)[1]
    assert {"`gsm8k` (another task)", "`lora` (no `grpo` rows on 2-core Intel Xeon with native kernels)",
            "`dapo` (not measured)", "`distill` (compared with its own GRPO control `distill_grpo`)"} \
        <= set(left_out.removesuffix(".").split(", ")), left_out
    assert "`rloo`" not in left_out


def test_a_recipe_measured_with_other_kernels_is_paired_with_grpo_s_rows_of_those_kernels():
    """grpo's rows from before a change of the kernels' arithmetic, kept as grpo_<why>, pair the recipes measured
    beside them; today's grpo rows pair today's. rloo - old grpo: 0.25, 0, 0.25 (p = 1 - 2 / sqrt(6), as above);
    dapo - grpo: 0.1, 0.1, 0.1 exactly (no spread: the interval is the point)."""
    from bench.recipe_table import against_grpo
    old = "2026-11-27, 2-core AMD EPYC (AVX2), portable kernels of then"
    new = "2026-11-28, 2-core AMD EPYC (AVX2), portable kernels of now"

    def rows(gains, measured):
        return [{"seed": s, "sft": 0.5, "final": 0.5 + g, "gain": g, "measured": measured}
                for s, g in enumerate(gains, 1)]

    out = "\n".join(against_grpo({"grpo": rows([0.1, 0.2, 0.3], new), "grpo_then": rows([0.25, 0.125, 0.25], old),
                                   "rloo": rows([0.5, 0.125, 0.5], old), "dapo": rows([0.2, 0.3, 0.4], new)}))
    today, then = out.split("## Against `grpo_then`")
    assert "## Against `grpo`" in today and "| dapo | 3 | +0.100" in today and "rloo" not in today
    p = f"{1 - 2 / math.sqrt(6):.3f}"
    assert f"| rloo | 3 | +0.167 [-0.192, +0.525] | {p} | {p} | no |" in then and "dapo |" not in then
    assert "measured on 2-core AMD EPYC (AVX2), portable kernels of then" in then
