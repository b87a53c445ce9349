"""Tests for rlcore.config: defaults, params.yaml loading, and one-line errors that name the key.

The stage CLI tests run ``python -m stages.ppo`` the way DVC does and check that bad input
stops it quickly, with the key on stderr.
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import yaml
from pydantic import BaseModel

from rlcore import names
from rlcore.stage.frame import stage_errors
from rlcore.config import Config, ConfigError, load_config, parse_config

from .conftest import REPO_ROOT


def defaults_raw() -> dict[str, Any]:
    """The default config as the plain mapping a params.yaml would hold."""
    return Config().model_dump(mode="json")


def write_params(path: Path, raw: dict[str, Any]) -> Path:
    path.write_text(yaml.safe_dump(raw, sort_keys=False))
    return path


def with_value(raw: dict[str, Any], dotted: str, value: Any) -> dict[str, Any]:
    *parents, leaf = dotted.split(".")
    node = raw
    for p in parents:
        node = node[p]
    node[leaf] = value
    return raw


def leaves(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """{'a': {'b': 1}} -> {'a.b': 1}; ppo.rounds entries count as leaves (their keys are names)."""
    out = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict) and v and key != "ppo.rounds":
            out.update(leaves(v, key + "."))
        else:
            out[key] = v
    return out


def config_error(tmp_path: Path, dotted: str, value: Any) -> str:
    path = write_params(tmp_path / "params.yaml", with_value(defaults_raw(), dotted, value))
    with pytest.raises(ConfigError) as info:
        load_config(path)
    return str(info.value)


# ------------------------------------------------------------------ defaults and loading
def test_default_config_validates_when_given_explicitly():
    # Pydantic does not validate defaults; passing them as input runs every validator on them.
    assert parse_config(defaults_raw()) == Config()


def test_empty_params_file_gives_the_defaults(tmp_path):
    assert load_config(write_params(tmp_path / "p.yaml", {})) == Config()


def test_params_yaml_values_are_loaded_unchanged_and_the_rest_are_defaults():
    raw = yaml.safe_load((REPO_ROOT / "params.yaml").read_text())
    loaded = leaves(load_config(REPO_ROOT / "params.yaml").model_dump(mode="json"))
    default = leaves(defaults_raw())
    written = leaves(raw)
    for key, value in loaded.items():
        if key in written:
            assert value == written[key], key
        else:
            assert value == default[key], key


def test_params_yaml_lists_every_knob():
    """params.yaml is the one file a user edits: every config key appears in it."""
    written = leaves(yaml.safe_load((REPO_ROOT / "params.yaml").read_text()))
    missing = sorted(set(leaves(defaults_raw())) - set(written))
    assert not missing, f"params.yaml does not list: {missing}"


def test_overrides_set_dotted_keys(tmp_path):
    path = write_params(tmp_path / "p.yaml", {})
    cfg = load_config(path, {"algorithm.adv_estimator": "rloo", "sft.lr": 0.5})
    assert cfg.algorithm.adv_estimator == "rloo" and cfg.sft.lr == 0.5
    assert cfg.actor == Config().actor


def _section_models(model: type[BaseModel], seen: set) -> None:
    for f in model.model_fields.values():
        for arg in (f.annotation, *getattr(f.annotation, "__args__", ())):
            if isinstance(arg, type) and issubclass(arg, BaseModel) and arg not in seen:
                seen.add(arg)
                _section_models(arg, seen)


def test_every_field_of_every_section_has_a_docstring():
    sections: set = set()
    _section_models(Config, sections)
    assert len(sections) >= 14  # the 13 top-level sections and the nested ones (tiny, kl_ctrl, dapo, rounds)
    undocumented = [f"{m.__name__}.{name}" for m in sections for name, f in m.model_fields.items()
                    if not (f.description or "").strip()]
    undocumented += [f"Config.{name}" for name, f in Config.model_fields.items()
                     if f.annotation not in sections and not f.description]
    assert not undocumented


# ------------------------------------------------------------------ one-line errors
def assert_one_line(msg: str, *needles: str) -> None:
    assert "\n" not in msg, msg
    for n in needles:
        assert n in msg, f"{n!r} not in {msg!r}"


def test_unknown_estimator_lists_allowed_names(tmp_path):
    msg = config_error(tmp_path, "algorithm.adv_estimator", "foo")
    assert_one_line(msg, "algorithm.adv_estimator", "'foo'", *names.ADV_ESTIMATORS)


def test_negative_batch_size(tmp_path):
    assert_one_line(config_error(tmp_path, "sft.batch_size", -4), "sft.batch_size", "-4")


def test_unknown_key(tmp_path):
    assert_one_line(config_error(tmp_path, "actor.lrr", 0.1), "actor.lrr", "unknown key")


def test_wrong_type(tmp_path):
    assert_one_line(config_error(tmp_path, "sft.steps", "many"), "sft.steps", "'many'", "integer")


def test_params_file_names_itself(tmp_path):
    msg = config_error(tmp_path, "sft.batch_size", -4)
    assert msg.startswith(str(tmp_path / "params.yaml"))


def test_fewer_samples_than_k_names_the_key_and_value(tmp_path):
    raw = with_value(with_value(defaults_raw(), "evaluate.k", 8), "evaluate.n_samples", 4)
    with pytest.raises(ConfigError) as info:
        load_config(write_params(tmp_path / "params.yaml", raw))
    assert_one_line(str(info.value), "evaluate.n_samples", "4", "8")


def test_batch_size_not_divisible_by_workers_names_both_keys_and_stays_short(tmp_path):
    msg = config_error(tmp_path, "sft.batch_size", 63)
    assert_one_line(msg, "sft.batch_size", "63", "resources.n_workers")
    # One readable line, not a dump of the whole params mapping.
    assert "'tracking'" not in msg and len(msg) < 300, msg


@pytest.mark.parametrize("key", ["reshard_after_forward", "ref_reshard_after_forward"])
def test_reshard_switches_are_refused_outside_fsdp(tmp_path, key):
    raw = with_value(with_value(defaults_raw(), "resources.strategy", "ddp"), f"resources.{key}", True)
    with pytest.raises(ConfigError) as info:
        load_config(write_params(tmp_path / "params.yaml", raw))
    assert_one_line(str(info.value), f"resources.{key}", "resources.strategy", "'ddp'", "'fsdp'")
    fsdp = with_value(raw, "resources.strategy", "fsdp")
    assert getattr(load_config(write_params(tmp_path / "ok.yaml", fsdp)).resources, key) is True


def test_unknown_strategy_names_the_choices(tmp_path):
    msg = config_error(tmp_path, "resources.strategy", "zero3")
    assert_one_line(msg, "resources.strategy", "zero3", "ddp", "fsdp")


def test_missing_params_file(tmp_path):
    with pytest.raises(ConfigError, match="nope.yaml.*not found"):
        load_config(tmp_path / "nope.yaml")


# ------------------------------------------------------------------ stage CLI
def run_ppo_stage(params: Path, data: str, tmp_path: Path) -> tuple[subprocess.CompletedProcess, float]:
    cmd = [sys.executable, "-m", "stages.ppo", "--params", str(params), "--round", "r1",
           "--init", str(tmp_path / "init"), "--data", data, "--rewards", str(tmp_path / "rewards"),
           "--out", str(tmp_path / "out"),
           "--metrics", str(tmp_path / "m.json")]
    start = time.monotonic()
    proc = subprocess.run(cmd, cwd=REPO_ROOT, capture_output=True, text=True, timeout=10)
    return proc, time.monotonic() - start


@pytest.mark.parametrize(
    "dotted, value, needle",
    [("algorithm.adv_estimator", "foo", "algorithm.adv_estimator"),
     ("ppo.train_batch_size", -32, "ppo.train_batch_size")],
)
def test_stage_fails_fast_on_bad_params(tmp_path, dotted, value, needle):
    params = write_params(tmp_path / "bad.yaml", with_value(defaults_raw(), dotted, value))
    proc, seconds = run_ppo_stage(params, str(tmp_path / "data.parquet"), tmp_path)
    assert proc.returncode == 2
    assert seconds < 10
    assert needle in proc.stderr and "Traceback" not in proc.stderr, proc.stderr
    assert not (tmp_path / "m.json").exists()


def test_loading_and_validating_params_imports_nothing_heavy():
    """Every stage validates params.yaml first; doing so must not pull in torch, pandas, pyarrow or ray
    (a stage fails fast on bad params, and rlcore/config.py's dependencies stay light)."""
    code = ("import sys; from rlcore.stage.frame import stage_config; from stages import prepare, sft, score, ppo, evaluate; "
            "from rlcore.config import Config; stage_config('params.yaml', tuple(Config.model_fields), 'x'); "
            "print(sorted({m.split('.')[0] for m in sys.modules} & {'torch', 'pandas', 'pyarrow', 'ray', 'numpy', "
            "'transformers', 'mlflow'}))")
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]"


