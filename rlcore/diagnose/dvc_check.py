"""The ``dvc`` check: a DVC repository in a git repository with a commit, and ``dvc status`` of its pipeline
(in a child process killed at the deadline)."""

from __future__ import annotations

import json
import subprocess
import sys

from rlcore.diagnose.base import Check, Context, find_dvc_root, register, run_bounded


@register("dvc", background=True)
def check_dvc(ctx: Context) -> Check:
    root = find_dvc_root(ctx.root)
    if root is None:
        return Check("dvc", "fail", f"not a DVC repository: no .dvc/ in {ctx.root.resolve()} or above",
                     "run rlcore diagnose in the rlcore checkout (where dvc.yaml is), or set one up: "
                     "git init && dvc init")
    try:
        head = subprocess.run(["git", "rev-parse", "--verify", "--quiet", "HEAD"], cwd=root, capture_output=True,
                              text=True, timeout=ctx.timeout_s)
        inside = subprocess.run(["git", "rev-parse", "--is-inside-work-tree"], cwd=root, capture_output=True,
                                text=True, timeout=ctx.timeout_s)
    except FileNotFoundError:
        return Check("dvc", "fail", f"{root}: git is not installed", "install git (DVC pipelines live in a git repo)")
    except subprocess.TimeoutExpired:
        return Check("dvc", "fail", f"{root}: git rev-parse did not answer within {ctx.timeout_s:g}s",
                     "run git status there to see what it waits on")
    if inside.returncode != 0:
        return Check("dvc", "fail", f"{root}: DVC repo but not a git repository",
                     "git init && git add -A && git commit -m 'initial' (dvc repro and dvc exp need git)")
    if head.returncode != 0:
        return Check("dvc", "fail", f"{root}: git repository without a commit",
                     "git add -A && git commit -m 'initial' (dvc exp needs a commit to start from)")
    commit = head.stdout.strip()[:8]
    if not (root / "dvc.yaml").is_file():
        return Check("dvc", "warn", f"{root}: git {commit}, but no dvc.yaml (no pipeline)",
                     "run rlcore diagnose in the rlcore checkout, where dvc.yaml defines the stages")
    rc, out, err = run_bounded([sys.executable, "-m", "dvc", "status", "--json"], ctx.timeout_s, cwd=root)
    if rc is None:
        return Check("dvc", "fail", f"{root}: dvc status did not finish within {ctx.timeout_s:g}s",
                     "run dvc status to see what it waits on (a lock held by a running dvc repro?)")
    if rc != 0:
        last = (err.strip().splitlines() or out.strip().splitlines() or ["no output"])[-1]
        return Check("dvc", "fail", f"{root}: dvc status failed: {last}", "run dvc status to see the full error")
    try:
        changed = json.loads(out or "{}")
    except json.JSONDecodeError:
        return Check("dvc", "fail", f"{root}: dvc status printed no JSON: {out.strip()[:200]}",
                     "run dvc status to see the full error")
    if not changed:
        return Check("dvc", "ok", f"{root}: git {commit}, pipeline up to date")
    return Check("dvc", "warn", f"{root}: git {commit}, {len(changed)} stage(s) out of date: {', '.join(changed)}",
                 "run dvc repro (only the changed stages re-run; dvc status shows why each changed)")
