"""What the Trainer and Fabric strategies share beyond the pipeline and checkpoints: their constructor's options,
the process groups' lifetime, the patches given up at teardown, and the places where Lightning's defaults assume plain
data parallelism (metric syncs, gradient clipping, data positions)."""

from __future__ import annotations

import atexit
import gc
import types
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Literal

import torch.distributed as dist
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch import nn

from lightning_tp.compat import distributed_is_initialized
from lightning_tp.composition import refusal
from lightning_tp.layout import CP_AXIS, TP_AXIS, ParallelLayout
from lightning_tp.parallel.fsdp import ACCUMULATE_GRADS
from lightning_tp.parallel.grad import clip_grad_norm_
from lightning_tp.parallel_options import ParallelOptions
from lightning_tp.patches import Patch, install, installed, undo_owned
from lightning_tp.plans.discovery import torchmetrics_in
from lightning_tp.state import ParallelState, pipeline_group

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh


@dataclass(frozen=True)
class StrategyOptions:
    """The constructor arguments both strategies take, checked once, without processes, so that a typo fails when
    the strategy is built: the sizes (as given; resolved against the world size in ``setup_environment``) and how
    to parallelise (``precision`` is filled in from the Trainer's or Fabric's flag at setup). Each field but
    ``parallel`` is the argument of that name in :data:`lightning_tp.options.OPTIONS`, with its default."""

    tp_size: int | None
    dp_shard_size: int | None
    dp_replicate_size: int
    parallel: ParallelOptions
    cp_size: int = 1
    ep_size: int = 1
    pp_size: int = 1
    save_distributed_checkpoint: bool = True
    save_frozen_weights: bool = True
    accumulate_grads: Literal["sharded", "unsharded"] = "sharded"

    @classmethod
    def build(
        cls,
        *,
        tp_size: int | None,
        dp_shard_size: int | None,
        dp_replicate_size: int,
        parallelism_config: Any | None,
        tp_plan: Literal["auto"] | Mapping[str, Any],
        cp_size: int = 1,
        ep_size: int = 1,
        pp_size: int = 1,
        fsdp_blocks: Sequence[str] | None,
        save_distributed_checkpoint: bool = True,
        save_frozen_weights: bool = True,
        accumulate_grads: Literal["sharded", "unsharded"] = "sharded",
        **parallel: Any,
    ) -> StrategyOptions:
        if parallelism_config is not None:
            tp_size, dp_shard_size, dp_replicate_size, cp_size = sizes_from_parallelism_config(
                parallelism_config,
                tp_size=tp_size,
                dp_shard_size=dp_shard_size,
                dp_replicate_size=dp_replicate_size,
                cp_size=cp_size,
            )
        pipelines = pp_size if isinstance(pp_size, int) and pp_size >= 1 else 1  # `resolve` refuses a bad one
        ParallelLayout.resolve(
            (tp_size or 1)
            * (dp_shard_size or 1)
            * dp_replicate_size
            * (cp_size if isinstance(cp_size, int) else 1)
            * pipelines,
            tp_size=tp_size,
            dp_shard_size=dp_shard_size,
            dp_replicate_size=dp_replicate_size,
            cp_size=cp_size,
            pp_size=pp_size,
        )
        if not isinstance(ep_size, int) or isinstance(ep_size, bool) or ep_size < 1:
            raise ValueError(f"`ep_size` must be a positive integer, got {ep_size!r}.")
        if tp_size is not None and ep_size > 1 and ep_size % tp_size:
            raise refusal(
                "ep+tp_not_multiple", f"ep_size={ep_size} must be a multiple of tp_size={tp_size}"
            )  # the rest (the ranks it borrows) is checked against the world size in `layout`
        if accumulate_grads not in ACCUMULATE_GRADS:
            raise ValueError(
                f"`accumulate_grads` must be one of {ACCUMULATE_GRADS}, got {accumulate_grads!r}: 'sharded' "
                "reduce-scatters every micro-batch's gradients (least memory), 'unsharded' keeps them whole until the "
                "optimizer step's last micro-batch (one reduce-scatter per step)."
            )
        options = ParallelOptions(tp_plan=tp_plan, fsdp_blocks=tuple(fsdp_blocks) if fsdp_blocks else None, **parallel)
        if not save_frozen_weights and not save_distributed_checkpoint:
            raise refusal(
                "save_frozen_weights+full_file", "`save_frozen_weights=False` needs `save_distributed_checkpoint=True`"
            )
        return cls(
            tp_size=tp_size,
            dp_shard_size=dp_shard_size,
            dp_replicate_size=dp_replicate_size,
            cp_size=cp_size,
            ep_size=ep_size,
            pp_size=pp_size,
            parallel=options,
            save_distributed_checkpoint=save_distributed_checkpoint,
            save_frozen_weights=save_frozen_weights,
            accumulate_grads=accumulate_grads,
        )

    def layout(self, world_size: int) -> ParallelLayout:
        layout = ParallelLayout.resolve(
            world_size,
            tp_size=self.tp_size,
            dp_shard_size=self.dp_shard_size,
            dp_replicate_size=self.dp_replicate_size,
            cp_size=self.cp_size,
            ep_size=self.ep_size,
            pp_size=self.pp_size,
        )
        if self.accumulate_grads != "sharded" and layout.pp_size > 1:
            rank_zero_warn(
                f"`accumulate_grads={self.accumulate_grads!r}` is ignored under pp_size={layout.pp_size}: torch's "
                "pipeline stage reduces each stage's gradients at the end of every schedule step, as 'sharded' does."
            )
        elif self.accumulate_grads != "sharded" and layout.fsdp_size == 1:
            rank_zero_warn(
                f"`accumulate_grads={self.accumulate_grads!r}` is ignored: the layout ({layout}) has no data or "
                "context parallelism, so there are no gradients to reduce between micro-batches."
            )
        return layout


