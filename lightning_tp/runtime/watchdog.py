"""A step watchdog: a rank that makes no training progress for ``step_timeout`` dumps every thread's stack and exits.

A rank that stays alive but stops (a stuck data loader, a dead NFS mount, a deadlock) leaves the others waiting in
their next collective. On gloo they give up at the process-group timeout; on NCCL only NCCL's own watchdog ends them
(at the same timeout); and under Lightning's launcher a stuck child of rank 0 outlives everyone, since nothing
signals it. Exiting the stuck rank hands the job to the launcher: torchrun stops the other workers when one exits
non-zero, Lightning's launcher SIGKILLs the group when a child does, and on gloo the peers see the closed sockets.

Progress is any training or validation batch starting or ending, a checkpoint being saved, or torch.compile starting
or ending a compilation; the clock starts at ``on_train_start`` (after setup and checkpoint loading) and stops when
training ends.

The default (``adaptive``) learns how long a training step takes: once the first steps (allocation, compilation) are
behind, a step may take :data:`AUTO_STEP_FACTOR` times the slowest one seen, and at least :data:`AUTO_FLOOR_S`
seconds, so that a stuck rank ends the job within about a minute. Whatever is not a training step (the first steps,
validation, a checkpoint being written, an epoch boundary) gets the generous fixed limit instead, and so does
first-time work later in training, on this rank or on any other:

- a compilation (torch.compile recompiling for a new shape takes minutes for a large model): from its start to the
  end of its step;
- a step on a batch shape this rank has not trained on before: the step that may recompile, and whose collectives
  have new sizes (NCCL connects the algorithm a new size picks lazily, at its first use, which can take long across
  nodes); a pipeline builds its stages for the new shape.

A rank doing first-time work adds one to a counter in the job's store (the process group's) until it is done; a peer
about to end the job for a step past the learned limit reads it first and waits, up to the fixed limit, while it is
above zero: with dynamic padding the data-parallel ranks meet new lengths at different steps, and a rank that waits
in a collective for a peer compiling makes no progress of its own. A step that outlives the learned limit so is not
timed. The store is read only then, and written only at first-time work (a bounded number of times: one per distinct
shape and compilation).

A real hang in a step on a shape seen before, with no first-time work running anywhere, still ends the job at the
learned limit; in first-time work, at the fixed limit.
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

from lightning_tp.checkpoint.publish import MAIN_WRITE_TIMEOUT
from lightning_tp.compat import add_compile_callbacks, distributed_is_initialized, get_default_store


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


#: ``step_timeout="auto"``: a training step may take this many times the slowest one seen so far ...
AUTO_STEP_FACTOR = 10
#: ... and at least this many seconds (a stuck rank then ends the job within about a minute) ...
AUTO_FLOOR_S = 45.0
#: ... once this many steps are behind (the first ones allocate, compile and warm caches: not timed).
AUTO_WARMUP_STEPS = 2
#: The store key counting the ranks doing first-time work now (see the module docstring).
FIRST_TIME_KEY = "lightning_tp/step_watchdog/first_time"


def batch_shapes(batch: Any, *, depth: int = 4) -> tuple:
    """The shapes of the tensors in ``batch`` (a tensor, or mappings and sequences of them), in order: what a new
    batch shape changes."""
    if hasattr(batch, "shape") and hasattr(batch, "dtype"):
        return (tuple(batch.shape),)
    if depth == 0:
        return ()
    if isinstance(batch, dict):
        return tuple((key, batch_shapes(value, depth=depth - 1)) for key, value in batch.items())
    if isinstance(batch, (list, tuple)):
        return tuple(batch_shapes(value, depth=depth - 1) for value in batch)
    return ()


class StepWatchdog(L.Callback):
    """Ends this process (``os._exit(1)``, after dumping every thread's stack to stderr) when no training progress
    was made for ``timeout`` seconds. Added by ``TensorParallelStrategy`` (its ``step_timeout``).

    ``adaptive``: ``timeout`` is the limit outside training steps only; from the step after
    :data:`AUTO_WARMUP_STEPS` on, a step (from one batch's start to the next one's, nothing else in between) may take
    :data:`AUTO_STEP_FACTOR` times the slowest step so far, at least :data:`AUTO_FLOOR_S` seconds, unless this rank or
    another is doing first-time work (a compilation, a new batch shape: see the module docstring).

    ``store``: where the ranks count their first-time work (default: the process group's store when one is
    initialised with more than one rank; ``None`` there: this rank's own only)."""

    def __init__(self, timeout: timedelta | float, *, adaptive: bool = False, store: Any | None = None) -> None:
        seconds = resolve_step_timeout(timeout)
        assert seconds is not None
        self.timeout = seconds
        self.adaptive = adaptive
        self._store = store
        self._shapes: set[tuple] = set()  # the batch shapes this rank has trained on
        self._first_time = False  # this rank is doing first-time work (counted in the store when there is one)
        self._compiling = False
        self._remove_compile_callbacks: Any = None
        self._limit = seconds  # the limit in force now
        self._beat = time.monotonic()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._rank = 0
        self._step_start: float | None = None  # the current step's start, while nothing but steps has run since
        self._steps_seen = 0
        self._slowest = 0.0

    def _watch(self) -> None:
        while not self._stop.wait(min(self._limit / 4, 5.0)):
            idle, limit = time.monotonic() - self._beat, self._limit
            if limit < idle <= self.timeout and self._others_first_time():
                # A peer compiles or meets a new shape, and this rank may be waiting for it: the fixed limit, and no
                # more (a peer killed while counted leaves its count in the store for good).
                continue
            if idle > limit:
                why = f"step_timeout {limit:.0f} s"
                if self.adaptive and limit < self.timeout:
                    why = (
                        f"step_timeout 'auto': {AUTO_STEP_FACTOR} x the slowest step so far ({self._slowest:.1f} s), "
                        f"at least {AUTO_FLOOR_S:.0f} s; set `step_timeout` to a number of seconds for a fixed limit"
                    )
                sys.stderr.write(
                    f"\n[rank {self._rank}] lightning_tp: no training progress for {idle:.0f} s ({why}). Stacks of "
                    "every thread follow; exiting, so that the launcher ends the job.\n"
                )
                sys.stderr.flush()
                faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
                os._exit(1)

    def beat(self, *args: Any, **kwargs: Any) -> None:
        self._beat = time.monotonic()

    # ----------------------------------------------------------------------------------------- first-time work

    def _others_first_time(self) -> bool:
        """Whether some rank is doing first-time work now, as the store counts it (the watchdog's thread, only when
        a step has run past the learned limit). A store that does not answer says nothing."""
        if self._store is None:
            return False
        try:
            return int(self._store.add(FIRST_TIME_KEY, 0)) > 0
        except Exception:  # the store's host is gone: the job is ending anyway
            return False

    def _begin_first_time(self) -> None:
        """This step is first-time work: the fixed limit, the step not timed, and the peers told."""
        self._limit = self.timeout
        self._step_start = None
        if not self._first_time:
            self._first_time = True
            self._count_first_time(1)

    def _end_first_time(self) -> None:
        if self._first_time:
            self._first_time = False
            self._count_first_time(-1)

    def _count_first_time(self, delta: int) -> None:
        if self._store is not None:
            try:
                self._store.add(FIRST_TIME_KEY, delta)
            except Exception:  # the peers then apply their learned limit: a fault elsewhere ends the job anyway
                pass

    def _compile_started(self) -> None:
        """torch.compile began compiling (on this thread): progress, and first-time work until its step ends."""
        self.beat()
        self._compiling = True
        self._begin_first_time()

    def _compile_ended(self) -> None:
        self.beat()
        self._compiling = False

    # ----------------------------------------------------------------------------------------- Lightning's hooks

    def on_train_batch_start(
        self, trainer: Any = None, pl_module: Any = None, batch: Any = None, batch_idx: int = 0, *args: Any
    ) -> None:
        self.beat()
        previous_limit, self._limit = self._limit, self.timeout  # a save before this step may have lengthened it
        if not self._compiling:
            self._end_first_time()  # the previous step's first-time work is done
        if not self.adaptive:
            return
        # The previous step, if it ran alone, is timed; not one that outlived its limit (it lived because a peer was
        # doing first-time work, which it waited for: not its own time).
        if self._step_start is not None and self._beat - self._step_start <= previous_limit:
            self._steps_seen += 1
            if self._steps_seen > AUTO_WARMUP_STEPS:
                self._slowest = max(self._slowest, self._beat - self._step_start)
        self._step_start = self._beat
        shapes = batch_shapes(batch)
        if shapes not in self._shapes:
            self._shapes.add(shapes)
            if self._slowest > 0:  # before that, every step has the fixed limit anyway
                self._begin_first_time()
                return
        if self._slowest > 0:
            self._limit = min(self.timeout, max(AUTO_FLOOR_S, AUTO_STEP_FACTOR * self._slowest))

    on_train_batch_end = beat

    def _not_a_step(self, *args: Any, **kwargs: Any) -> None:
        """Validation, a save, an epoch boundary: the generous limit, and the next step is not timed."""
        self.beat()
        self._limit = self.timeout
        self._step_start = None

    on_validation_start = on_validation_batch_start = on_validation_batch_end = on_train_epoch_end = _not_a_step

    def on_save_checkpoint(self, *args: Any, **kwargs: Any) -> None:
        """A save may wait as long as rank 0's write may take (``run_on_main_and_share_failure`` tolerates long
        writes): no limit shorter than that until the next step."""
        self._not_a_step()
        self._limit = max(self.timeout, MAIN_WRITE_TIMEOUT.total_seconds())

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._rank = trainer.global_rank
        self._stop_thread()
        self._stop = threading.Event()
        if self._store is None and trainer.world_size > 1 and distributed_is_initialized():
            self._store = get_default_store()
        self._remove_compile_callbacks = add_compile_callbacks(self._compile_started, self._compile_ended)
        self.beat()
        self._thread = threading.Thread(target=self._watch, name="lightning_tp-step-watchdog", daemon=True)
        self._thread.start()

    def _stop_thread(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._remove_compile_callbacks is not None:
            self._remove_compile_callbacks()
            self._remove_compile_callbacks = None
        self._compiling = False
        self._end_first_time()

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._stop_thread()

    def on_exception(self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException) -> None:
        self._stop_thread()

    def teardown(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        self._stop_thread()
