"""The step watchdog in one process: its setting is checked early, and a stuck step ends the process with every
thread's stack. The multi-process rows (a stuck rank under both launchers) are in tests/distributed/test_faults.py."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time
from datetime import timedelta

import pytest

from lightning_tp import TensorParallelStrategy
from lightning_tp.runtime.watchdog import resolve_step_timeout
from tests.helpers.launch import ROOT


def test_step_timeout_is_checked_early_and_defaults_to_twice_the_timeout() -> None:
    assert resolve_step_timeout(timedelta(minutes=2)) == 120.0 and resolve_step_timeout(None) is None
    with pytest.raises(ValueError, match=r"`step_timeout` must be a positive number.*got -1"):
        resolve_step_timeout(-1)
    with pytest.raises(ValueError, match="got '10'"):
        TensorParallelStrategy(step_timeout="10")
    assert TensorParallelStrategy(timeout=timedelta(seconds=90))._step_timeout == 180.0
    assert TensorParallelStrategy(step_timeout=None)._step_timeout is None


STUCK = """
import time
import lightning as L
import torch
from lightning_tp.runtime.watchdog import StepWatchdog
from tests.helpers.models import quiet_trainer

class Stuck(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = torch.nn.Linear(2, 1)
    def training_step(self, batch, batch_idx):
        if batch_idx == 1:
            time.sleep(1e6)  # a stuck data source, a dead mount
        return self.net(batch).sum()
    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)
    def train_dataloader(self):
        return torch.utils.data.DataLoader(torch.randn(8, 2), batch_size=2)

quiet_trainer(accelerator="cpu", devices=1, max_epochs=1, callbacks=[StepWatchdog(2.0)]).fit(Stuck())
"""


def test_a_stuck_step_ends_the_process_with_every_stack() -> None:
    start = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(STUCK)], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "no training progress for" in proc.stderr and "step_timeout 2 s" in proc.stderr, proc.stderr
    assert "in training_step" in proc.stderr  # the stuck frame, from faulthandler
    assert time.monotonic() - start < 100


ADAPTIVE = """
import sys, time
import lightning as L
import torch
import lightning_tp.runtime.watchdog as watchdog
from tests.helpers.models import quiet_trainer

watchdog.AUTO_FLOOR_S = 1.0  # the 45 s floor, scaled down to this test's millisecond steps
STUCK_AT = int(sys.argv[1])

class Module(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = torch.nn.Linear(2, 1)
    def training_step(self, batch, batch_idx):
        if batch_idx == STUCK_AT:
            time.sleep(1e6)
        return self.net(batch).sum()
    def validation_step(self, batch, batch_idx):
        time.sleep(1.5)  # longer than the steps' limit: validation is not a step
    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)
    def train_dataloader(self):
        return torch.utils.data.DataLoader(torch.randn(24, 2), batch_size=2)
    def val_dataloader(self):
        return torch.utils.data.DataLoader(torch.randn(2, 2), batch_size=2)

trainer = quiet_trainer(
    accelerator="cpu", devices=1, max_epochs=2, val_check_interval=6, num_sanity_val_steps=0,
    callbacks=[watchdog.StepWatchdog(600, adaptive=True)],
)
trainer.fit(Module())
"""


@pytest.mark.parametrize("stuck_at", [-1, 9])
def test_auto_limit_learns_the_step_time_and_spares_validation(stuck_at: int) -> None:
    """``step_timeout="auto"``: millisecond steps get the floor (scaled to 1 s here) instead of the 600 s limit, while
    validation batches longer than that floor run through."""
    start = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(ADAPTIVE), str(stuck_at)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    if stuck_at < 0:
        assert proc.returncode == 0, proc.stdout + proc.stderr
        return
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "step_timeout 'auto': 10 x the slowest step so far" in proc.stderr, proc.stderr
    assert "in training_step" in proc.stderr
    assert time.monotonic() - start < 60  # the 600 s limit would have run into the subprocess timeout
