"""The step watchdog in one process: its setting is checked early, and a stuck step ends the process with every
thread's stack. The multi-process rows (a stuck rank under both launchers) are in tests/distributed/test_faults.py."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import threading
import time
from dataclasses import dataclass
from datetime import timedelta
from subprocess import PIPE

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


@dataclass
class Ended:
    returncode: int
    stdout: str
    stderr: str
    seconds: float  # from the start of its process to its end


@pytest.fixture(scope="module")
def ended() -> dict[str, Ended]:
    """Every script of this module run at once, each in a process of its own (the watchdog ends its process): they
    wait far more than they compute, so together they take about as long as the longest. Each is read by a thread of
    its own, so that its time is its own and no pipe fills up while another is read."""
    scripts = {
        "stuck": [STUCK],
        "adaptive_-1": [ADAPTIVE, "-1"],
        "adaptive_9": [ADAPTIVE, "9"],
        "first_time": [FIRST_TIME],
        "leaked": [LEAKED],
    }
    results: dict[str, Ended] = {}
    procs: list[subprocess.Popen] = []

    def run(name: str, script: str, *args: str) -> None:
        start = time.monotonic()
        proc = subprocess.Popen(
            [sys.executable, "-c", textwrap.dedent(script), *args], cwd=ROOT, stdout=PIPE, stderr=PIPE, text=True
        )
        procs.append(proc)
        try:
            stdout, stderr = proc.communicate(timeout=150)
        except subprocess.TimeoutExpired:
            proc.kill()
            stdout, stderr = proc.communicate()
        results[name] = Ended(proc.returncode, stdout, stderr, time.monotonic() - start)

    threads = [threading.Thread(target=run, args=(name, *script)) for name, script in scripts.items()]
    try:
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    finally:
        for proc in procs:  # none left behind if the fixture itself fails
            if proc.poll() is None:
                proc.kill()
    return results


def test_a_stuck_step_ends_the_process_with_every_stack(ended: dict[str, Ended]) -> None:
    proc = ended["stuck"]
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "no training progress for" in proc.stderr and "step_timeout 2 s" in proc.stderr, proc.stderr
    assert "in training_step" in proc.stderr  # the stuck frame, from faulthandler
    assert proc.seconds < 100


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
def test_auto_limit_learns_the_step_time_and_spares_validation(ended: dict[str, Ended], stuck_at: int) -> None:
    """``step_timeout="auto"``: millisecond steps get the floor (scaled to 1 s here) instead of the 600 s limit, while
    validation batches longer than that floor run through."""
    proc = ended[f"adaptive_{stuck_at}"]
    if stuck_at < 0:
        assert proc.returncode == 0, proc.stdout + proc.stderr
        return
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "step_timeout 'auto': 10 x the slowest step so far" in proc.stderr, proc.stderr
    assert "in training_step" in proc.stderr
    assert proc.seconds < 60  # the 600 s limit would have run into the fixture's timeout


FIRST_TIME = """
import sys, time
import lightning as L
import torch
import torch.distributed as dist
import lightning_tp.runtime.watchdog as watchdog
from tests.helpers.models import quiet_trainer

watchdog.AUTO_FLOOR_S = 1.0  # the 45 s floor, scaled down to this test's millisecond steps
SLOW = 2.0  # first-time work longer than the learned limit (the floor), far shorter than the fixed one
# After the warm-up (2 steps) and 2 timed steps, while the watchdog checks every 0.25 s (a quarter of the floor).
PEER, COMPILES, NEW_SHAPE, STUCK = 5, 7, 9, 13
store = dist.HashStore()  # the job's store: where a peer doing first-time work counts itself


def slow_backend(graph, example_inputs):  # a compilation that takes long (inductor on a large model)
    time.sleep(SLOW)
    return graph.forward


double = torch.compile(lambda x: x * 2.0, backend=slow_backend)