def test_bad_input_is_one_line_and_exit_2_while_a_bug_keeps_its_traceback(capsys):
    with pytest.raises(SystemExit) as info:
        with stage_errors("demo"):
            raise ConfigError("params.yaml: sft.lr = -1: must be > 0")
    assert info.value.code == 2
    assert capsys.readouterr().err == "demo: error: params.yaml: sft.lr = -1: must be > 0\n"
    with pytest.raises(KeyError, match="oops"):  # a KeyError from a bug is not turned into bad input
        with stage_errors("demo"):
            {}["oops"]
    with pytest.raises(SystemExit) as info:
        with stage_errors("demo"):
            raise KeyboardInterrupt
    assert info.value.code == 130


# a parent that starts a "stage" (stage_errors around a training loop that never ends by itself), says its pid and
# exits when told to: as `dvc repro` does when it is killed (it does not pass SIGTERM on to the stage)
ORPHANING_PARENT = """
import subprocess, sys
child = subprocess.Popen([sys.executable, "-c", sys.argv[1]], stdout=open(sys.argv[2], "w"), stderr=subprocess.STDOUT)
print(child.pid, flush=True)
sys.stdin.readline()
"""
STAGE = """
import time
from rlcore.stage.frame import stage_errors
from rlcore.interrupt import training_loop
with stage_errors("demo"):
    with training_loop() as stop:
        print("in the loop", flush=True)
        while not stop.requested:
            time.sleep(0.05)
        print("step done, stopping", flush=True)
        stop.stop_now()
"""


