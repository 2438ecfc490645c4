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


def test_finetune_lora_example_accuracy_rises_and_saves_the_adapter(tmp_path) -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    out = tmp_path / "adapter"
    proc = subprocess.run(
        [sys.executable, "examples/finetune_lora.py", "--steps", "60", "--out", str(out)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    accuracy = [float(v) for v in re.findall(r"answer-token accuracy ([\d.]+)", proc.stdout)]
    assert len(accuracy) == 4, proc.stdout  # before training, then every 20 steps
    assert accuracy[-1] > accuracy[0] + 0.3, accuracy
    assert (out / "adapter_config.json").exists() and (out / "adapter_model.safetensors").exists()
