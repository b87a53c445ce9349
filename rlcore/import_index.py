"""transformers' lazy-import index, built once per installation instead of twice per process.

transformers (5.x) decides which of its thousands of names lives in which module by reading every file under
``transformers/models`` (``create_import_structure_from_path``: each file's ``__all__`` and backend decorators).
It does so twice in every process that loads a model or a tokenizer: ``import transformers`` scans the folder, and
``transformers.models`` scans it again under another cache key (the folder's ``__init__.py`` instead of the
folder). On the 2-core test machine that is ~0.28 CPU-s a scan, ~0.55 s of each stage's, rank's and ``rlcore``
command's start-up; a run of the test suite starts about 130 such processes.

:func:`install` (run first by the processes rlcore starts: ``rlcore.heap.script`` for stages and the ``rlcore``
command, ``rlcore.heap.rank_loading`` for ranks and generators; and by the test session) wraps that function when
transformers loads it: the folder's index is read from a file under rlcore's cache folder
(``$RLCORE_CACHE``, default ``~/.cache/rlcore``) when the folder is unchanged since the file was written (the
path, modification time and size of every file under it, ~15 ms to check), and written there after a scan
otherwise. Whatever goes wrong with the file (missing, unreadable, written by another version, a folder that
cannot be written) falls back to transformers' own scan: the index is always the one transformers would build.
The file holds only dicts, sets, frozensets and strings, and is read with an unpickler that loads nothing else.
A process that imported transformers before rlcore keeps transformers' own behaviour.
"""

from __future__ import annotations

import hashlib
import importlib.abc
import io
import os
import pickle
import sys
import threading
from pathlib import Path

from rlcore import cache

MODULE = "transformers.utils.import_utils"
FUNCTION = "create_import_structure_from_path"
FORMAT = 1
"""Bumped when what the file holds changes."""

_lock = threading.RLock()
_depth = 0  # > 0 while transformers' own scan recurses into sub-folders (those calls go straight through)


def cache_dir() -> Path:
    return cache.root() / "transformers-index"


def fingerprint(folder: str) -> str:
    """Every file's path, modification time and size under ``folder`` (``__pycache__`` left out), hashed."""
    h = hashlib.sha256()
    for root, dirs, files in os.walk(folder):
        dirs[:] = sorted(d for d in dirs if d != "__pycache__")
        for name in sorted(files):
            st = os.stat(os.path.join(root, name))
            h.update(f"{os.path.relpath(os.path.join(root, name), folder)}\0{st.st_mtime_ns}\0{st.st_size}\n".encode())
    return h.hexdigest()


class _BuiltinsOnly(pickle.Unpickler):
    """An index is dicts, sets, frozensets and strings, which pickle without globals: anything else is refused."""

    def find_class(self, module, name):
        raise pickle.UnpicklingError(f"{module}.{name} is not part of an import index")


def _load(blob: bytes):
    return _BuiltinsOnly(io.BytesIO(blob)).load()


def _read(path: Path, stamp: str) -> tuple[bytes, object] | None:
    """The file's pickled index and the index, if the file holds one for ``stamp``."""
    try:
        blob = path.read_bytes()
    except OSError:
        return None
    head, sep, body = blob.partition(b"\n")
    if not sep or head.decode(errors="replace") != stamp:
        return None
    try:
        return body, _load(body)
    except Exception:  # noqa: BLE001 (a torn or foreign file is a miss, not an error: the scan runs instead)
        return None


def _write(path: Path, stamp: str, blob: bytes) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
        tmp.write_bytes(stamp.encode() + b"\n" + blob)
        os.replace(tmp, path)  # readers see the old file or the new one, never half of one
    except OSError:
        pass  # a read-only cache folder: the next process scans again


def cached(original):
    """``original`` (transformers' scan) with the index of a whole folder read from, or written to, the cache."""
    memory: dict[str, bytes] = {}  # folder -> pickled index, for the second call in this process

    def create_import_structure_from_path(module_path):
        global _depth
        with _lock:
            if _depth:  # transformers' own recursion into a sub-folder
                return original(module_path)
            folder = os.path.realpath(os.path.dirname(module_path) if os.path.isfile(module_path) else module_path)
            if folder in memory:
                return _load(memory[folder])  # a fresh copy each call, as two scans would give
            try:
                files = fingerprint(folder)
            except OSError:  # a file gone while the folder was walked (transformers being reinstalled)
                return original(module_path)
            version = getattr(sys.modules.get("transformers"), "__version__", "?")  # set before its first scan
            stamp = f"rlcore import index {FORMAT} transformers {version} {files}"
            path = cache_dir() / f"{hashlib.sha256(folder.encode()).hexdigest()[:16]}.pkl"
            found = _read(path, stamp)
            if found is None:
                _depth += 1
                try:
                    index = original(module_path)
                finally:
                    _depth -= 1
                blob = pickle.dumps(index, protocol=pickle.HIGHEST_PROTOCOL)
                _write(path, stamp, blob)
            else:
                blob, index = found
            memory[folder] = blob  # pickled before the caller can change the index
            return index

    create_import_structure_from_path.__wrapped__ = original
    create_import_structure_from_path.rlcore_cached = True
    return create_import_structure_from_path


def patch(module) -> None:
    original = getattr(module, FUNCTION, None)
    if callable(original) and not getattr(original, "rlcore_cached", False):
        setattr(module, FUNCTION, cached(original))


class _Loader(importlib.abc.Loader):
    """transformers' own loader for the module, which patches the module once it has run."""

    def __init__(self, loader):
        self.loader = loader

    def __getattr__(self, name):  # get_source, get_filename, ...: the wrapped loader's
        return getattr(self.loader, name)

    def create_module(self, spec):
        return self.loader.create_module(spec)

    def exec_module(self, module):
        self.loader.exec_module(module)
        patch(module)


class _Finder(importlib.abc.MetaPathFinder):
    """Patches transformers' import-utils module the moment it is loaded (before transformers' ``__init__`` runs
    its first scan)."""

    def find_spec(self, name, path=None, target=None):
        if name != MODULE:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(name, path, target)
            if spec is not None:
                if spec.loader is not None and hasattr(spec.loader, "exec_module"):
                    spec.loader = _Loader(spec.loader)
                return spec
        return None


def install() -> None:
    """Take effect for the rest of this process (once; a no-op if transformers' module is loaded already, or when
    ``RLCORE_IMPORT_INDEX=0``)."""
    if os.environ.get("RLCORE_IMPORT_INDEX", "1") == "0":
        return
    if MODULE in sys.modules:
        patch(sys.modules[MODULE])
        return
    if not any(isinstance(f, _Finder) for f in sys.meta_path):
        sys.meta_path.insert(0, _Finder())
