"""The documentation site, the examples and the offline `dvc plots show` page, as a user opens them.

* `mkdocs build --strict` (what `make docs` runs): a broken link, a missing page or a bad anchor fails it;
  headless Chromium, with every host unresolvable, opens the built params reference and finds the entry of
  algorithm.adv_estimator with the words `rlcore config show` prints, and no page loads anything from a network;
* every params file under examples/ validates with `rlcore config check` and is in the built examples page;
* `dvc plots show` in this repository writes a page that draws every plot in Chromium without a network;
* what a reader who has only the repository sees: no absolute path of one machine in docs/, README.md or
  bench/*.md; the committed reference pages equal what the code writes; every figure block of README and the results
  pages equals what its stored results render (bench.figures), and the recipes page's table what bench.recipe_table
  renders from the same data; the built-in model's size as the code builds it; every page in the site's navigation.

The Chromium tests skip when no `chromium` is on PATH (.ci/run installs Debian's package).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from html.parser import HTMLParser
from pathlib import Path

import pytest

from rlcore.commands import COMMANDS, main
from tests.conftest import REPO_ROOT

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
needs_chromium = pytest.mark.skipif(CHROMIUM is None, reason="no chromium binary on PATH (apt-get install chromium)")
EXAMPLES = sorted((REPO_ROOT / "examples").glob("*.yaml"))


def chromium_dom(url: str, tmp_path: Path) -> str:
    """The page as offline headless Chromium leaves it after its scripts ran (every host name unresolvable)."""
    proc = subprocess.run([CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run",
                           "--disable-background-networking", "--disable-component-update", "--disable-sync",
                           "--host-resolver-rules=MAP * ~NOTFOUND", f"--user-data-dir={tmp_path / 'profile'}",
                           "--virtual-time-budget=5000", "--dump-dom", url],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


class Section(HTMLParser):
    """The text of the page between the heading with id ``anchor`` and the next heading of its level."""

    def __init__(self, html: str, anchor: str):
        super().__init__()
        self.anchor, self.level, self.text, self.heading = anchor, None, "", ""
        self._in_heading = False
        self.feed(html)

    def handle_starttag(self, tag, attrs):
        if re.fullmatch(r"h[1-6]", tag):
            if dict(attrs).get("id") == self.anchor:
                self.level, self._in_heading = tag, True
            elif self.level is not None and tag <= self.level:
                self.level = "done"

    def handle_endtag(self, tag):
        if self._in_heading and tag == self.level:
            self._in_heading = False

    def handle_data(self, data):
        if self._in_heading:
            self.heading += data
        elif self.level not in (None, "done"):
            self.text += data


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("site")
    proc = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(out)], cwd=REPO_ROOT,
                          capture_output=True, text=True, timeout=300, env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return out


def test_no_page_loads_anything_from_a_network(site):
    pages = list(site.rglob("*.html"))
    assert len(pages) >= 20
    for page in pages:
        text = page.read_text()
        loads = re.findall(r'<(?:script|img|iframe|source)\b[^>]*\ssrc="(https?:[^"]*)"', text)
        loads += [tag for tag in re.findall(r"<link\b[^>]*>", text)
                  if re.search(r'href="https?:', tag) and not re.search(r'rel="(?:canonical|alternate)"', tag)]
        assert not loads, f"{page.relative_to(site)} loads {loads}"
    for png in ("default-recipe", "speed-trl", "async"):
        assert (site / "results/img" / f"{png}.png").read_bytes()[:4] == b"\x89PNG"


@needs_chromium
def test_the_params_reference_has_each_keys_entry_with_the_words_config_show_prints(site, tmp_path, capsys):
    assert main(["config", "show", "algorithm.adv_estimator", "--params", str(REPO_ROOT / "params.yaml")]) == 0
    shown = capsys.readouterr().out.strip().splitlines()[-1]  # "key (type; default ...): the whole doc"
    doc = shown.split("): ", 1)[1]
    dom = chromium_dom((site / "reference/params.html").as_uri() + "#algorithm.adv_estimator", tmp_path)
    entry = Section(dom, "algorithm.adv_estimator")
    assert entry.heading.strip().startswith("algorithm.adv_estimator")
    text = " ".join(entry.text.split())
    assert doc in text and "default grpo" in text and "type str" in text
    bounded = Section(dom, "task.pairs.flip_rate")  # a key with a range shows it
    assert "range >= 0.0, <= 1.0" in " ".join(bounded.text.split())


def test_the_command_reference_has_every_command_and_its_options(site):
    page = (site / "reference/commands.html").read_text()
    for name in COMMANDS:
        assert f'id="{name}"' in page, name
    assert "--max-body-bytes" in page and "--grid" in page  # serve's and compare's options, from argparse


@pytest.mark.parametrize("example", EXAMPLES, ids=[p.stem for p in EXAMPLES])
def test_every_example_says_what_it_shows_and_passes_config_check(example, monkeypatch, capsys):
    first = example.read_text().splitlines()[0]
    assert first.startswith("# ") and len(first) > 30, f"{example.name}: first line should say what it shows"
    monkeypatch.chdir(REPO_ROOT)  # the examples' task and reward files are relative to the repository
    check = ["config", "check", "--params", str(example.relative_to(REPO_ROOT))]
    if example.stem == "distill":  # its teacher is another pipeline's policy, copied aside by the user first
        with pytest.raises(SystemExit) as refused:
            main(check)
        assert refused.value.code == 2
        assert "distill.teacher 'models/teacher': not a model folder" in capsys.readouterr().err
        check += ["--set", "distill.teacher=models/sft"]
    assert main(check) == 0
    assert "ok (" in capsys.readouterr().out


def test_the_examples_page_lists_every_example_with_its_changes(site):
    page = (site / "how-to/examples.html").read_text()
    for example in EXAMPLES:
        assert f"examples/{example.name}" in page
    # a recipe's description is its whole leading comment, not its first line cut mid-sentence
    assert "RL with the tool loop has to raise tool use and accuracy" in page
    row = re.search(r"<td><code>examples/rloo\.yaml</code></td>.*?</tr>", page, re.S).group(0)
    assert "algorithm.adv_estimator: rloo" in row and "actor.lr" not in row  # only what it changes


@needs_chromium
def test_dvc_plots_show_renders_every_plot_offline(tmp_path):
    """DVC's own page loads Vega from a CDN and stays blank offline; .dvc/config points it at the inlined one."""
    out = tmp_path / "plots"
    bin_dir = Path(sys.executable).parent
    proc = subprocess.run([str(bin_dir / "dvc"), "plots", "show", "-o", str(out)], cwd=REPO_ROOT,
                          capture_output=True, text=True, timeout=300, env={"PATH": f"{bin_dir}:/usr/bin:/bin"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    page = (out / "index.html").read_text()
    assert "cdn.jsdelivr" not in page and "<script src=" not in page
    plots = re.findall(r"vegaEmbed\('#", page)
    dom = chromium_dom((out / "index.html").as_uri(), tmp_path)
    drawn = re.findall(r'<canvas[^>]*class="marks"', dom)
    assert len(drawn) == len(plots) >= 3  # sft.csv, ppo_r1.csv, reward_vs_accuracy: each one drawn


# the folders of one machine: a path under them in a page is a path a reader does not have
MACHINE_PATH = re.compile(r"(?<![\w.~-])/(?:work|tmp|home|Users|root|opt|mnt|var|srv|scratch)/")


def reader_pages() -> list[Path]:
    return [REPO_ROOT / "README.md", *sorted(REPO_ROOT.glob("bench/*.md")),
            *(p for p in sorted((REPO_ROOT / "docs").rglob("*")) if p.suffix in (".md", ".json", ".csv", ".yml"))]


def test_no_page_names_an_absolute_path_of_one_machine():
    found = [f"{p.relative_to(REPO_ROOT)}:{n}: {line.strip()[:100]}" for p in reader_pages()
             for n, line in enumerate(p.read_text().splitlines(), 1) if MACHINE_PATH.search(line)]
    assert not found, "\n".join(found)
    assert MACHINE_PATH.search("--keep /work/runs/calc") and MACHINE_PATH.search("sqlite:////work/main/mlflow.db")
    assert not MACHINE_PATH.search("bench/_work/async/x.json ~/.cache/rlcore https://example.org/tmp/x")


def test_the_committed_reference_pages_are_what_the_code_writes():
    import importlib.util

    spec = importlib.util.spec_from_file_location("rlcore_docs_reference", REPO_ROOT / "docs/hooks/reference.py")
    reference = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(reference)
    for rel, text in reference.reference_pages().items():
        assert (REPO_ROOT / "docs" / rel).read_text() == text, f"docs/{rel} is stale: make reference"


def test_every_figure_block_is_what_its_stored_results_render():
    import bench.figures
    from bench.recipe_table import table

    assert bench.figures.stale() == [], "python -m bench.figures"
    blocks = {m["name"] for p in bench.figures.pages() for m in bench.figures.BLOCK.finditer(p.read_text())}
    assert {"make-run", "grpo-over-seeds", "recipes-summary", "seeds.rlhf", "async"} <= blocks
    readme = (REPO_ROOT / "README.md").read_text()
    rendered = bench.figures.BLOCKS["make-run"]()
    assert f"**{json.loads((REPO_ROOT / 'metrics/eval.json').read_text())['final/greedy_pass@1']:.3f}**" in rendered
    assert rendered in readme
    data = json.loads((REPO_ROOT / "docs/results/data/recipes.json").read_text())
    assert table(data) in (REPO_ROOT / "docs/results/recipes.md").read_text(), "python -m bench.recipe_table"
    for name, rows in data.items():  # each row says when, where and at which code it was measured
        assert all(r.get("measured") and r.get("commit") for r in rows), name


def test_two_variants_of_a_recipe_are_set_side_by_side_seed_by_seed(monkeypatch):
    """distill - grpo gains: 0.25, 0.125, 0.375 (mean 0.25, sd 0.125, t(0.975, 2) = 4.3027: 0.25 +- 0.3105, p of
    t = 0.25 / (0.125 / sqrt 3) = 3.464 with 2 degrees of freedom: 0.0742); round seconds 120 / 100, 90 / 100,
    150 / 100: median ratio 1.20; a seed only one variant has is left out."""
    import bench.figures

    def row(seed, sft, final, round_s):
        return {"seed": seed, "sft": sft, "final": final, "gain": final - sft, "round_s": round_s,
                "steps_per_s": 400 / round_s, "trained_tokens_per_s": 1000.0, "measured": "today, here",
                "commit": "abc"}

    data = {"distill": [row(1, 0.25, 0.75, 120), row(2, 0.5, 0.75, 90), row(3, 0.125, 0.75, 150)],
            "distill_grpo": [row(1, 0.25, 0.5, 100), row(2, 0.5, 0.625, 100), row(3, 0.125, 0.375, 100),
                             row(4, 0.5, 0.5, 100)]}
    monkeypatch.setattr(bench.figures, "_recipes", lambda: data)
    out = bench.figures.paired_seeds("distill", "distill_grpo", "distill", "GRPO", "the command")()
    assert "| 1 | 0.250 | 0.750 / 0.500 | +0.500 / +0.250 | **+0.250** | 120 / 100 | 1000 / 1000 |" in out
    assert "| 4 |" not in out
    assert "**+0.250 [-0.061, +0.561]**" in out and "p = 0.074" in out
    assert "**1.20x**" in out and "steps per second 0.83x" in out
    assert "`the command`: today, here; code: abc." in out


def test_the_built_in_models_size_is_stated_as_the_code_builds_it():
    from rlcore.config import Config
    from rlcore.engine.tiny_model import build_char_tokenizer, build_tiny_model

    tiny = Config().model.tiny
    model = build_tiny_model(build_char_tokenizer(), seed=0, **tiny.model_dump())
    size = sum(p.numel() for p in model.parameters())
    for page in ("README.md", "docs/getting-started.md"):
        assert f"{size / 1e6:.2f}M parameters" in (REPO_ROOT / page).read_text(), page
    assert f"({size:,}: hidden {tiny.hidden_size}, {tiny.num_layers} layers" in (REPO_ROOT / "README.md").read_text()
    for p in reader_pages():
        assert not re.search(r"\b\d+k parameters", p.read_text()), p  # one statement of it, in one unit


def test_every_committed_page_is_in_the_sites_navigation():
    import yaml

    nav = json.dumps(yaml.safe_load((REPO_ROOT / "mkdocs.yml").read_text())["nav"])
    pages = [p.relative_to(REPO_ROOT / "docs").as_posix() for p in (REPO_ROOT / "docs").rglob("*.md")]
    assert [p for p in pages if f'"{p}"' not in nav] == []
