"""Preemption under torchrun and under Lightning's own launcher; writes what each rank saw.

Usage: preemption_worker.py OUT PHASE [--devices N] [--runs DIR ...]

Phases:
``preempt``: TP 2 training; every rank sends itself SIGTERM at the start of global step ``SIGNAL_STEP``; the run must
save ``hpc_ckpt_1.ckpt`` in ``OUT`` and leave with exit code 143. Under torchrun (no ``--devices``), or launched
with plain ``python`` and ``--devices 2`` (``Trainer(devices=2)``: Lightning starts the second process).
``resume`` (torchrun, 2 processes): the uninterrupted run; each of ``--runs`` resumed with ``ckpt_path="hpc"``; a
signal on rank 1 only (caught here, so that the process goes on); the cost of the per-step all-reduce.
"""

from __future__ import annotations

import argparse
import os
import signal
import time
import traceback
from datetime import timedelta
from pathlib import Path
from typing import Any

import lightning as L
import torch
import torch.distributed as dist

from lightning_tp import TensorParallelStrategy
from tests.helpers.models import quiet_trainer
from tests.helpers.resume import STEPS, ResumeModule
from tests.helpers.scenarios import Scenarios
from tests.helpers.tripwire import worker_setup

#: Phase name -> function(args) (the parsed command line).
PHASES = Scenarios("tests/distributed/preemption_worker.py")

SIGNAL_STEP = 2  # mid-epoch 0 (4 steps per epoch): the resumed run crosses an epoch boundary


class SignalAt(L.Callback):
    """Sends SIGTERM to this process at the start of ``step`` on the given ranks (mid-step: before its forward)."""

    def __init__(self, step: int, ranks: set[int] | None = None) -> None:
        self.step, self.ranks, self.sent_at = step, ranks, None

    def on_train_batch_start(self, trainer: L.Trainer, *args: Any) -> None:
        if trainer.global_step == self.step and (self.ranks is None or trainer.global_rank in self.ranks):
            self.sent_at = time.time()
            os.kill(os.getpid(), signal.SIGTERM)


def trainer_for(root: Path, *, devices: int, callbacks=()) -> L.Trainer:
    L.seed_everything(0, verbose=False)  # dropout: every run starts from the same random state
    return quiet_trainer(
        accelerator="cpu",
        devices=devices,
        strategy=TensorParallelStrategy(throughput_monitor=False, timeout=timedelta(seconds=90)),
        max_steps=STEPS,
        default_root_dir=root,
        callbacks=list(callbacks),
    )


@PHASES.register("preempt")
def preempt(args: argparse.Namespace) -> None:
    """Leaves through the preemption exit (143), having written what it saw; returning at all is a failure."""
    phase_preempt(args.out, args.devices or int(os.environ["LOCAL_WORLD_SIZE"]))
    raise AssertionError("the run was meant to leave through the preemption exit")


@PHASES.register("resume")
def resume(args: argparse.Namespace) -> None:
    rank = int(os.environ["RANK"])
    try:
        results = phase_resume(args.out, args.runs)
    except Exception:
        results = {"crash": traceback.format_exc()}
    torch.save(results, args.out / f"resume_rank{rank}.pt")


def phase_preempt(out: Path, devices: int) -> None:
    module, signal_at = ResumeModule(dropout=0.1), SignalAt(SIGNAL_STEP)
    trainer = trainer_for(out, devices=devices, callbacks=[signal_at])
    result: dict[str, Any] = {"pid": os.getpid(), "root": str(out)}
    try:
        trainer.fit(module)
        result["exit"] = None
    except SystemExit as exit:  # recorded, then raised again: the process must really leave with its code
        result["exit"] = {"type": type(exit).__name__, "code": exit.code, "step": trainer.global_step}
        raise
    finally:
        result.update(losses=module.losses, sent_at=signal_at.sent_at)
        torch.save(result, out / f"preempt_rank{trainer.global_rank}.pt")


def phase_resume(out: Path, runs: list[Path]) -> dict[str, Any]:
    devices = int(os.environ["LOCAL_WORLD_SIZE"])
    results: dict[str, Any] = {}
    module = ResumeModule(dropout=0.1)
    trainer_for(out / "uninterrupted", devices=devices).fit(module)
    results["reference"] = module.losses
    results["resumed"] = {}
    for run in runs:
        module = ResumeModule(dropout=0.1)
        trainer_for(run, devices=devices).fit(module, ckpt_path="hpc")
        results["resumed"][str(run)] = module.losses
    # The signal on one rank only: the all-reduce spreads it, both ranks save and leave at the same step.
    module, root = ResumeModule(dropout=0.1), out / "one_rank"
    trainer = trainer_for(root, devices=devices, callbacks=[SignalAt(1, ranks={1})])
    try:
        trainer.fit(module)
        results["one_rank"] = None
    except SystemExit as exit:
        results["one_rank"] = {"type": type(exit).__name__, "code": exit.code, "step": trainer.global_step}
    results["one_rank_saved"] = (root / "hpc_ckpt_1.ckpt" / "meta.pt").is_file()
    # The cost of the flag's all-reduce (what runs per optimizer step) beside Lightning's broadcast it replaces.
    flags = torch.zeros(2)
    for name, op in {
        "all_reduce_max": lambda: dist.all_reduce(flags, op=dist.ReduceOp.MAX),
        "lightning_broadcast": lambda: dist.broadcast(torch.tensor([0]), src=0),
    }.items():
        for _ in range(20):
            op()
        dist.barrier()
        start = time.perf_counter()
        for _ in range(500):
            op()
        results[f"{name}_us"] = (time.perf_counter() - start) / 500 * 1e6
    return results


def main() -> None:
    worker_setup()  # stack dumps on a hang; the strategies below set their own short timeouts
    parser = argparse.ArgumentParser()
    parser.add_argument("out", type=Path)
    parser.add_argument("phase", help=f"one of {sorted(PHASES)}")
    parser.add_argument("--devices", type=int)
    parser.add_argument("--runs", type=Path, nargs="*", default=[])
    args = parser.parse_args()
    phase = PHASES.get(args.phase)  # an unknown name: ValueError on every rank, before anything runs
    args.out.mkdir(parents=True, exist_ok=True)
    phase(args)


if __name__ == "__main__":
    main()