class Module(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = torch.nn.Linear(2, 1)
    def training_step(self, batch, batch_idx):
        print("step", batch_idx, flush=True)
        if batch_idx == COMPILES:
            batch = double(batch)  # torch.compile compiling (for a new shape, say)
        if batch_idx == NEW_SHAPE:
            assert batch.shape[0] == 3
            time.sleep(SLOW)  # the first step of a new length: a recompile, NCCL connecting a new algorithm
        if batch_idx == PEER:
            store.add(watchdog.FIRST_TIME_KEY, 1)  # another rank compiles; this one waits for it in a collective
            time.sleep(SLOW)
            store.add(watchdog.FIRST_TIME_KEY, -1)
        if batch_idx == STUCK:
            time.sleep(1e6)  # a real hang, on a seen shape, no first-time work anywhere
        return self.net(batch).sum()
    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)
    def train_dataloader(self):
        sizes = [3 if i == NEW_SHAPE else 2 for i in range(STUCK + 2)]
        return torch.utils.data.DataLoader([torch.randn(size, 2) for size in sizes], batch_size=None)

trainer = quiet_trainer(
    accelerator="cpu", devices=1, max_epochs=1, callbacks=[watchdog.StepWatchdog(600, adaptive=True, store=store)]
)
trainer.fit(Module())
"""


def test_first_time_work_is_progress_and_a_hang_after_it_still_ends_the_job(ended: dict[str, Ended]) -> None:
    """``step_timeout="auto"`` after its warm-up, with the learned limit at its floor (scaled to 1 s): a step that
    compiles (torch.compile's callbacks), the first step of a new batch shape and a step waiting for a peer that does
    either (counted in the job's store) each run 2 s, past that limit, where they ended a healthy job before; none is
    timed (the limit stays the floor). A hang in a later step on a seen shape, with no first-time work anywhere,
    still ends the job at the learned limit."""
    proc = ended["first_time"]
    steps = [line for line in proc.stdout.splitlines() if line.startswith("step ")]
    assert proc.returncode == 1 and steps[-1] == "step 13", proc.stdout + proc.stderr  # not at a first-time step
    assert "step_timeout 'auto': 10 x the slowest step so far (0." in proc.stderr, proc.stderr
    assert "in training_step" in proc.stderr
    assert proc.seconds < 60  # the 600 s limit would have run into the fixture's timeout


LEAKED = """
import time
import lightning as L
import torch
import torch.distributed as dist
import lightning_tp.runtime.watchdog as watchdog
from tests.helpers.models import quiet_trainer

watchdog.AUTO_FLOOR_S = 1.0
store = dist.HashStore()

class Module(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = torch.nn.Linear(2, 1)
    def training_step(self, batch, batch_idx):
        print("step", batch_idx, flush=True)
        if batch_idx == 5:
            store.add(watchdog.FIRST_TIME_KEY, 1)  # a peer counted itself, then died: its count stays for good
        if batch_idx == 7:
            time.sleep(1e6)
        return self.net(batch).sum()
    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)
    def train_dataloader(self):
        return torch.utils.data.DataLoader([torch.randn(2, 2) for _ in range(9)], batch_size=None)

trainer = quiet_trainer(
    accelerator="cpu", devices=1, max_epochs=1, callbacks=[watchdog.StepWatchdog(4, adaptive=True, store=store)]
)
trainer.fit(Module())
"""


def test_a_peers_count_left_in_the_store_waits_the_fixed_limit_and_no_more(ended: dict[str, Ended]) -> None:
    """A peer killed while it counted itself as doing first-time work leaves its count: a hang after it still ends
    the job, at the fixed limit (4 s here) instead of the learned one, not never."""
    proc = ended["leaked"]
    steps = [line for line in proc.stdout.splitlines() if line.startswith("step ")]
    assert proc.returncode == 1 and steps[-1] == "step 7", proc.stdout + proc.stderr
    assert "in training_step" in proc.stderr
    assert proc.seconds < 60