def running(pid: int) -> bool:
    """Whether ``pid`` is alive and not a zombie waiting to be reaped."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_a_stage_whose_parent_exits_stops_as_on_sigterm(tmp_path):
    """`dvc repro` killed leaves no stage training on, orphaned: the stage gets SIGTERM when its parent exits,
    lets the step in flight finish and ends with SIGTERM's one line."""
    import time

    out = tmp_path / "stage.out"
    parent = subprocess.Popen([sys.executable, "-c", ORPHANING_PARENT, STAGE, str(out)], cwd=REPO_ROOT,
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    pid = int(parent.stdout.readline())
    deadline = time.monotonic() + 60
    while "in the loop" not in out.read_text() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert running(pid)
    parent.stdin.close()  # the parent exits
    parent.wait(timeout=30)
    while running(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not running(pid), "the orphaned stage is still running"
    text = out.read_text()
    assert "step done, stopping" in text and "demo: terminated (SIGTERM)" in text, text


def test_a_bug_in_a_real_stage_prints_its_traceback_and_exits_1(tmp_path):
    code = ("import sys; import rlcore.trainer.prepare as p; "
            "p.write_splits = lambda cfg, out: {}['missing_key']; "
            "import stages.prepare as s; s.main(sys.argv[1:])")
    proc = subprocess.run([sys.executable, "-c", code, "--inputs", str(tmp_path / "in"), "--out-dir", str(tmp_path / "d"),
                           "--metrics", str(tmp_path / "m.json")], cwd=REPO_ROOT, capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 1
    assert "Traceback" in proc.stderr and "KeyError: 'missing_key'" in proc.stderr


def test_bad_data_rows_end_a_real_stage_with_one_line_naming_the_row(tmp_path):
    bad = tmp_path / "train.jsonl"
    bad.write_text('{"question": "1+1?", "answer": "#### 2"}\n{"question": "2+2?"}\n')
    raw = with_value(with_value(defaults_raw(), "task.name", "gsm8k"), "task.file", {"train": str(bad), "test": str(bad)})
    params = write_params(tmp_path / "params.yaml", raw)
    from rlcore.inputs import write_manifest

    for split in ("train", "test"):  # what dvc.yaml's task_file stages record
        write_manifest(bad, tmp_path / "in" / f"{split}.json")
    proc = subprocess.run([sys.executable, "-m", "stages.prepare", "--params", str(params), "--inputs",
                           str(tmp_path / "in"), "--out-dir", str(tmp_path / "d"), "--metrics", str(tmp_path / "m.json")],
                          cwd=REPO_ROOT, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "train.jsonl" in lines[0] and "line 2" in lines[0] and "answer" in lines[0], lines


def test_stage_fails_fast_on_a_missing_data_file(tmp_path):
    raw = with_value(defaults_raw(), "tracking.enabled", False)
    params = write_params(tmp_path / "good.yaml", raw)
    missing = str(tmp_path / "no_such_dir" / "rl_train.parquet")
    proc, seconds = run_ppo_stage(params, missing, tmp_path)
    assert proc.returncode == 2 and seconds < 10
    assert missing in proc.stderr and "Traceback" not in proc.stderr, proc.stderr


# ------------------------------------------------------------------ asynchronous rounds
def test_async_keys_are_read_under_their_yaml_names(tmp_path):
    cfg = load_config(write_params(tmp_path / "p.yaml", {"ppo": {"mode": "async", "async": {"max_staleness": 0}},
                                                         "resources": {"n_workers": 1}}),
                      {"ppo.async.queue_size": 5})
    assert (cfg.ppo.async_.max_staleness, cfg.ppo.async_.queue_size) == (0, 5)
    assert cfg.model_dump(mode="json")["ppo"]["async"]["queue_size"] == 5  # MLflow params and fingerprints


@pytest.mark.parametrize("raw, needles", [
    ({"ppo": {"mode": "async"}}, ("ppo.mode async needs", "= 3 CPUs", "ray.num_cpus 2")),
    ({"ppo": {"mode": "async", "dapo": {"dynamic_sampling": True}}, "resources": {"n_workers": 1}},
     ("ppo.dapo.dynamic_sampling", "ppo.mode async")),
    ({"ppo": {"mode": "async"}, "algorithm": {"adv_estimator": "remax"}, "resources": {"n_workers": 1}},
     ("remax", "ppo.mode sync")),
    ({"actor": {"off_policy": {"correction": "tis"}}}, ("actor.off_policy.correction tis", "recompute_log_prob")),
    ({"ppo": {"mode": "async", "async": {"max_staleness": 0}}, "resources": {"n_workers": 1},
      "actor": {"off_policy": {"correction": "mis"}}}, ("actor.off_policy.correction mis",)),
    ({"actor": {"off_policy": {"low": 2.0, "high": 1.0}}}, ("actor.off_policy.low 2.0", "high 1.0")),
])
def test_async_and_off_policy_settings_that_cannot_work_are_one_line(tmp_path, raw, needles):
    with pytest.raises(ConfigError) as err:
        load_config(write_params(tmp_path / "p.yaml", raw))
    assert_one_line(str(err.value), *needles)


def test_a_correction_with_proximal_log_probs_is_accepted(tmp_path):
    for raw in ({"actor": {"recompute_log_prob": True, "off_policy": {"correction": "icepop"}}},
                {"ppo": {"mode": "async", "async": {"max_staleness": 2}}, "resources": {"n_workers": 1},
                 "actor": {"off_policy": {"correction": "tis"}}}):
        assert load_config(write_params(tmp_path / "p.yaml", raw)).actor.off_policy.correction != "none"


ASYNC_ONE_RANK = {"mode": "async", "async": {"max_staleness": 1}}


@pytest.mark.parametrize("raw, needles", [
    ({"algorithm": {"adv_estimator": "distill"}, "distill": {"teacher": "models/ppo/r1"}},
     ("distill.teacher models/ppo/r1", "ppo.rounds.r1", "models/teacher")),
    ({"distill": {"reward_weight": -1.0}}, ("distill.reward_weight", "-1.0")),
    ({"ppo": {"async": {"partial_rollout": True}}}, ("ppo.async.partial_rollout", "ppo.mode async")),
    ({"ppo": {**ASYNC_ONE_RANK, "async": {"partial_rollout": True, "schedule": "fixed"}}, "resources": {"n_workers": 1}},
     ("ppo.async.partial_rollout", "ppo.async.schedule fixed")),
    ({"ppo": {**ASYNC_ONE_RANK, "async": {"partial_rollout": True, "max_staleness": 0}}, "resources": {"n_workers": 1}},
     ("ppo.async.partial_rollout", "max_staleness 0")),
    ({"ppo": {**ASYNC_ONE_RANK, "async": {"partial_rollout": True}}, "resources": {"n_workers": 1},
      "rollout": {"engine": "hf"}}, ("ppo.async.partial_rollout", "rollout.engine static", "hf")),
    ({"ppo": {**ASYNC_ONE_RANK, "async": {"partial_rollout": True}}, "resources": {"n_workers": 1},
      "rollout": {"agent": {"loop": "tool", "tools": [{"path": "t.py", "name": "add"}]}}},
     ("ppo.async.partial_rollout", "rollout.agent.loop single_turn")),
    ({"ppo": {**ASYNC_ONE_RANK, "async": {"schedule": "latest"}}, "resources": {"n_workers": 1}},
     ("ppo.async.schedule", "'latest'", "free", "fixed")),
])
def test_distillation_and_async_schedule_settings_that_cannot_work_are_one_line(tmp_path, raw, needles):
    with pytest.raises(ConfigError) as err:
        load_config(write_params(tmp_path / "p.yaml", raw))
    assert_one_line(str(err.value), *needles)


def test_a_teacher_outside_the_rounds_and_partial_rollouts_in_an_async_round_are_accepted(tmp_path):
    cfg = load_config(write_params(tmp_path / "p.yaml", {
        "algorithm": {"adv_estimator": "distill"}, "distill": {"teacher": "models/teacher", "reward_weight": 0.5},
        "ppo": {"mode": "async", "async": {"max_staleness": 2, "partial_rollout": True}},
        "resources": {"n_workers": 1}}))
    assert (cfg.distill.teacher, cfg.ppo.async_.partial_rollout, cfg.ppo.async_.schedule) == \
        ("models/teacher", True, "free")


@pytest.mark.parametrize("raw, needles", [
    ({"actor": {"loss": {"name": "bypass_mode"}, "recompute_log_prob": True}},
     ("actor.loss.name bypass_mode", "actor.recompute_log_prob: false")),
    ({"actor": {"loss": {"name": "bypass_mode"}, "recompute_log_prob": False, "off_policy": {"correction": "tis"}}},
     ("actor.loss.name bypass_mode", "actor.off_policy.correction: none")),
    ({"actor": {"loss": {"bypass_rs": "seq_max_k1"}}}, ("actor.loss.bypass_rs", "'seq_max_k1'", "seq_mean_k1")),
    ({"actor": {"loss": {"bypass_is_threshold": 1.5, "bypass_is_threshold_low": 2.0}}},
     ("actor.loss.bypass_is_threshold_low 2.0", "actor.loss.bypass_is_threshold 1.5")),
    ({"actor": {"loss": {"bypass_rs": "token_k2", "bypass_rs_threshold_low": 0.5}}},
     ("actor.loss.bypass_rs_threshold_low", "token_k2", "*_k1")),
    ({"actor": {"loss": {"dro_beta": 0.0}}}, ("actor.loss.dro_beta", "0.0", "greater than 0")),
    ({"actor": {"loss": {"name": "dppo"}}}, ("actor.loss.name", "'dppo'", "dppo_kl", "dppo_tv")),
    ({"actor": {"loss": {"loss_agg_mode": "dapo"}}}, ("actor.loss.loss_agg_mode", "'dapo'", "bnpo")),
])
def test_new_loss_settings_that_cannot_work_are_one_line(tmp_path, raw, needles):
    with pytest.raises(ConfigError) as err:
        load_config(write_params(tmp_path / "p.yaml", raw))
    assert_one_line(str(err.value), *needles)


@pytest.mark.parametrize("actor, line", [
    ({"policy_loss": "gspo"}, "actor.policy_loss is now actor.loss.name"),
    ({"clip_ratio_high": 0.28}, "actor.clip_ratio_high is now actor.loss.clip_ratio_high"),
    ({"lr": 0.1, "dro_beta": 0.3}, "actor.dro_beta is now actor.loss.dro_beta"),
    ({"bypass": {"rollout_is": "token"}}, "actor.bypass.rollout_is is now actor.loss.bypass_is"),
])
def test_a_policy_loss_key_of_an_older_params_file_names_its_new_place(tmp_path, actor, line):
    """The policy loss's options moved from ``actor`` into ``actor.loss``: a params file written before says, in
    one line, where its key went."""
    with pytest.raises(ConfigError) as err:
        load_config(write_params(tmp_path / "p.yaml", {"actor": actor}))
    assert str(err.value) == f"{tmp_path / 'p.yaml'}: {line}"


def test_bypass_mode_in_an_async_round_needs_no_recompute(tmp_path):
    """An asynchronous round with max_staleness > 0 recomputes the proximal policy, except for bypass_mode, whose
    old policy is the (stale) rollout policy: accepted as it is."""
    raw = {"ppo": {"mode": "async", "async": {"max_staleness": 2}}, "resources": {"n_workers": 1},
           "actor": {"loss": {"name": "bypass_mode", "bypass_loss_type": "reinforce", "bypass_rs": "seq_mean_k1",
                              "bypass_rs_threshold_low": 0.5}}}
    cfg = load_config(write_params(tmp_path / "p.yaml", raw))
    assert cfg.actor.loss.bypass_rs == "seq_mean_k1" and cfg.actor.loss.bypass_rs_threshold_low == 0.5


def test_config_show_lists_every_new_estimator_loss_and_knob(capsys):
    """`rlcore config show` names the registries' choices in the selecting keys' docs and shows every new knob."""
    from rlcore.commands import main

    assert main(["config", "show", "--params", str(REPO_ROOT / "params.yaml")]) == 0
    out = capsys.readouterr().out
    for name in ("gdpo", "optimal_token_baseline", "tir_optimal_token_baseline", "dppo_tv", "dppo_kl", "sapo", "dro",
                 "luspo", "vespo", "bypass_mode", "bnpo"):
        assert name in out, name
    for key in ("algorithm.gdpo_batch_norm", "algorithm.handle_zero_tail", "actor.loss.sapo_tau_pos",
                "actor.loss.dro_beta", "actor.loss.vespo_lambda_neg", "actor.loss.bypass_loss_type",
                "actor.loss.bypass_rs", "actor.loss.bypass_rs_threshold_low"):
        assert f"  {key}  " in out, key


def test_every_section_that_trains_a_model_is_one_optimizer_type_with_its_own_defaults():
    """sft, rm, actor and critic share OptimizerSettings's keys and limits; each keeps its defaults (the values params.yaml
    had before they shared a type) and its own reason where one was given; the optimizer a worker gets is the
    section's."""
    from rlcore.config import OptimizerSettings
    from rlcore.workers.optim import OptimSpec

    cfg = Config()
    sections = {"sft": (2e-3, 0.1), "rm": (2e-3, 0.0), "actor": (1e-4, 0.0), "critic": (3e-3, 0.0)}
    for name, (lr, weight_decay) in sections.items():
        section = getattr(cfg, name)
        assert isinstance(section, OptimizerSettings), name
        assert (section.lr, section.weight_decay, section.grad_clip, section.max_nonfinite_steps) == (
            lr, weight_decay, 1.0, 3), name
        for key, bad in (("lr", 0.0), ("weight_decay", -0.1), ("grad_clip", 0.0), ("max_nonfinite_steps", -1)):
            with pytest.raises(ConfigError, match=rf"{name}\.{key} = "):
                parse_config({name: {key: bad}})
        spec = OptimSpec.of(section, warmup_steps=5, offload=False)
        assert (spec.lr, spec.weight_decay, spec.warmup_steps) == (lr, weight_decay, 5), name
    assert OptimizerSettings.model_fields["lr"].default == 1e-4  # a section's defaults did not leak into the shared type
    assert "1e-3 collapses" in type(cfg.actor).model_fields["lr"].description
    assert "0.1 makes the tiny model's SFT converge" in type(cfg.sft).model_fields["weight_decay"].description
    with pytest.raises(TypeError, match="defaults for keys OptimizerSettings does not have: \\['warmup'\\]"):
        type("Bad", (OptimizerSettings,), {"__module__": __name__}, defaults={"warmup": 3})


@pytest.mark.parametrize("raw, needle", [
    ({"rollout": {"engine": "vllm"}},
     "rollout.engine vllm: model.tiny (hidden_size 64 / num_heads 4) has head_dim 16, which vLLM's CPU attention"),
    ({"rollout": {"engine": "vllm", "agent": {"loop": "tool", "tools": [{"path": "t.py", "name": "add"}]}},
      "model": {"tiny": {"hidden_size": 128, "num_heads": 2}}},
     "rollout.engine vllm does not run rollout.agent.loop tool"),
    ({"rollout": {"engine": "vllm"}, "model": {"dtype": "float16", "tiny": {"hidden_size": 128, "num_heads": 2}}},
     "rollout.engine vllm runs float32 or bfloat16 on a CPU: model.dtype float16"),
])
def test_what_the_vllm_engine_cannot_run_is_refused_in_one_line_naming_the_keys(raw, needle):
    with pytest.raises(ConfigError) as err:
        parse_config(raw)
    assert needle in str(err.value) and "\n" not in str(err.value)


def test_the_vllm_engine_reads_a_model_folders_head_dim_and_takes_the_ones_it_runs(tmp_path):
    import json

    for name, config, ok in (("h64", {"hidden_size": 256, "num_attention_heads": 4}, True),
                             ("h16", {"hidden_size": 64, "num_attention_heads": 4}, False),
                             ("explicit", {"hidden_size": 64, "num_attention_heads": 4, "head_dim": 32}, True)):
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text(json.dumps(config))
        raw = {"rollout": {"engine": "vllm"}, "model": {"path": str(tmp_path / name)}}
        if ok:
            assert parse_config(raw).rollout.engine == "vllm"
        else:
            with pytest.raises(ConfigError, match=f"model.path {tmp_path / name} has head_dim 16"):
                parse_config(raw)
    # a folder an earlier stage has not written yet: nothing to read, nothing refused here
    assert parse_config({"rollout": {"engine": "vllm"}, "model": {"path": str(tmp_path / "later")}})
    # on a GPU vLLM's attention backends take other head dims: the CPU list does not apply
    assert parse_config({"rollout": {"engine": "vllm"}, "resources": {"use_gpu": True}})


@pytest.mark.skipif(__import__("importlib").util.find_spec("vllm") is not None, reason="vLLM is installed here")
def test_a_stage_asked_for_vllm_without_it_stops_at_once_saying_how_to_install_it(tmp_path):
    from rlcore.stage.frame import stage_config

    params = tmp_path / "params.yaml"
    params.write_text(yaml.safe_dump({"rollout": {"engine": "vllm"}, "model": {"tiny": {"hidden_size": 128,
                                                                                       "num_heads": 2}}}))
    with pytest.raises(ConfigError, match="rollout.engine vllm: vLLM is not installed .*`make setup-vllm`"):
        stage_config(str(params), ("rollout",), "ppo")
    stage_config(str(params), ("task",), "prepare")  # a stage that does not generate does not need it
