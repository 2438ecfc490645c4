"""Preemption: save where ``ckpt_path="hpc"`` finds it and exit, with every rank agreeing first.

Schedulers send SIGTERM (SLURM may send SIGUSR1 ahead of its time limit, and requeue) and kill the job shortly after.
Lightning 2.6's handlers act inside the signal handler: the SLURM one calls ``trainer.save_checkpoint`` (collectives
started wherever each rank happens to be, which can deadlock or pair with a collective already in flight) and the
SIGTERM one broadcasts from rank 0 there. As Megatron's distributed signal handler does, the handler here only
records the signal; at the next optimizer-step boundary (``on_train_batch_end`` once ``global_step`` moved) the ranks
agree with one small all-reduce (MAX: a signal on one rank is enough), save through ``trainer.save_checkpoint`` (the
crash-safe path: written under a hidden name and renamed into place) to Lightning's ``hpc_ckpt_N`` in
``default_root_dir``, requeue on SLURM when the signal is the requeue signal (as Lightning does), and raise
:class:`~lightning.pytorch.utilities.exceptions.SIGTERMException` with exit code ``128 + signal`` (143 for SIGTERM):
the Trainer tears down, code after ``fit`` does not run as if training had finished, and launchers and wrappers see a
failure they may retry (``ckpt_path="hpc"`` resumes; Lightning picks it by itself on SLURM).

The per-step all-reduce replaces Lightning's own per-step broadcast of its SIGTERM flag (useless once its handler is
replaced), so a step runs no more collectives than without this callback. On NCCL it runs on a gloo side group over
CPU tensors: no device synchronisation per step.
"""

from __future__ import annotations

import logging
import os
import re
import signal
import subprocess
import threading
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import lightning as L
import torch
import torch.distributed as dist
from lightning.pytorch.utilities.exceptions import SIGTERMException
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn

from lightning_tp.checkpoint.publish import partial_path
from lightning_tp.compat import (
    clear_received_sigterm,
    cluster_environment,
    distributed_is_initialized,
    hpc_save_path,
    replace_sigterm_broadcast,
    restore_sigterm_broadcast,
    strategy_timeout,
)
from lightning_tp.options import DEFAULTS

log = logging.getLogger(__name__)

DEFAULT_PREEMPTION_SIGNALS: tuple[str, ...] = DEFAULTS["preemption_signals"]
#: Signals a process cannot catch, or that mean something else to Python.
_REFUSED = {"SIGKILL", "SIGSTOP", "SIGINT", "SIGCHLD"}


def resolve_signals(signals: Iterable[str | int | signal.Signals] | str | None) -> tuple[signal.Signals, ...]:
    """The signals named by ``preemption_signals`` (names like ``"SIGTERM"``, numbers or ``signal.Signals``), checked
    without processes so that every rank raises the same error; ``None`` or empty: preemption handling off."""
    if signals is None:
        return ()
    if isinstance(signals, (str, int)):
        signals = (signals,)
    valid = sorted(s.name for s in signal.valid_signals() if isinstance(s, signal.Signals) and s.name not in _REFUSED)
    resolved: list[signal.Signals] = []
    for item in signals:
        try:
            if isinstance(item, str):
                sig = signal.Signals[item.upper() if item.upper().startswith("SIG") else f"SIG{item.upper()}"]
            else:
                sig = signal.Signals(item)
        except (KeyError, ValueError):
            raise ValueError(
                f"`preemption_signals` holds {item!r}, which is not a signal on this platform. Use names such as "
                f"{', '.join(DEFAULT_PREEMPTION_SIGNALS)} (valid: {', '.join(valid)}), or `None` to turn preemption "
                "handling off."
            ) from None
        if sig.name in _REFUSED:
            raise ValueError(
                f"`preemption_signals` holds {sig.name}, which cannot be handled as a preemption notice (SIGKILL and "
                "SIGSTOP cannot be caught, SIGINT is Ctrl+C, SIGCHLD is a child ending). Use e.g. "
                f"{', '.join(DEFAULT_PREEMPTION_SIGNALS)}, or `None` to turn preemption handling off."
            )
        if sig not in resolved:
            resolved.append(sig)
    return tuple(resolved)


