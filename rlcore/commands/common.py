"""Options and helpers the subcommands share: ``--params``, ``--set KEY=VALUE``, loading the config."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import yaml

from rlcore.config import Config, apply_overrides, load_config, parse_config, read_yaml
from rlcore.errors import ConfigError
from rlcore.kernels import pin
from rlcore.stage.frame import check_engine_installed

DEFAULT_PARAMS = "params.yaml"


def add_config_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--params", default=None, metavar="FILE",
                   help="params file (default: params.yaml here; the built-in defaults when there is none)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override one param (dotted key, YAML value), e.g. --set rollout.top_p=0.9; repeatable")


def parse_overrides(items: list[str]) -> dict[str, Any]:
    """``["a.b=1", "c=x"]`` -> ``{"a.b": 1, "c": "x"}``; values are YAML (``true``, ``0.5``, ``[1, 2]``)."""
    out: dict[str, Any] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise ConfigError(f"--set {item!r}: expected KEY=VALUE with a dotted key, e.g. rollout.top_p=0.9")
        try:
            out[key.strip()] = read_yaml(value)
        except yaml.YAMLError:
            raise ConfigError(f"--set {item!r}: the value is not valid YAML") from None
    return out


def params_source(args: argparse.Namespace) -> str | None:
    """The params file a command reads: ``--params``, else ./params.yaml if there is one, else None
    (the built-in defaults)."""
    if args.params is not None:
        return args.params
    return DEFAULT_PARAMS if Path(DEFAULT_PARAMS).is_file() else None


def config_from(args: argparse.Namespace, *, runs: bool = True) -> Config:
    """The validated config: the params file (or the defaults) with ``--set`` overrides applied. The command's
    process computes with the CPU kernels it names (``resources.cpu_kernels``, :mod:`rlcore.kernels`), chosen here,
    before the command imports torch."""
    overrides = parse_overrides(getattr(args, "overrides", []))
    source = params_source(args)
    if source is not None:
        cfg = load_config(source, overrides)
    else:
        print("rlcore: no params.yaml here; using the built-in defaults", file=sys.stderr)
        cfg = parse_config(apply_overrides({}, overrides), "--set")
    if runs:  # a command that generates: refused before its work where the engine it names is not installed
        check_engine_installed(cfg, source or "--set")
    if warning := pin(cfg.resources.cpu_kernels):
        print(warning, file=sys.stderr)
    return cfg


def positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {text}")
    return value
