"""bench.ab's other checkout (bench.children.other_checkout) (``--b-root``): refused in one line unless it is an rlcore checkout; given this one's
prepared data."""

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