class PreemptionCheckpoint(L.Callback):
    """On one of ``signals``: at the next optimizer-step boundary, every rank saves ``hpc_ckpt_N`` in
    ``default_root_dir`` and the run ends with ``SIGTERMException(128 + signal)``. Added by
    ``TensorParallelStrategy`` unless ``preemption_signals=None``."""

    def __init__(self, signals: Iterable[str | int | signal.Signals] | str = DEFAULT_PREEMPTION_SIGNALS) -> None:
        self.signals = resolve_signals(signals)
        if not self.signals:
            raise ValueError("`PreemptionCheckpoint` needs at least one signal; leave the callback out to turn it off.")
        self._active: tuple[signal.Signals, ...] = ()
        self._received: list[int] = []  # written only by the signal handler: appends are atomic under the GIL
        self._previous: dict[signal.Signals, Any] = {}
        self._last_step = -1
        self._group: Any = None  # the process group of the flag's all-reduce (None: the default group)
        self._group_of: Any = None  # the default group it was made under
        self._patched_loop: Any = None

    # ------------------------------------------------------------------ handlers

    def _handle(self, signum: int, frame: Any) -> None:
        # Nothing else here: a collective, a save or a log call inside a signal handler can deadlock.
        self._received.append(signum)

    def on_sanity_check_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.on_train_start(trainer, pl_module)  # Lightning's SIGTERM handler would broadcast inside the handler

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        # Installed here (or at the sanity check before), after `Trainer._run` registered Lightning's handlers
        # (`_SignalConnector`): these replace them.
        if self._active:
            return  # installed at the sanity check already
        self._received = []
        self._last_step = trainer.global_step
        signals = list(self.signals)
        requeue = _slurm_requeue_signal(trainer)
        if requeue is not None and requeue not in signals:
            signals.append(requeue)  # Lightning's SLURM handler would otherwise save inside the signal handler
        if threading.current_thread() is not threading.main_thread():
            rank_zero_warn(
                "Preemption signals are ignored: the Trainer does not run in the main thread, where Python delivers "
                "signals. Run `fit` in the main thread, or pass `preemption_signals=None` to silence this."
            )
            return
        for sig in signals:
            self._previous[sig] = signal.getsignal(sig)
            signal.signal(sig, self._handle)
        self._active = tuple(signals)
        if trainer.received_sigterm:  # delivered to Lightning's handler between its registration and now
            self._received.append(signal.SIGTERM)
            # Taken over: Lightning's own checks of the flag would raise on this rank alone, without a save, and
            # leave the others in their next collective.
            clear_received_sigterm(trainer)
        if signal.SIGTERM in self._active:
            # Lightning broadcasts its SIGTERM flag from rank 0 before every batch (`_broadcast_sigterm_tensor`, a
            # private hook of the epoch loop); with its handler replaced the flag stays False, so the all-reduce
            # below takes its place instead of running beside it. Undone when training ends.
            loop = trainer.fit_loop.epoch_loop
            replace_sigterm_broadcast(loop, _no_broadcast)
            self._patched_loop = loop
        self._ensure_group(trainer)

    def _restore(self) -> None:
        for sig, handler in self._previous.items():
            if handler is not None:
                signal.signal(sig, handler)
        self._previous = {}
        self._active = ()
        if self._patched_loop is not None:
            restore_sigterm_broadcast(self._patched_loop)
            self._patched_loop = None
        if self._received:
            names = sorted({signal.Signals(s).name for s in self._received})
            log.warning(f"{', '.join(names)} arrived after the last step boundary of training: nothing saved for it.")
            self._received = []

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._restore()

    def on_exception(self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException) -> None:
        self._received = []  # a preemption exit (or a failure) is on its way out: nothing more to say about it
        self._restore()

    # ------------------------------------------------------------------ the step boundary

    def _ensure_group(self, trainer: L.Trainer) -> None:
        if not distributed_is_initialized() or dist.get_world_size() == 1:
            self._group = None
            return
        if self._group_of is dist.group.WORLD:
            return  # made already, under this process group
        self._group, self._group_of = None, dist.group.WORLD
        if dist.get_backend() != "gloo":
            # A gloo side group over CPU tensors: the flag's all-reduce does not wait for the device's queue (NCCL
            # would need a device tensor and a host sync every step). Created by every rank, in the same order.
            timeout = strategy_timeout(trainer.strategy)
            self._group = dist.new_group(backend="gloo", **({"timeout": timeout} if timeout else {}))

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any) -> None:
        if not self._active or trainer.global_step == self._last_step:
            return  # mid-accumulation: the gradients gathered so far are in no checkpoint, so wait for the step
        self._last_step = trainer.global_step
        received = self._agree(trainer)
        if not received:
            return
        self._save_and_exit(trainer, received)

    def _agree(self, trainer: L.Trainer) -> list[signal.Signals]:
        """The signals any rank received, on every rank (one all-reduce of a few bytes)."""
        flags = torch.tensor([float(sig in self._received) for sig in self._active])
        if distributed_is_initialized() and dist.get_world_size() > 1:
            assert self._group is not None or dist.get_backend() == "gloo", "no side group for the flag"
            dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=self._group)
        return [sig for sig, flag in zip(self._active, flags.tolist(), strict=True) if flag]

    def _save_and_exit(self, trainer: L.Trainer, received: list[signal.Signals]) -> None:
        start = time.monotonic()
        names = ", ".join(sig.name for sig in received)
        # Lightning's own numbering (`hpc_ckpt_{max + 1}.ckpt`), which `ckpt_path="hpc"` resolves to the newest of;
        # rank 0's choice is the one every rank uses (the strategy broadcasts the path).
        path = hpc_save_path(trainer)
        path = trainer.strategy.broadcast(path)
        rank_zero_info(f"Preemption ({names}) at global step {trainer.global_step}: saving {path}")
        trainer.save_checkpoint(path)
        rank_zero_info(f"Preemption: saved {path} in {time.monotonic() - start:.1f} s; exiting.")
        requeue = _slurm_requeue_signal(trainer)
        if requeue is not None and requeue in received and trainer.is_global_zero:
            _requeue_slurm_job()
        self._received = []
        raise SIGTERMException(128 + int(received[0]))  # the first configured: SIGTERM's 143 by default


