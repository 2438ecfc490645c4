"""The private names of Lightning (``lightning.fabric`` and ``lightning.pytorch``) that lightning_tp uses, each with
why: helpers its own strategies call, imported under public names, and the Trainer's private state (the SIGTERM flag
and its broadcast, the checkpoint, accelerator and logger connectors, a module's device mesh and device, the fit
loop's loader positions, a strategy's timeout)."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import torch
from lightning.fabric.strategies.model_parallel import _load_checkpoint as load_checkpoint
from lightning.fabric.strategies.strategy import _BackwardSyncControl as BackwardSyncControl
from lightning.fabric.utilities.data import _set_sampler_epoch as set_sampler_epoch
from lightning.fabric.utilities.distributed import _all_gather_ddp_if_available as all_gather_ddp_if_available
from lightning.fabric.utilities.distributed import _sync_ddp_if_available as sync_ddp_if_available
from lightning.fabric.utilities.optimizer import _optimizers_to_device as optimizers_to_device
from lightning.fabric.utilities.throughput import _CUDA_FLOPS as CUDA_FLOPS
from torch import nn

if TYPE_CHECKING:
    import lightning as L
    from torch.distributed.device_mesh import DeviceMesh

__all__ = [
    "load_checkpoint",
    "BackwardSyncControl",
    "set_sampler_epoch",
    "all_gather_ddp_if_available",
    "sync_ddp_if_available",
    "optimizers_to_device",
    "CUDA_FLOPS",
    "clear_received_sigterm",
    "replace_sigterm_broadcast",
    "restore_sigterm_broadcast",
    "hpc_save_path",
    "model_checkpoint_dirs_from_file_urls",
    "cluster_environment",
    "set_device_mesh",
    "forget_loader_position",
    "record_module_device",
    "strategy_timeout",
    "logs_this_step",
]

# Lightning (imported above under public names):
# - `load_checkpoint`: ModelParallelStrategy's DCP loader, shared with its Fabric twin; no public function.
# - `set_sampler_epoch`: sets the epoch of a dataloader's sampler wherever Lightning keeps it; no public helper.
# - `all_gather_ddp_if_available`, `sync_ddp_if_available`: Lightning's gather/reduce on a group, what its own
#   strategies call; the public `Strategy.all_gather`/`reduce` are what we implement with them.
# - `optimizers_to_device`: moves optimizer states after a checkpoint load, as Lightning's strategies do.
# - `CUDA_FLOPS`: Lightning's table of dense peak FLOPs per GPU; `get_available_flops` does not know the H200.
# - `BackwardSyncControl`: the base of what `fabric.no_backward_sync` calls; Fabric's strategies set one, privately.


def clear_received_sigterm(trainer: L.Trainer) -> None:
    """Reset the Trainer's SIGTERM flag: ``trainer.received_sigterm`` has no public setter."""
    trainer._signal_connector.received_sigterm = False


def replace_sigterm_broadcast(loop: Any, broadcast: Callable[[], None]) -> None:
    """Replace the epoch loop's per-batch broadcast of the SIGTERM flag (``_broadcast_sigterm_tensor``, private);
    undo with :func:`restore_sigterm_broadcast`."""
    loop._broadcast_sigterm_tensor = broadcast


def restore_sigterm_broadcast(loop: Any) -> None:
    loop.__dict__.pop("_broadcast_sigterm_tensor", None)


def hpc_save_path(trainer: L.Trainer) -> str:
    """Lightning's name for the next HPC checkpoint (``hpc_ckpt_{max + 1}.ckpt``, which ``ckpt_path="hpc"`` resolves
    to the newest of); only its private checkpoint connector knows the rule."""
    return trainer._checkpoint_connector.hpc_save_path(trainer.default_root_dir)


def model_checkpoint_dirs_from_file_urls(callbacks: Iterable[Any]) -> None:
    """Point each ``ModelCheckpoint`` built with ``dirpath="file:///abs/dir"`` at ``/abs/dir`` (call it before the
    callbacks' ``setup``). Why: Lightning 2.6.6's ``ModelCheckpoint.__init__`` (its private ``__init_ckpt_dir``) takes
    ``os.path.realpath`` of every local-protocol dirpath, a ``file://`` URL included, so the URL already reads
    ``<cwd>/file:/abs/dir`` when any hook of a strategy runs, and checkpoints would land under the working directory.
    The URL is recovered from that shape only where its realpath gives exactly this dirpath (a relative dirpath that
    starts with a directory named ``file:`` reads the same, and is taken as the URL too)."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    mangled_head = os.path.join(os.path.realpath(os.getcwd()), "file:")
    for callback in callbacks:
        dirpath = getattr(callback, "dirpath", None) if isinstance(callback, ModelCheckpoint) else None
        if not isinstance(dirpath, str) or not dirpath.startswith(mangled_head + os.sep):
            continue
        local = dirpath[len(mangled_head) :]  # "/abs/dir"
        if os.path.realpath(os.path.expanduser(f"file://{local}")) == dirpath:  # what __init_ckpt_dir does
            callback.dirpath = local


def cluster_environment(trainer: L.Trainer) -> Any:
    """The Trainer's cluster environment where Lightning's signal handling reads it (a single-device strategy has no
    ``cluster_environment`` attribute of its own)."""
    return trainer._accelerator_connector.cluster_environment


def set_device_mesh(module: L.LightningModule, mesh: DeviceMesh) -> None:
    """Give a LightningModule its ``device_mesh`` (a read-only property over the private ``_device_mesh``, which
    Lightning's own ModelParallelStrategy sets)."""
    module._device_mesh = mesh


def forget_loader_position(trainer: L.Trainer) -> None:
    """Drop the data loaders' positions a resumed fit loop was about to restore (its private
    ``_combined_loader_states_to_load``): the epoch starts from its first batch."""
    trainer.fit_loop._combined_loader_states_to_load = []


def record_module_device(module: nn.Module, device: torch.device) -> None:
    """Record ``device`` as a Lightning module's own (``self.device``) without moving its parameters, as
    ``module.to(device)`` would have recorded it (Lightning's ``_DeviceDtypeModuleMixin`` keeps it in the private
    ``_device``). Other modules are left alone."""
    from lightning.fabric.utilities.device_dtype_mixin import _DeviceDtypeModuleMixin

    if isinstance(module, _DeviceDtypeModuleMixin):
        module._device = device


def strategy_timeout(strategy: Any) -> timedelta | None:
    """The process-group ``timeout`` a Lightning strategy was built with (kept in the private ``_timeout``)."""
    return getattr(strategy, "_timeout", None)


def logs_this_step(trainer: Any) -> bool:
    """Whether the Trainer's loggers write this training step's metrics (``log_every_n_steps``), as Lightning decides
    it (``_logger_connector.should_update_logs``, private)."""
    return bool(trainer._logger_connector.should_update_logs)