class MeshMixin:
    """The layout and the meshes of both strategies, resolved and built in their ``setup_environment`` (after the
    configuration is checked, once the world size is known). ``_BUILT_IN`` names, in errors, where that happens."""

    _BUILT_IN = "`setup_environment`"
    _layout: ParallelLayout | None = None
    _dp_mesh: DeviceMesh | None = None
    _expert_mesh: DeviceMesh | None = None
    _device_mesh: DeviceMesh | None

    @property
    def layout(self) -> ParallelLayout:
        """The resolved sizes of the mesh axes."""
        if self._layout is None:
            raise RuntimeError(f"The parallel layout is resolved in {self._BUILT_IN}, once the world size is known.")
        return self._layout

    @property
    def device_mesh(self) -> DeviceMesh:
        """The mesh with axes ``dp_replicate``, ``dp_shard``, ``tp``."""
        if self._device_mesh is None:
            raise RuntimeError(f"The device mesh is built in {self._BUILT_IN}, after the processes have started.")
        return self._device_mesh

    @property
    def tp_mesh(self) -> DeviceMesh:
        """The 1-D tensor-parallel sub-mesh of this rank."""
        return self.device_mesh[TP_AXIS]

    @property
    def cp_mesh(self) -> DeviceMesh:
        """The 1-D context-parallel sub-mesh of this rank: the ranks that split each of its sequences (they read the
        same rows)."""
        return self.device_mesh[CP_AXIS]

    @property
    def expert_mesh(self) -> DeviceMesh | None:
        """The expert mesh (``dp_replicate``, ``efsdp``, ``ep``) over the same ranks, with ``ep_size > 1``; else
        ``None``. ``expert_mesh["ep"]``: the ranks this rank's experts exchange tokens with."""
        if self._device_mesh is None:
            return self.device_mesh  # raises the clear error: nothing is built yet
        return self._expert_mesh

    @property
    def dp_mesh(self) -> DeviceMesh:
        """The flattened 1-D data-parallel sub-mesh of this rank (``dp_replicate`` x ``dp_shard``)."""
        if self._dp_mesh is None:
            return self.device_mesh  # raises the clear error: nothing is built yet
        return self._dp_mesh

    @property
    def pp_group(self) -> Any | None:
        """The process group of this rank's pipeline (``None`` with ``pp_size=1``): gradient norms sum over it."""
        if self._layout is None:
            return None
        return pipeline_group(self.layout, self.device_mesh)

    @property
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        # Every rank of a TP group (and of a CP group) must see the same batch: split the data over the data-parallel
        # ranks only.
        return {"num_replicas": self.dp_mesh.size(), "rank": self.dp_mesh.get_local_rank()}

    def _data_parallel_group(self) -> Any | None:
        """The group collectives default to (``None`` before the mesh exists or without a process group)."""
        if self._device_mesh is None or not distributed_is_initialized():
            return None
        return self.dp_mesh.get_group()

    def teardown(self) -> None:
        """Give up the patches of the whole process that the strategy's model owns (the router's load-balancing loss
        function of a mixture-of-experts family: a second model or Trainer in this process gets the family's own, until
        this model runs again) and the precision plugin's clipping (set again at the next setup), then Lightning's
        teardown. The model's own patches stay: it is still used after ``fit`` (``save_pretrained``, ``generate``).
        The Trainer calls it at the end of each ``fit``/``validate``/``test``/``predict``; Fabric never does, and
        its strategy does not hold the modules it set up."""
        release_process_wide_patches(getattr(self, "model", None))
        plugin = getattr(self, "precision_plugin", None)
        if plugin is not None:
            undo_owned(plugin)
        super().teardown()  # type: ignore[misc]

    def _start_processes_and_mesh(self, layout: ParallelLayout) -> None:
        """The process group (destroyed at exit when this strategy created it) and the mesh of ``layout``."""
        self._layout = layout
        owns_process_group = not distributed_is_initialized()
        self._setup_distributed()  # type: ignore[attr-defined]
        if owns_process_group:
            destroy_process_groups_at_exit()
        self._device_mesh, self._dp_mesh = layout.build_device_mesh(
            self.root_device.type,  # type: ignore[attr-defined]
            timeout=self._timeout,  # type: ignore[attr-defined]
        )
        if layout.ep_size > 1:
            self._expert_mesh = layout.build_expert_mesh(
                self.root_device.type,  # type: ignore[attr-defined]
                timeout=self._timeout,  # type: ignore[attr-defined]
            )


