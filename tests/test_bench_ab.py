"""bench.ab --b-root's other checkout (bench.children.other_checkout): refused in one line unless it is an rlcore
checkout; given this checkout's prepared data."""

from __future__ import annotations

import pytest

from bench.children import other_checkout
from bench.settings import WORK_DIR


def test_b_root_must_be_an_rlcore_checkout_and_shares_the_prepared_data(tmp_path):
    with pytest.raises(SystemExit, match="not an rlcore checkout"):
        other_checkout(tmp_path)
    (tmp_path / "rlcore").mkdir()
    (tmp_path / "bench").mkdir()
    (tmp_path / "bench" / "ours.py").write_text("")
    assert other_checkout(tmp_path) == tmp_path.resolve()
    link = tmp_path / "bench" / WORK_DIR.name
    assert link.is_symlink() and link.resolve() == WORK_DIR.resolve()
    assert other_checkout(tmp_path) == tmp_path.resolve()  # a second run keeps the link
    link.unlink()
    link.symlink_to(tmp_path / "gone")  # a dangling link is replaced
    assert other_checkout(tmp_path) == tmp_path.resolve() and link.resolve() == WORK_DIR.resolve()
    link.unlink()
    link.mkdir()  # a folder of its own would be read instead of ours: refused
    with pytest.raises(SystemExit, match="is a folder of its own"):
        other_checkout(tmp_path)
