"""check_params: params.yaml validated as every stage validates it, and every key dvc.yaml reads found in it, before
any other stage starts.

    python -m stages.check_params --pipeline dvc.yaml --out inputs/params.json

DVC deletes a stage's outputs before it runs the stage's command, the committed metrics files among them
(metrics/prepare.json, ...): a stage that then stopped on a misspelt key would leave them deleted. Every stage that
reads params.yaml depends on this stage's output, so DVC runs this one first and stops here, with nothing deleted.
Its output is the same whatever the params (it says only that they were checked): a change of params re-runs this
stage, then exactly the stages that read the keys that changed. (It reads ``--pipeline`` without declaring it: DVC
refuses dvc.yaml as a dependency.)
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from rlcore.config import Config, load_config, read_yaml
from rlcore.pipeline_keys import check_pipeline_keys
from rlcore.stage.frame import stage_errors

PARAMS = tuple(Config.model_fields)  # the whole file


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=(__doc__ or "").strip().splitlines()[0])
    p.add_argument("--params", default="params.yaml", help="params file (default: params.yaml)")
    p.add_argument("--pipeline", required=True, help="the dvc.yaml whose keys the params file must hold")
    p.add_argument("--out", required=True, help="the JSON to write once the params are valid")
    args = p.parse_args(argv)
    with stage_errors("check_params"):
        load_config(args.params)
        check_pipeline_keys(read_yaml(Path(args.params).read_text()), Path(args.pipeline), args.params)
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps({"params": args.params, "checked": "every stage's validation and "
                                              "the keys dvc.yaml reads"}) + "\n")
    print(f"check_params: {args.params}: valid, every key {args.pipeline} reads is in it")


if __name__ == "__main__":
    main()
