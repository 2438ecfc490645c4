"""A step watchdog: a rank that makes no training progress for ``step_timeout`` dumps every thread's stack and exits.

A rank that stays alive but stops (a stuck data loader, a dead NFS mount, a deadlock) leaves the others waiting in
their next collective. On gloo they give up at the process-group timeout; on NCCL only NCCL's own watchdog ends them
(at the same timeout); and under Lightning's launcher a stuck child of rank 0 outlives everyone, since nothing
signals it. Exiting the stuck rank hands the job to the launcher: torchrun stops the other workers when one exits
non-zero, Lightning's launcher SIGKILLs the group when a child does, and on gloo the peers see the closed sockets.

Progress is any training or validation batch starting or ending, or a checkpoint being saved; the clock starts at
``on_train_start`` (after setup and checkpoint loading) and stops when training ends.
"""

from __future__ import annotations

import faulthandler
import os
import sys
import threading
import time
from datetime import timedelta
from typing import Any

import lightning as L


def resolve_step_timeout(step_timeout: timedelta | float | None) -> float | None:
    """``step_timeout`` in seconds (``None``: no watchdog), checked without processes."""
    if step_timeout is None:
        return None
    seconds = step_timeout.total_seconds() if isinstance(step_timeout, timedelta) else step_timeout
    if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or not seconds > 0:
        raise ValueError(
            f"`step_timeout` must be a positive number of seconds or a `timedelta`, or `None` for no watchdog; got "
            f"{step_timeout!r}. It must exceed the longest step, validation batch and checkpoint save."
        )
    return float(seconds)


class StepWatchdog(L.Callback):
    """Ends this process (``os._exit(1)``, after dumping every thread's stack to stderr) when no training progress
    was made for ``timeout`` seconds. Added by ``TensorParallelStrategy`` (its ``step_timeout``)."""

    def __init__(self, timeout: timedelta | float) -> None:
        seconds = resolve_step_timeout(timeout)
        assert seconds is not None
        self.timeout = seconds
        self._beat = time.monotonic()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._rank = 0

    def _watch(self) -> None:
        while not self._stop.wait(min(self.timeout / 4, 5.0)):
            idle = time.monotonic() - self._beat
            if idle > self.timeout:
                sys.stderr.write(
                    f"\n[rank {self._rank}] lightning_tp: no training progress for {idle:.0f} s (step_timeout "
                    f"{self.timeout:.0f} s). Stacks of every thread follow; exiting, so that the launcher ends the job"
                    ".\n"
                )
                sys.stderr.flush()
                faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
                os._exit(1)

    def beat(self, *args: Any, **kwargs: Any) -> None:
        self._beat = time.monotonic()

    on_train_batch_start = on_train_batch_end = beat
    on_validation_batch_start = on_validation_batch_end = beat
    on_save_checkpoint = beat

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._rank = trainer.global_rank
        self._stop_thread()
        self._stop = threading.Event()
        self.beat()
        self._thread = threading.Thread(target=self._watch, name="lightning_tp-step-watchdog", daemon=True)
        self._thread.start()

    def _stop_thread(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._stop_thread()

    def on_exception(self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException) -> None:
        self._stop_thread()

    def teardown(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        self._stop_thread()
