"""Python's garbage collector, run at the same step on every rank.

A full collection in a process holding torch, Transformers and Lightning scans every object it has ever kept: about
0.35 s on this project's 2-core machine (seen as a 0.35 s stall in a TP 2 step, the other rank waiting in its next
all-reduce). Python starts one whenever its allocation counts say so, at a different moment on each rank, so every
rank in turn holds up the others. As torchtitan (``gc_freq``) and Megatron (``--manual-gc``) do, while training:

* the objects alive when training starts (modules, imports, the data pipeline) are frozen (``gc.freeze()``): no
  collection scans them again;
* automatic collection is off;
* every ``every_n_steps`` optimizer steps, every rank runs a collection at the same point of the same step: a full
  one, which after the freeze scans only what training made since (a generation-1 collection, torchtitan's, would
  move every survivor into the oldest generation, never collected again while training).

Training's own garbage is freed by reference counting as usual; only reference cycles wait for the next collection.
The collector's state is restored when training ends or fails; processes forked meanwhile (data-loader workers of a
later epoch, of a validation) collect automatically as usual. A user's own ``gc.freeze()`` is left as it is.
"""

from __future__ import annotations

import gc
import os
from typing import Any

import lightning as L

from lightning_tp.runtime.monitor import ends_optimizer_step

#: Whether a GarbageCollection callback has automatic collection off in this process (read in forked children).
_ACTIVE = False


def _reenable_in_child() -> None:
    """In a process forked while training (a data-loader worker): its own garbage, Python's automatic collection."""
    global _ACTIVE
    if _ACTIVE:
        _ACTIVE = False
        gc.enable()


os.register_at_fork(after_in_child=_reenable_in_child)


class GarbageCollection(L.Callback):
    """Collects garbage every ``every_n_steps`` optimizer steps on every rank, with automatic collection off and the
    objects alive at the start of training frozen (see the module's docstring). Added by ``TensorParallelStrategy``
    (``gc_every_n_steps``, default 50) unless the Trainer has one (then the strategy's value is not used).

    Args:
        every_n_steps: optimizer steps between two collections (a positive integer).

    Raises:
        ValueError: ``every_n_steps`` is not a positive integer.
    """

    def __init__(self, every_n_steps: int = 50) -> None:
        if not isinstance(every_n_steps, int) or isinstance(every_n_steps, bool) or every_n_steps < 1:
            raise ValueError(
                f"The garbage collection interval (`gc_every_n_steps` of the strategy, `every_n_steps` of "
                f"GarbageCollection) must be a positive number of optimizer steps (or None for Python's automatic "
                f"collection), got {every_n_steps!r}."
            )
        self.every_n_steps = every_n_steps
        self._was_enabled: bool | None = None
        self._froze = False

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        global _ACTIVE
        self._was_enabled = gc.isenabled()
        gc.collect()  # what setup left behind, once, before its survivors are frozen
        self._froze = gc.get_freeze_count() == 0  # a user's own freeze is theirs to undo
        if self._froze:
            gc.freeze()
        gc.disable()
        _ACTIVE = True

    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if ends_optimizer_step(trainer, batch_idx) and trainer.global_step % self.every_n_steps == 0:
            gc.collect()

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._restore()

    def on_exception(self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException) -> None:
        self._restore()

    def _restore(self) -> None:
        global _ACTIVE
        if self._was_enabled is None:
            return
        if self._froze:
            gc.unfreeze()
        if self._was_enabled:
            gc.enable()
        self._was_enabled, self._froze, _ACTIVE = None, False, False


__all__ = ["GarbageCollection"]
