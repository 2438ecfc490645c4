"""Python's garbage collector, run at the same step on every rank.

A full collection in a process holding torch, Transformers and Lightning scans every object it has ever kept: about
0.35 s on this project's 2-core machine (seen as a 0.35 s stall in a TP 2 step, the other rank waiting in its next
all-reduce). Python starts one whenever its allocation counts say so, at a different moment on each rank, so every
rank in turn holds up the others. As torchtitan (``gc_freq``) and Megatron (``--manual-gc``) do, while training:

* the objects alive when training starts (modules, imports, the data pipeline) are frozen (``gc.freeze()``): no
  collection scans them again;
* automatic collection is off;
* every ``every_n_steps`` optimizer steps, every rank collects the young generations (``gc.collect(1)``) at the same
  point of the same step.

Training's own garbage is freed by reference counting as usual; only reference cycles wait for the next collection.
The collector's state is restored when training ends or fails.
"""

from __future__ import annotations

import gc
from typing import Any

import lightning as L


class GarbageCollection(L.Callback):
    """Collects garbage every ``every_n_steps`` optimizer steps on every rank, with automatic collection off and the
    objects alive at the start of training frozen (see the module's docstring). Added by ``TensorParallelStrategy``
    (``gc_every_n_steps``, default 50) unless the Trainer has one."""

    def __init__(self, every_n_steps: int = 50) -> None:
        if not isinstance(every_n_steps, int) or isinstance(every_n_steps, bool) or every_n_steps < 1:
            raise ValueError(
                f"`gc_every_n_steps` must be a positive number of optimizer steps (or None for Python's automatic "
                f"collection), got {every_n_steps!r}."
            )
        self.every_n_steps = every_n_steps
        self._was_enabled: bool | None = None

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._was_enabled = gc.isenabled()
        gc.collect()  # what setup left behind, once, before its survivors are frozen
        gc.freeze()
        gc.disable()

    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if (batch_idx + 1) % max(1, trainer.accumulate_grad_batches):  # an optimizer step's last micro-batch only
            return
        if trainer.global_step % self.every_n_steps == 0:
            gc.collect(1)

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._restore()

    def on_exception(self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException) -> None:
        self._restore()

    def _restore(self) -> None:
        if self._was_enabled is None:
            return
        gc.unfreeze()
        if self._was_enabled:
            gc.enable()
        self._was_enabled = None


__all__ = ["GarbageCollection"]
