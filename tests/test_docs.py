"""The documentation site, the examples and the offline `dvc plots show` page, as a user opens them.

* `mkdocs build --strict` (what `make docs` runs): a broken link, a missing page or a bad anchor fails it;
  headless Chromium, with every host unresolvable, opens the built params reference and finds the entry of
  algorithm.adv_estimator with the words `rlcore config show` prints, and no page loads anything from a network;
* every params file under examples/ validates with `rlcore config check` and is in the built examples page;
* `dvc plots show` in this repository writes a page that draws every plot in Chromium without a network.

The Chromium tests skip when no `chromium` is on PATH (.ci/run installs Debian's package).
"""

from __future__ import annotations

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
    assert main(["config", "check", "--params", str(example.relative_to(REPO_ROOT))]) == 0
    assert "ok (" in capsys.readouterr().out


def test_the_examples_page_lists_every_example_with_its_changes(site):
    page = (site / "how-to/examples.html").read_text()
    for example in EXAMPLES:
        assert f"examples/{example.name}" in page
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