_HPC_NAME = re.compile(r"hpc_ckpt_(\d+)\.ckpt")


def skip_unfinished_hpc_checkpoint(checkpoint_path: Any) -> Any:
    """The newest whole ``hpc_ckpt_M.ckpt`` when ``checkpoint_path`` is an ``hpc_ckpt_N.ckpt`` whose save never
    finished, else ``checkpoint_path``.

    Lightning resolves ``ckpt_path="hpc"`` to the highest number among the names holding ``hpc_ckpt_``, which includes
    the hidden ``.hpc_ckpt_N.ckpt.partial`` of a save killed midway (a preemption save outliving the scheduler's grace
    period): a requeued job would then fail to resume, every time, although an older whole one is there."""
    text = str(checkpoint_path)
    if "://" in text:
        return checkpoint_path
    path = Path(text)
    match = _HPC_NAME.fullmatch(path.name)
    if match is None or path.exists() or not partial_path(path).exists():
        return checkpoint_path
    whole = [
        (int(m.group(1)), p)
        for p in path.parent.iterdir()
        if (m := _HPC_NAME.fullmatch(p.name)) is not None and int(m.group(1)) < int(match.group(1))
    ]
    if not whole:
        return checkpoint_path  # loading names the unfinished save
    chosen = max(whole)[1]
    rank_zero_warn(
        f"{path.name} in {path.parent} is an unfinished save ({partial_path(path).name}, left by a run killed while "
        f"saving); resuming from {chosen.name}, the newest whole one."
    )
    return chosen


def _no_broadcast() -> None:
    return None


def _slurm_requeue_signal(trainer: L.Trainer) -> signal.Signals | None:
    from lightning.fabric.plugins.environments import SLURMEnvironment

    # Where Lightning's `_SignalConnector` reads it (a single-device strategy has no `cluster_environment`).
    environment = cluster_environment(trainer)
    if isinstance(environment, SLURMEnvironment) and environment.auto_requeue and environment.requeue_signal:
        return signal.Signals(environment.requeue_signal)
    return None


def _requeue_slurm_job() -> None:
    """``scontrol requeue`` this job, as Lightning's SLURM handler does (array jobs included)."""
    array_job_id = os.environ.get("SLURM_ARRAY_JOB_ID")
    if array_job_id is not None:
        job_id = f"{array_job_id}_{os.environ['SLURM_ARRAY_TASK_ID']}"
    else:
        job_id = os.environ["SLURM_JOB_ID"]
    if not re.fullmatch(r"[0-9_-]+", job_id):
        log.warning(f"Not requeuing: unexpected SLURM job id {job_id!r}.")
        return
    try:
        result = subprocess.call(["scontrol", "requeue", job_id])
    except FileNotFoundError:
        log.warning(f"Not requeuing SLURM job {job_id}: `scontrol` was not found.")
        return
    if result == 0:
        log.info(f"Requeued SLURM job {job_id}.")
    else:
        log.warning(f"Requeuing SLURM job {job_id} failed with exit code {result}.")