def sizes_from_parallelism_config(
    config: Any, *, tp_size: int | None, dp_shard_size: int | None, dp_replicate_size: int, cp_size: int = 1
) -> tuple[int | None, int | None, int, int]:
    """Sizes from an ``accelerate.ParallelismConfig`` (duck-typed: accelerate is not a dependency): ``tp_size``,
    ``dp_shard_size``, ``dp_replicate_size`` and ``cp_size``."""
    if tp_size is not None or dp_shard_size is not None or dp_replicate_size != 1 or cp_size != 1:
        raise ValueError(
            "Pass either `parallelism_config` or the sizes (`tp_size`, `dp_shard_size`, `dp_replicate_size`, "
            "`cp_size`), not both."
        )
    unsupported = {name: getattr(config, name, 1) for name in ("sp_size",)}
    unsupported = {name: size for name, size in unsupported.items() if size not in (None, 1)}
    if unsupported:
        raise ValueError(
            f"`parallelism_config` asks for {unsupported} (DeepSpeed-Ulysses sequence parallelism); this strategy "
            "offers TP, context parallelism (`cp_size`, attention exchanging keys and values), FSDP2 and HSDP."
        )
    names = ("tp_size", "dp_shard_size", "dp_replicate_size", "cp_size")
    sizes = [getattr(config, name, None) for name in names]
    if any(size is not None and not isinstance(size, int) for size in sizes):
        raise ValueError(f"`parallelism_config` must carry integer sizes, got {config!r}.")
    return sizes[0] or 1, sizes[1] or 1, sizes[2] or 1, sizes[3] or 1


_destroy_registered = False


def destroy_process_groups_at_exit() -> None:
    """Destroy the world group and every subgroup (the mesh's included) when the interpreter exits, while it can still
    run Python: left to interpreter shutdown, gloo's and NCCL's threads and sockets are torn down in no fixed order,
    and about one successful launch in 30 ended in SIGABRT ("terminate called without an active exception"). Only for
    a world group the strategy created: a group the user created before is theirs to destroy. Lightning registers the
    same for NCCL only."""
    global _destroy_registered
    if _destroy_registered:
        return
    _destroy_registered = True

    def destroy() -> None:
        # Trainer, strategy and model form reference cycles that only the interpreter's final collection frees, when
        # gloo's threads can no longer take the GIL to drop the tensors their finished work holds: free them now.
        gc.collect()
        if distributed_is_initialized():
            dist.destroy_process_group()
        gc.collect()

    atexit.register(destroy)


