"""rlcore.import_index: transformers' lazy-import index read from rlcore's cache is the one transformers builds, an
edited folder is scanned again, and a bad cache file is never trusted (or unpickled into anything but builtins)."""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
from pathlib import Path

import pytest
from transformers.utils import import_utils

from rlcore import import_index


def raw_scan():
    """transformers' own scan, without its in-process cache and without rlcore's wrapper."""
    fn = import_utils.create_import_structure_from_path
    while hasattr(fn, "__wrapped__"):
        fn = fn.__wrapped__
    return fn


def models_dir() -> Path:
    return Path(import_utils.__file__).resolve().parents[1] / "models"


def cache_file(cache: Path, folder: Path) -> Path:
    import hashlib

    return cache / "transformers-index" / f"{hashlib.sha256(str(folder.resolve()).encode()).hexdigest()[:16]}.pkl"


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    """An empty cache folder; transformers' module left as transformers wrote it (where this process's ``import
    rlcore`` wrapped its scan, the wrapper is taken off, so that a scan's recursion into sub-folders is its own)."""
    monkeypatch.setenv("RLCORE_CACHE", str(tmp_path / "cache"))
    fn = import_utils.create_import_structure_from_path
    if getattr(fn, "rlcore_cached", False):
        monkeypatch.setattr(import_utils, "create_import_structure_from_path", fn.__wrapped__)
    return tmp_path / "cache"


def test_the_index_read_back_is_the_one_transformers_builds(cache):
    """The models folder's index, written by one wrapper and read back by another (a new process's), equals a scan
    of transformers' own; the second read the file (its memory was empty) and did not rewrite it."""
    folder = models_dir()
    expected = raw_scan()(str(folder))
    assert import_index.cached(raw_scan())(str(folder / "__init__.py")) == expected  # a miss: scanned and written
    written = cache_file(cache, folder)
    stamp = written.stat().st_mtime_ns
    calls = []

    def counting(path):
        calls.append(path)
        return raw_scan()(path)

    assert import_index.cached(counting)(str(folder)) == expected
    assert calls == [] and written.stat().st_mtime_ns == stamp


def test_an_edited_folder_is_scanned_again_and_a_bad_file_is_not_trusted(cache, tmp_path, monkeypatch):
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "configuration_a.py").write_text('__all__ = ["AConfig"]\n')
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "sub" / "configuration_s.py").write_text('__all__ = ["SConfig"]\n')

    def names(structure) -> set[str]:
        out = set()
        for value in structure.values():
            out |= names(value) if isinstance(value, dict) else set(value)
        return out

    first = import_index.cached(raw_scan())(str(pkg))
    assert names(first) == {"AConfig", "SConfig"}
    (pkg / "configuration_a.py").write_text('__all__ = ["AConfig", "BConfig"]\n')
    assert names(import_index.cached(raw_scan())(str(pkg))) == {"AConfig", "BConfig", "SConfig"}

    # a file with the right header but a body that is not an index: torn, or one that would run code
    path = cache_file(cache, pkg)
    header = path.read_bytes().partition(b"\n")[0]
    for body in (b"\x80\x05garbage", pickle.dumps(os.system)):
        path.write_bytes(header + b"\n" + body)
        assert names(import_index.cached(raw_scan())(str(pkg))) == {"AConfig", "BConfig", "SConfig"}
        assert path.read_bytes().partition(b"\n")[2] != body  # replaced by a good one

    # a cache folder that cannot be created (a file where the folder would be): scanned, nothing written
    blocked = tmp_path / "blocked"
    blocked.write_text("")
    monkeypatch.setenv("RLCORE_CACHE", str(blocked))
    assert names(import_index.cached(raw_scan())(str(pkg))) == {"AConfig", "BConfig", "SConfig"}


def test_a_script_process_puts_the_cache_under_transformers_first_scan(tmp_path):
    """In a new process run as rlcore runs its scripts (``heap.script``, as a stage's ``__main__``): transformers'
    first scan already goes through the cache (the models folder's file is written by ``import transformers``)."""
    code = ("from rlcore import heap\n"
            "heap.script(lambda: __import__('transformers'))\n"
            "from transformers.utils import import_utils\n"
            "print(getattr(import_utils.create_import_structure_from_path, 'rlcore_cached', False))\n")
    env = {**os.environ, "RLCORE_CACHE": str(tmp_path / "cache")}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["True"]
    assert cache_file(tmp_path / "cache", models_dir()).is_file()
