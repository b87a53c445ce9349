"""``python -m rlcore`` is the ``rlcore`` command."""

from rlcore.commands import entry

entry()
