"""The ``mlflow`` check: the tracking store ``tracking.uri`` names, read-only (an sqlite file's schema and
experiment, an http(s) server's answer, a file store's folder)."""

from __future__ import annotations

import json
import os
import sqlite3
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

from rlcore.diagnose.base import Check, Context, Status, register
from rlcore.tracking import resolve_uri


def mlflow_schema_head() -> str | None:
    """The database schema revision the installed MLflow expects (None: cannot tell)."""
    try:
        from mlflow.store.db.utils import _get_latest_schema_revision

        return _get_latest_schema_revision()
    except Exception:  # a private MLflow helper: when it moves, skip the schema comparison
        return None


def _writable_folder(folder: Path) -> tuple[Status, str]:
    """Whether files can be created in ``folder``, or in it once ``mkdir -p`` made it: ok (it exists and
    is writable), warn (missing but creatable), fail (not writable, or a file stands in the way)."""
    if folder.is_dir():
        return ("ok", "") if os.access(folder, os.W_OK | os.X_OK) else ("fail", f"{folder} is not writable")
    ancestor = folder
    while not ancestor.exists() and ancestor != ancestor.parent:
        ancestor = ancestor.parent
    if not ancestor.is_dir():
        return "fail", f"{ancestor} is a file, so the folder {folder} cannot be created"
    if not os.access(ancestor, os.W_OK | os.X_OK):
        return "fail", f"{folder} does not exist and {ancestor} is not writable"
    return "warn", f"the folder {folder} does not exist yet"


def _sqlite_store(uri: str, path: Path, experiment: str) -> Check:
    status, why = _writable_folder(path.parent)
    if status == "fail":
        return Check("mlflow", "fail", f"{uri}: {why}",
                     "point tracking.uri at a writable place (sqlite:///mlflow.db is the repo), or set "
                     "tracking.enabled: false")
    if status == "warn":
        return Check("mlflow", "warn", f"{uri}: {why}", f"mkdir -p {path.parent}")
    if not path.exists():
        return Check("mlflow", "ok", f"{uri}: new store (the first stage creates it)")
    if not os.access(path, os.W_OK):
        return Check("mlflow", "fail", f"{uri}: {path} is read-only",
                     f"chmod u+w {path}, or point tracking.uri elsewhere")
    try:
        con = sqlite3.connect(f"file:{urllib.parse.quote(str(path))}?mode=ro", uri=True, timeout=5)
        try:
            tables = {r[0] for r in con.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
            if not tables:
                return Check("mlflow", "ok", f"{uri}: empty database (the first stage sets it up)")
            if not {"alembic_version", "experiments", "runs"} <= tables:
                return Check("mlflow", "fail", f"{uri}: an sqlite database, but not an MLflow store "
                             f"(tables: {', '.join(sorted(tables)[:6])})",
                             "point tracking.uri at another file (sqlite:///mlflow.db)")
            revision = con.execute("SELECT version_num FROM alembic_version").fetchone()
            row = con.execute("SELECT experiment_id, lifecycle_stage FROM experiments WHERE name = ?",
                              (experiment,)).fetchone()
            runs = (con.execute("SELECT COUNT(*) FROM runs WHERE experiment_id = ?", (row[0],)).fetchone()[0]
                    if row else 0)
        finally:
            con.close()
    except sqlite3.Error as err:
        return Check("mlflow", "fail", f"{uri}: {path} does not open as sqlite ({err})",
                     "move the file away (MLflow starts a new store) or point tracking.uri elsewhere")
    head = mlflow_schema_head()
    revision = revision[0] if revision else None
    if head is not None and revision != head:
        return Check("mlflow", "fail", f"{uri}: schema {revision}, the installed MLflow expects {head}",
                     f"back the file up, then: mlflow db upgrade {uri} (or upgrade mlflow if a newer one made it)")
    if row is not None and row[1] != "active":
        return Check("mlflow", "fail", f"{uri}: experiment {experiment!r} (id {row[0]}) is {row[1]}",
                     f"restore it (mlflow experiments restore --experiment-id {row[0]}) or set another "
                     "tracking.experiment")
    found = f"experiment {experiment!r} has {runs} run(s)" if row else f"experiment {experiment!r} not created yet"
    return Check("mlflow", "ok", f"{uri}: writable, schema current; {found}")


def _http_store(uri: str, experiment: str, timeout_s: float) -> Check:
    query = urllib.parse.urlencode({"experiment_name": experiment})
    request = urllib.request.Request(f"{uri.rstrip('/')}/api/2.0/mlflow/experiments/get-by-name?{query}")
    if os.environ.get("MLFLOW_TRACKING_TOKEN"):
        request.add_header("Authorization", f"Bearer {os.environ['MLFLOW_TRACKING_TOKEN']}")
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as response:
            lifecycle = json.loads(response.read() or b"{}").get("experiment", {}).get("lifecycle_stage", "active")
    except urllib.error.HTTPError as err:
        if err.code == 404:
            return Check("mlflow", "ok", f"{uri}: server answers; experiment {experiment!r} not created yet")
        return Check("mlflow", "fail", f"{uri}: server answered HTTP {err.code} {err.reason}",
                     "check the URI and credentials (MLFLOW_TRACKING_TOKEN, or MLFLOW_TRACKING_USERNAME/PASSWORD)")
    except (urllib.error.URLError, OSError) as err:
        reason = getattr(err, "reason", err)
        return Check("mlflow", "fail", f"{uri}: no answer within {timeout_s:g}s ({reason})",
                     "start the server (mlflow server --backend-store-uri sqlite:///mlflow.db --port 5000), fix "
                     "tracking.uri, or set tracking.enabled: false")
    if lifecycle != "active":
        return Check("mlflow", "fail", f"{uri}: experiment {experiment!r} is {lifecycle}",
                     "restore it in the MLflow UI or set another tracking.experiment")
    return Check("mlflow", "ok", f"{uri}: server answers; experiment {experiment!r} exists (read-only check)")


@register("mlflow")
def check_mlflow(ctx: Context) -> Check:
    tracking = ctx.cfg.tracking
    if not tracking.enabled:
        return Check("mlflow", "ok", "tracking.enabled is false: stages log nothing")
    uri = resolve_uri(tracking.uri, ctx.root)
    scheme = urllib.parse.urlparse(uri).scheme
    if uri.startswith("sqlite:///"):
        path = uri[len("sqlite:///"):]
        if path in ("", ":memory:"):
            return Check("mlflow", "warn", f"{uri}: an in-memory store keeps nothing after a stage",
                         "use a file: tracking.uri: sqlite:///mlflow.db")
        return _sqlite_store(uri, Path(path), tracking.experiment)
    if scheme in ("http", "https"):
        return _http_store(uri, tracking.experiment, ctx.timeout_s)
    if scheme in ("", "file"):
        folder = Path(urllib.parse.urlparse(uri).path if scheme else uri)
        folder = folder if folder.is_absolute() else ctx.root / folder
        status, why = _writable_folder(folder)
        if status == "ok":
            return Check("mlflow", "ok", f"{uri}: file store, writable")
        return Check("mlflow", status, f"{uri}: {why}",
                     f"mkdir -p {folder}" if status == "warn" else "point tracking.uri at a writable place")
    return Check("mlflow", "warn", f"{uri}: a {scheme} store, which rlcore diagnose does not check",
                 "check it with the MLflow client yourself; sqlite and http(s) stores are checked")
