"""The README's main job, launched the way a user launches it: Lightning starts the second process itself."""

from __future__ import annotations

import os
import re
import subprocess
import sys

from tests.helpers.launch import ROOT


def test_train_tp_example_loss_falls() -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, "examples/train_tp.py", "--steps", "20"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    losses = [float(v) for v in re.findall(r"^step +\d+ +loss ([\d.]+)$", proc.stdout, flags=re.M)]
    assert len(losses) == 20, proc.stdout
    assert sum(losses[-3:]) / 3 < 0.7 * losses[0], losses