def reduce_metrics_over(root: nn.Module, group: Any) -> None:
    """torchmetrics syncs over the world group by default, which counts each sample once per TP rank: sync the
    metrics that name no group over ``group`` (the data-parallel one)."""
    for metric in torchmetrics_in(root):
        if metric.process_group is None:
            metric.process_group = group


def release_process_wide_patches(root: nn.Module | None) -> list[Patch]:
    """Give up the patches of modules and classes (which the whole process sees, :mod:`lightning_tp.patches`) owned by
    ``root`` or its modules; each is undone unless another owner still holds it. Their patches of instances stay.
    Returns the patches undone."""
    if root is None:
        return []
    return [patch for module in root.modules() for patch in undo_owned(module, instances=False)]


def clip_with_dtensor_support(plugin: Any, *, state: ParallelState | None, pp_group: Any | None = None) -> None:
    """Lightning clips with ``torch.nn.utils.clip_grad_norm_``, which fails on DTensor gradients across meshes; route
    the precision plugin's norm clipping to :func:`lightning_tp.clip_grad_norm_`, same arguments (the norm over every
    stage of a pipeline: ``pp_group``, and the model's parallel ``state``, which finds a weight tied across stages).
    A patch of the plugin it owns (the strategy's teardown undoes it); a later setup's replaces it."""

    def clip_grad_by_norm(plugin_self: Any, optimizer: Any, clip_val: int | float) -> None:
        clip_grad_norm_(plugin_self.main_params(optimizer), clip_val, pp_group=pp_group, state=state)

    earlier = installed(plugin, "clip_grad_by_norm")
    if earlier is not None:
        earlier.undo()
    install(plugin, "clip_grad_by_norm", types.MethodType(clip_grad_by_norm, plugin), owner=plugin)


def drop_data_position(metadata: dict[str, Any], *, saved_dp_size: int, dp_size: int) -> None:
    """A data loader's position (samples read per rank) means nothing for another number of data-parallel ranks, and
    torchdata's loaders fail restoring it; the epoch in progress restarts from its beginning."""
    fit_loop = metadata.get("loops", {}).get("fit_loop", {}).get("state_dict", {})
    if fit_loop.pop("combined_loader", None):
        rank_zero_warn(
            f"The checkpoint was written with {saved_dp_size} data-parallel rank(s) and this run has {dp_size}: the "
            "data loader's position is not restored, the epoch in progress restarts from its first batch. Weights, "
            "optimizer, scheduler and loop counters are restored."
        )


def resumes_in_the_next_epoch(trainer: Any) -> bool:
    """Whether a resumed fit goes on in the next epoch because its checkpoint was written after the epoch's last
    training batch (``ModelCheckpoint(every_n_train_steps=N)`` where N divides the epoch, ``limit_train_batches``
    included): Lightning 2.6's own test in ``FitLoop.reset`` (restarted mid-epoch, on a training batch's end, at the
    last batch), read before that reset moves the counters on. Lightning then starts the next epoch, but torchdata's
    ``StatefulDataLoader`` would restore its end-of-epoch position into that epoch's iterator, which yields nothing:
    the epoch is skipped and the run goes on in the order of the one after (on one device too)."""
    epochs = trainer.fit_loop.epoch_progress.total
    batches = trainer.fit_loop.epoch_loop.batch_progress
    mid_epoch = epochs.started == epochs.ready and epochs.processed == epochs.started - 1
    mid_epoch = mid_epoch and epochs.completed == epochs.processed
    total = batches.total
    on_batch_end = total.started == total.ready and total.processed == total.started
    on_batch_end = on_batch_end and total.completed == total.processed - 1
    return mid_epoch and on_batch_end and batches.is_last_batch


def step_timeout_seconds(
    step_timeout: timedelta | float | Literal["auto"] | None, *, timeout: timedelta | None
) -> tuple[float | None, bool]:
    """The watchdog's limit and whether it adapts. ``"auto"``: learn the step time (see ``StepWatchdog``); outside
    steps, twice the collectives' timeout, since a collective waiting longer than that fails anyway."""
    from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout

    from lightning_tp.runtime.watchdog import resolve_step_timeout

    if step_timeout == "auto":
        return resolve_step_timeout(2 * (timeout or default_pg_timeout)), True
    return resolve_step_timeout(step_timeout), False
