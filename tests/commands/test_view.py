"""`rlcore view` and rlcore.viewer: a rollouts parquet built by hand, rendered, and opened in headless
Chromium (`--dump-dom` gives the page after its script ran): every row in the table, a search or filter
set from the address leaves exactly the rows worked out here, model output shows as text, and the chart
has one point per step at the mean worked out here. The Chromium tests skip when no `chromium` is on
PATH (.ci/run installs Debian's package)."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from html.parser import HTMLParser
from pathlib import Path

import pandas as pd
import pytest
import yaml

from rlcore.commands import main
from rlcore.viewer import ROLLOUT_COLUMNS, RolloutsFile, render_page, rollouts_frame, rollouts_path, write_rollouts
from tests.conftest import REPO_ROOT

INJECTION = "</script><b>x</b>"
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
needs_chromium = pytest.mark.skipif(CHROMIUM is None, reason="no chromium binary on PATH (apt-get install chromium)")


def rollout(step: int, i: int, prompt: str, response: str, gt: str, reward: float, length: int) -> dict:
    return {"step": step, "policy_version": step, "uid": f"rl-{step}-{i}", "prompt": prompt, "response": response,
            "ground_truth": gt, "reward": reward, "acc": float(reward > 0), "advantage": reward - 0.5,
            "response_length": length, "log_prob": -0.5 * length}


# 3 steps x 4 rollouts. "12" appears in a prompt (rl-0-1), a response (rl-1-3) and a ground truth (rl-2-0) only.
ROWS = [
    rollout(0, 0, "3+4", "7", "7", 1.0, 2),
    rollout(0, 1, "12+30", "41", "42", 0.0, 3),
    rollout(0, 2, "5+5", "ten", "10", 0.0, 4),
    rollout(0, 3, "6+2", "8", "8", 1.0, 2),
    rollout(1, 0, "9+9", "18", "18", 1.0, 3),
    rollout(1, 1, "7+8", "15", "15", 1.0, 3),
    rollout(1, 2, "1+1", INJECTION, "2", 0.0, 18),
    rollout(1, 3, "6+6", "the answer is 12", "12x", 1.0, 17),
    rollout(2, 0, "50+62", "11", "112", 0.0, 3),
    rollout(2, 1, "4+4", "8", "8", 1.0, 2),
    rollout(2, 2, "3+3", "6", "6", 1.0, 2),
    rollout(2, 3, "2+9", "11", "11", 1.0, 3),
]


class Dom(HTMLParser):
    """What a test reads from the dumped page: the table's body rows (column -> cell text), the
    "N of M rows" count, each chart's points (step, tooltip) and every tag name seen."""

    def __init__(self, text: str):
        super().__init__()
        self.rows: list[dict[str, str]] = []
        self.count = ""
        self.points: dict[str, list[tuple[int, str]]] = {}
        self.averages: dict[str, list[float]] = {}  # each chart's moving-average line, one value per step
        self.tags: set[str] = set()
        self._cell: str | None = None
        self._in_body = self._in_count = False
        self._chart: str | None = None
        self._point: int | None = None
        self._title: str | None = None
        self.feed(text)

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        self.tags.add(tag)
        if tag == "tbody":
            self._in_body = True
        elif tag == "tr" and self._in_body:
            self.rows.append({})
        elif tag == "td" and self._in_body:
            self._cell = a["class"].split()[1]  # "num reward" / "text response": the column
            self.rows[-1][self._cell] = ""
        elif tag == "output" and a.get("id") == "count":
            self._in_count = True
        elif tag == "svg":
            self._chart = a.get("class")
            self.points[self._chart] = []
        elif tag == "polyline" and a.get("class") == "line" and self._chart:
            self.averages[self._chart] = [float(v) for v in a["data-values"].split()]
        elif tag == "circle" and self._chart:
            self._point = int(a["data-step"])
        elif tag == "title" and self._point is not None:
            self._title = ""

    def handle_endtag(self, tag):
        if tag == "tbody":
            self._in_body = False
        elif tag == "td":
            self._cell = None
        elif tag == "output":
            self._in_count = False
        elif tag == "svg":
            self._chart = None
        elif tag == "title" and self._title is not None:
            self.points[self._chart].append((self._point, self._title))
            self._title = self._point = None

    def handle_data(self, data):
        if self._cell is not None:
            self.rows[-1][self._cell] += data
        if self._in_count:
            self.count += data
        if self._title is not None:
            self._title += data


