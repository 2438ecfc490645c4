"""One fault on rank 1 of a TP 2 run, under torchrun or (``--devices 2``) under Lightning's own launcher.

Usage: fault_worker.py OUT FAULT [--devices 2]

Faults (on rank 1, at the start of global step ``FAULT_STEP``, after a checkpoint ``last`` was saved at step 1):
``kill`` (SIGKILL, mid-step), ``raise_step`` (an exception in ``training_step``), ``raise_configure`` (an exception
in ``configure_model``, before any collective), ``save_oserror`` (ENOSPC while writing its shards of the next
``last``), ``stuck`` (``time.sleep(1e6)`` in ``training_step``, alive but stopped), ``rank0_save`` (not on
rank 1: the usual Lightning export ``if trainer.is_global_zero: model.save_pretrained(...)`` in ``on_train_end``, a
collective that rank 1 never joins). Each process writes its pid to
``OUT/pids/``, the faulting one the time of the fault to ``OUT/fault_at``, and each rank that gets to it what it
raised to ``OUT/raised_rank{R}.pt``. Each fault is a function registered in :data:`FAULTS`.
"""

from __future__ import annotations

import argparse
import errno
import os
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

import lightning as L
import torch

from lightning_tp import TensorParallelStrategy
from tests.helpers.models import quiet_trainer
from tests.helpers.resume import STEPS, ResumeModule, SaveAt
from tests.helpers.scenarios import Scenarios
from tests.helpers.tripwire import worker_setup

FAULT_STEP = 3
PG_TIMEOUT = timedelta(seconds=60)
STEP_TIMEOUT = 6.0  # a step takes well under a second here: six is no false alarm, and the stuck row waits it out


def _mark_fault(out: Path) -> None:
    (out / "fault_at").write_text(repr(time.time()))


@dataclass
class Fault:
    """What rank 1 does: in ``configure_model``, at the start of step ``FAULT_STEP``, or through callbacks."""

    at_configure: Callable[[], None] | None = None
    at_step: Callable[[], None] | None = None
    callbacks: list[L.Callback] = field(default_factory=list)


#: Fault name -> function(out) -> Fault.
FAULTS = Scenarios("tests/distributed/fault_worker.py")


@FAULTS.register("kill")
def kill(out: Path) -> Fault:
    def die() -> None:
        _mark_fault(out)
        os.kill(os.getpid(), signal.SIGKILL)

    return Fault(at_step=die)


@FAULTS.register("raise_step")
def raise_step(out: Path) -> Fault:
    def fail() -> None:
        _mark_fault(out)
        raise RuntimeError("fault: rank 1 fails in training_step")

    return Fault(at_step=fail)


@FAULTS.register("raise_configure")
def raise_configure(out: Path) -> Fault:
    def fail() -> None:
        _mark_fault(out)
        raise RuntimeError("fault: rank 1 fails in configure_model")

    return Fault(at_configure=fail)


@FAULTS.register("save_oserror")
def save_oserror(out: Path) -> Fault:
    return Fault(callbacks=[FailShardWrite(out)])


@FAULTS.register("stuck")
def stuck(out: Path) -> Fault:
    def hang() -> None:
        _mark_fault(out)
        time.sleep(1e6)

    return Fault(at_step=hang)


@FAULTS.register("rank0_save")
def rank0_save(out: Path) -> Fault:
    return Fault(callbacks=[SaveOnRankZero(out)])


class SaveOnRankZero(L.Callback):
    def __init__(self, out: Path) -> None:
        self.out = out

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.is_global_zero:
            _mark_fault(self.out)
            pl_module.model.save_pretrained(self.out / "export")


class FaultyModule(ResumeModule):
    def __init__(self, fault: Fault) -> None:
        super().__init__(stateful_data=False)
        self.fault = fault

    def configure_model(self) -> None:
        if self.fault.at_configure is not None and self.trainer.global_rank == 1:
            self.fault.at_configure()
        super().configure_model()

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        if self.global_step == FAULT_STEP and self.trainer.global_rank == 1 and self.fault.at_step is not None:
            self.fault.at_step()
        return super().training_step(batch, batch_idx)


class FailShardWrite(L.Callback):
    """Rank 1 cannot write its shards of the second save (a full disk)."""

    def __init__(self, out: Path) -> None:
        self.out, self.saves = out, 0

    def on_save_checkpoint(self, trainer: L.Trainer, *args: Any) -> None:
        self.saves += 1
        if self.saves == 2 and trainer.global_rank == 1:
            from torch.distributed.checkpoint import FileSystemWriter

            def full_disk(*args: Any, **kwargs: Any) -> Any:
                _mark_fault(self.out)
                raise OSError(errno.ENOSPC, "No space left on device (fault)")

            FileSystemWriter.write_data = full_disk


def main() -> None:
    worker_setup()  # stack dumps on a hang; the strategies below set their own short timeouts
    parser = argparse.ArgumentParser()
    parser.add_argument("out", type=Path)
    parser.add_argument("fault", help=f"one of {sorted(FAULTS)}")
    parser.add_argument("--devices", type=int)
    args = parser.parse_args()
    fault = FAULTS.run(args.fault, args.out)  # an unknown name: ValueError on every rank, before anything runs
    (args.out / "pids").mkdir(parents=True, exist_ok=True)
    (args.out / "pids" / str(os.getpid())).touch()
    callbacks: list[L.Callback] = [SaveAt(steps={1: args.out / "last", FAULT_STEP: args.out / "last"})]
    callbacks += fault.callbacks
    trainer = quiet_trainer(
        accelerator="cpu",
        devices=args.devices or int(os.environ["LOCAL_WORLD_SIZE"]),
        strategy=TensorParallelStrategy(throughput_monitor=False, timeout=PG_TIMEOUT, step_timeout=STEP_TIMEOUT),
        max_steps=STEPS,
        default_root_dir=args.out,
        callbacks=callbacks,
    )
    try:
        trainer.fit(FaultyModule(fault))
    except BaseException as err:
        raised = {"type": type(err).__name__, "message": str(err)[:2000], "at": time.time()}
        torch.save(raised, args.out / f"raised_rank{trainer.global_rank}.pt")
        raise
    raise AssertionError(f"rank {trainer.global_rank} finished training despite the fault")


if __name__ == "__main__":
    main()
