"""One fault on rank 1 of a TP 2 run, under torchrun or (``--devices 2``) under Lightning's own launcher.

Usage: fault_worker.py OUT FAULT [--devices 2]

Faults (on rank 1, at the start of global step ``FAULT_STEP``, after a checkpoint ``last`` was saved at step 1):
``kill`` (SIGKILL, mid-step), ``raise_step`` (an exception in ``training_step``), ``raise_configure`` (an exception
in ``configure_model``, before any collective), ``save_oserror`` (ENOSPC while writing its shards of the next
``last``), ``stuck`` (``time.sleep(1e6)`` in ``training_step``, alive but stopped). Each process writes its pid to
``OUT/pids/``, the faulting one the time of the fault to ``OUT/fault_at``, and each rank that gets to it what it
raised to ``OUT/raised_rank{R}.pt``.
"""

from __future__ import annotations

import argparse
import errno
import os
import signal
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import lightning as L
import torch

from lightning_tp import TensorParallelStrategy
from tests.helpers.models import quiet_trainer
from tests.helpers.resume import STEPS, ResumeModule, SaveAt
from tests.helpers.tripwire import worker_setup

FAULT_STEP = 3
PG_TIMEOUT = timedelta(seconds=60)
STEP_TIMEOUT = 20.0


def _mark_fault(out: Path) -> None:
    (out / "fault_at").write_text(repr(time.time()))


class FaultyModule(ResumeModule):
    def __init__(self, out: Path, fault: str) -> None:
        super().__init__(stateful_data=False)
        self.out, self.fault = out, fault

    def configure_model(self) -> None:
        if self.fault == "raise_configure" and self.trainer.global_rank == 1:
            _mark_fault(self.out)
            raise RuntimeError("fault: rank 1 fails in configure_model")
        super().configure_model()

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        if self.global_step == FAULT_STEP and self.trainer.global_rank == 1:
            if self.fault == "kill":
                _mark_fault(self.out)
                os.kill(os.getpid(), signal.SIGKILL)
            if self.fault == "raise_step":
                _mark_fault(self.out)
                raise RuntimeError("fault: rank 1 fails in training_step")
            if self.fault == "stuck":
                _mark_fault(self.out)
                time.sleep(1e6)
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
    parser.add_argument("fault", choices=["kill", "raise_step", "raise_configure", "save_oserror", "stuck"])
    parser.add_argument("--devices", type=int)
    args = parser.parse_args()
    (args.out / "pids").mkdir(parents=True, exist_ok=True)
    (args.out / "pids" / str(os.getpid())).touch()
    callbacks: list[L.Callback] = [SaveAt(steps={1: args.out / "last", FAULT_STEP: args.out / "last"})]
    if args.fault == "save_oserror":
        callbacks.append(FailShardWrite(args.out))
    trainer = quiet_trainer(
        accelerator="cpu",
        devices=args.devices or int(os.environ["LOCAL_WORLD_SIZE"]),
        strategy=TensorParallelStrategy(throughput_monitor=False, timeout=PG_TIMEOUT, step_timeout=STEP_TIMEOUT),
        max_steps=STEPS,
        default_root_dir=args.out,
        callbacks=callbacks,
    )
    try:
        trainer.fit(FaultyModule(args.out, args.fault))
    except BaseException as err:
        raised = {"type": type(err).__name__, "message": str(err)[:2000], "at": time.time()}
        torch.save(raised, args.out / f"raised_rank{trainer.global_rank}.pt")
        raise
    raise AssertionError(f"rank {trainer.global_rank} finished training despite the fault")


if __name__ == "__main__":
    main()
