"""task_file@<split>, reward_file@<i>, tool_file@<i>, agent_file@<i>: record one configured input file or folder by its
sha256 (rlcore.inputs).

    python -m stages.track --file data/my_task/train.jsonl --out inputs/task/train.json
    python -m stages.track --file agents/calc/agent.py/.. --out inputs/reward/agent_run.json   # the file's folder

The stage's only dependency is the file, so DVC re-runs it (and then the stages that depend on the manifest's
folder) exactly when the file changes.
"""

from __future__ import annotations

import argparse
import os
import sys

from rlcore.errors import UserError
from rlcore.inputs import write_manifest


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=(__doc__ or "").strip().splitlines()[0])
    p.add_argument("--file", required=True, help="the file (or folder) to record")
    p.add_argument("--out", required=True, help="the manifest JSON to write")
    args = p.parse_args(argv)
    try:
        record = write_manifest(os.path.normpath(args.file), args.out)  # "agents/calc/agent.py/..": its folder
    except UserError as err:
        print(f"track: error: {err}", file=sys.stderr)
        raise SystemExit(2) from None
    print(f"{record['path']}: sha256 {record['sha256'][:16]}...")


if __name__ == "__main__":
    main()
