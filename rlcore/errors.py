"""The exceptions that mean "bad input", not "bug".

A stage turns these, and only these, into one line on stderr and exit code 2
(``rlcore.cli.stage_errors``); every other exception is a bug and keeps its traceback.
Each message names the key, file, row or field and what was expected.
"""

from __future__ import annotations


class UserError(Exception):
    """Bad input a user can fix: params, paths, data rows, model folders."""


class ConfigError(UserError, ValueError):
    """A params.yaml problem (or a command-line value standing in for one), naming the key."""


class DataError(UserError, ValueError):
    """A dataset file or row that does not follow the schema, naming the file, row and field."""


class InputNotFound(UserError, FileNotFoundError):
    """A file or folder a stage reads does not exist."""