@pytest.fixture(scope="module")
def page(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("view")
    write_rollouts(ROWS, folder / "rollouts.parquet")
    assert main(["view", "--rollouts", str(folder / "rollouts.parquet")]) == 0
    return folder / "rollouts.html"


def dump_dom(page: Path, tmp_path: Path, fragment: str = "") -> Dom:
    """The page as headless Chromium leaves it after running its script (address fragment ``fragment``)."""
    proc = subprocess.run([CHROMIUM, "--headless", "--disable-gpu", "--no-sandbox", "--virtual-time-budget=5000",
                           f"--user-data-dir={tmp_path / 'chromium-profile'}", "--dump-dom", page.as_uri() + fragment],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return Dom(proc.stdout)


def searched(q: str) -> list[dict]:
    return [r for r in ROWS if any(q.lower() in r[k].lower() for k in ("prompt", "response", "ground_truth"))]


@needs_chromium
def test_the_table_shows_every_row_with_model_output_as_text_and_the_chart_one_point_per_step(page, tmp_path):
    dom = dump_dom(page, tmp_path)
    assert len(dom.rows) == len(ROWS)
    assert dom.count == f"{len(ROWS)} of {len(ROWS)} rows"
    assert [r["uid"] for r in dom.rows] == [r["uid"] for r in ROWS]  # sorted by step, file order within
    injected = next(r for r in dom.rows if r["uid"] == "rl-1-2")
    assert injected["response"] == INJECTION  # shown as text ...
    assert "b" not in dom.tags  # ... and never parsed as markup
    assert dom.rows[0]["reward"] == "1.000" and dom.rows[0]["log_prob"] == "-1.00"
    for chart, key, digits in (("reward", "reward", 3), ("length", "response_length", 2)):
        assert [s for s, _ in dom.points[chart]] == [0, 1, 2]
        for step, title in dom.points[chart]:
            values = [r[key] for r in ROWS if r["step"] == step]
            assert title == f"step {step}: {sum(values) / len(values):.{digits}f} ({len(values)} rows)"
    assert_moving_averages(dom, 0.6)  # the default smoothing


def step_means(key: str, rows: list[dict]) -> list[float]:
    steps = sorted({r["step"] for r in rows})
    return [sum(r[key] for r in rows if r["step"] == s) / sum(1 for r in rows if r["step"] == s) for s in steps]


def assert_moving_averages(dom: Dom, weight: float) -> None:
    """TensorBoard's smoothing: an exponential moving average of the step means divided by 1 - weight^n, so it
    starts at the first mean."""
    for chart, key in (("reward", "reward"), ("length", "response_length")):
        means = step_means(key, ROWS)
        expected, acc = [], 0.0
        for n, mean in enumerate(means, start=1):
            acc = weight * acc + (1 - weight) * mean
            expected.append(acc / (1 - weight**n))
        assert dom.averages[chart] == pytest.approx(expected, abs=1e-6)
        assert dom.averages[chart][1:] != pytest.approx(means[1:], abs=1e-3)  # smoothed, not the raw means


@needs_chromium
def test_the_address_sets_the_charts_smoothing(page, tmp_path):
    assert_moving_averages(dump_dom(page, tmp_path, "#smooth=0.9"), 0.9)


@needs_chromium
def test_a_search_from_the_address_leaves_the_matching_rows(page, tmp_path):
    expected = searched("12")
    assert [r["uid"] for r in expected] == ["rl-0-1", "rl-1-3", "rl-2-0"]  # prompt, response, ground truth
    dom = dump_dom(page, tmp_path, "#q=12")
    assert [r["uid"] for r in dom.rows] == [r["uid"] for r in expected]
    assert dom.count == f"3 of {len(ROWS)} rows"
    assert [s for s, _ in dom.points["reward"]] == [0, 1, 2]  # the chart follows the rows shown


@needs_chromium
def test_range_filters_and_sorting_from_the_address(page, tmp_path):
    dom = dump_dom(page, tmp_path, "#step_min=1&reward_max=0.5&len_min=3&sort=-response_length")
    expected = sorted((r for r in ROWS if r["step"] >= 1 and r["reward"] <= 0.5 and r["response_length"] >= 3),
                      key=lambda r: -r["response_length"])
    assert [r["uid"] for r in expected] == ["rl-1-2", "rl-2-0"]
    assert [r["uid"] for r in dom.rows] == [r["uid"] for r in expected]
    assert dom.count == f"2 of {len(ROWS)} rows"
    assert [s for s, _ in dom.points["length"]] == [1, 2]


def test_the_page_embeds_every_row_and_no_raw_markup_from_them(page):
    text = page.read_text()
    assert INJECTION not in text and "<b>" not in text
    assert "http://" not in text.replace("http://www.w3.org/2000/svg", "") and "https://" not in text  # no network
    blob = re.search(r'<script id="rollouts-data" type="application/json">(.*?)</script>', text, re.DOTALL).group(1)
    data = json.loads(blob)
    assert data["columns"] == list(ROLLOUT_COLUMNS)
    assert [dict(zip(data["columns"], r)) for r in data["rows"]] == ROWS


def test_a_title_with_placeholders_or_markup_is_text():
    text = render_page(rollouts_frame(ROWS[:1]), title="<i>{{DATA}}</i>")
    assert "<title>&lt;i&gt;{{DATA}}&lt;/i&gt;</title>" in text


def test_the_default_is_the_final_rounds_file_and_the_page_lands_beside_it(tmp_path, monkeypatch, capsys):
    params = {"ppo": {"rounds": {"a": {"init": "models/sft", "steps": 1}, "b": {"init": "models/ppo/a", "steps": 1}}},
              "evaluate": {"final_round": "b"}}
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(params))
    write_rollouts(ROWS[:5], tmp_path / "metrics/ppo_b_rollouts.parquet")
    write_rollouts(ROWS, tmp_path / "metrics/ppo_a_rollouts.parquet")
    monkeypatch.chdir(tmp_path)
    assert main(["view"]) == 0
    assert capsys.readouterr().out.strip() == "metrics/ppo_b_rollouts.html"
    assert "5 rollouts, 2 steps" in (tmp_path / "metrics/ppo_b_rollouts.html").read_text()
    assert not (tmp_path / "metrics/ppo_a_rollouts.html").exists()


def test_the_default_file_is_the_one_the_ppo_stage_writes():
    stage = yaml.safe_load((REPO_ROOT / "dvc.yaml").read_text())["stages"]["ppo"]["do"]
    path = rollouts_path("${key}")
    assert f"--rollouts {path}" in stage["cmd"]
    assert {path: {"cache": False}} in stage["outs"]


def run_view(argv: list[str], capsys) -> tuple[int, str]:
    with pytest.raises(SystemExit) as info:
        main(["view", *argv])
    return info.value.code, capsys.readouterr().err


def test_a_missing_file_is_one_line_naming_it(tmp_path, capsys, monkeypatch):
    code, err = run_view(["--rollouts", str(tmp_path / "nope.parquet")], capsys)
    assert code == 2
    assert err.count("\n") == 1 and "nope.parquet" in err and "not found" in err
    monkeypatch.chdir(tmp_path)  # no params.yaml: the defaults, whose final round is r1
    code, err = run_view([], capsys)
    assert code == 2
    assert err.splitlines()[-1] == ("rlcore view: error: rollouts file 'metrics/ppo_r1_rollouts.parquet' not found "
                                    "(evaluate.final_round is 'r1': run its round first, dvc repro ppo@r1)")


def test_a_file_that_is_not_parquet_is_one_line_naming_it(tmp_path, capsys):
    bad = tmp_path / "rollouts.parquet"
    bad.write_text('{"step": 0}\n')
    code, err = run_view(["--rollouts", str(bad)], capsys)
    assert code == 2
    assert err.count("\n") == 1 and str(bad) in err and "not a readable parquet" in err


def test_missing_or_mistyped_columns_are_named(tmp_path, capsys):
    path = tmp_path / "old.parquet"
    rollouts_frame(ROWS).drop(columns=["policy_version", "log_prob"]).to_parquet(path)
    code, err = run_view(["--rollouts", str(path)], capsys)
    assert code == 2 and err.count("\n") == 1
    assert "missing column(s) policy_version, log_prob" in err and str(path) in err
    rollouts_frame(ROWS).astype({"reward": str}).to_parquet(path)
    code, err = run_view(["--rollouts", str(path), "--out", str(tmp_path / "x.html")], capsys)
    assert code == 2 and "column 'reward' must be numeric" in err
    assert not (tmp_path / "x.html").exists()


def test_the_rollouts_file_follows_the_growing_rows_and_leaves_no_temporary_file(tmp_path):
    path = tmp_path / "r.parquet"
    path.write_text("a stale file of an earlier run")
    file = RolloutsFile(path)  # a round's start: an empty file with the columns
    assert list(pd.read_parquet(path).columns) == list(ROLLOUT_COLUMNS) and len(pd.read_parquet(path)) == 0
    for step in range(3):
        file.update(ROWS[: 4 * (step + 1)])  # what the trainer holds after each step
        assert pd.read_parquet(path)["uid"].tolist() == [r["uid"] for r in ROWS[: 4 * (step + 1)]]
    assert rollouts_frame(ROWS).equals(pd.read_parquet(path))
    assert [p.name for p in tmp_path.iterdir()] == ["r.parquet"]


TURNS = [{"role": "assistant", "content": '<tool_call>{"name":"add","arguments":{"a":2}}</tool_call>'},
         {"role": "tool", "name": "add", "content": "2</script><b>"}, {"role": "assistant", "content": "2"}]


@pytest.fixture(scope="module")
def agent_page(tmp_path_factory) -> Path:
    """A tool-loop round's rollouts: rows with their turns (the first rows decide the file's columns)."""
    folder = tmp_path_factory.mktemp("agent-view")
    rows = [{**r, "turns": json.dumps(TURNS)} for r in ROWS[:3]]
    RolloutsFile(folder / "rollouts.parquet").update(rows)
    assert main(["view", "--rollouts", str(folder / "rollouts.parquet")]) == 0
    return folder / "rollouts.html"


def test_a_tool_loop_rounds_file_keeps_its_turns(agent_page):
    df = pd.read_parquet(agent_page.with_suffix(".parquet"))
    assert list(df.columns) == list(ROLLOUT_COLUMNS) + ["turns"] and json.loads(df["turns"][0]) == TURNS
    blob = re.search(r'<script id="rollouts-data" type="application/json">(.*?)</script>', agent_page.read_text(),
                     re.DOTALL).group(1)
    assert json.loads(blob)["columns"][-1] == "turns"


@needs_chromium
def test_the_page_shows_each_turn_with_its_role(agent_page, tmp_path):
    dom = dump_dom(agent_page, tmp_path)
    assert len(dom.rows) == 3
    want = "".join(("tool add" if t["role"] == "tool" else t["role"]) + t["content"] for t in TURNS)
    assert dom.rows[0]["response"] == want  # role labels and contents, as text
    assert "b" not in dom.tags
