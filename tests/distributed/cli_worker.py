"""Runs under torchrun: each named config of examples/configs trains a few steps through examples/cli.py's LightningCLI,
one after the other in the same processes (a cold start per config would cost more than its training); writes the
global step each reached to OUT_DIR/rank{R}.json.

Usage: cli_worker.py OUT_DIR ROOT_DIR CONFIG [CONFIG ...]
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from tests.helpers.launch import ROOT
from tests.helpers.tripwire import worker_setup

sys.path.insert(0, str(ROOT / "examples"))  # where the example finds `sort_task`, as when run as a script

import cli  # noqa: E402  (examples/cli.py)


def main() -> None:
    worker_setup()  # a hang fails within the short timeout, with every stack
    out, root, *configs = sys.argv[1:]
    steps = {}
    for config in configs:
        run = cli.main(
            [
                "fit",
                "--config",
                str(ROOT / "examples/configs" / config),
                "--trainer.max_steps=3",
                "--trainer.val_check_interval=3",
                "--trainer.enable_progress_bar=false",
                f"--trainer.default_root_dir={Path(root) / config}",  # where LightningCLI saves the config it ran
            ]
        )
        steps[config] = run.trainer.global_step
    rank = run.trainer.global_rank
    Path(out).mkdir(parents=True, exist_ok=True)
    (Path(out) / f"rank{rank}.json").write_text(json.dumps(steps))


if __name__ == "__main__":
    main()
