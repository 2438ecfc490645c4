"""``TensorParallelStrategy`` for Lightning Fabric: the same parallelisation as the Trainer strategy (one call to
:func:`lightning_tp.parallelize`), the same checkpoint format, in Fabric's hooks.

.. code-block:: python

    fabric = Fabric(accelerator="cuda", devices=4, strategy=TensorParallelStrategy(tp_size=2))  # or strategy="tp"
    fabric.launch()
    with fabric.init_module(empty_init=True):
        model = lightning_tp.from_pretrained("Qwen/Qwen3-0.6B")  # on meta: loaded slice by slice, sharded
    model = fabric.setup_module(model)
    optimizer = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=1e-5))
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from contextlib import AbstractContextManager, nullcontext
from datetime import timedelta
from pathlib import Path
from typing import Any, Literal

import torch
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.plugins.io import TorchCheckpointIO
from lightning.fabric.strategies import ModelParallelStrategy
from lightning.fabric.strategies.strategy import Strategy
from lightning.fabric.utilities.types import ReduceOp
from torch import Tensor, nn
from torch.optim import Optimizer
from typing_extensions import override

from lightning_tp.checkpoint import state as checkpoint_io
from lightning_tp.checkpoint.aliases import optimizer_state_dict
from lightning_tp.checkpoint.format import MODEL_KEY, flat_optimizer_state
from lightning_tp.checkpoint.publish import refuse_waiting_saves
from lightning_tp.checkpoint.stage_files import full_model_state, full_optimizer_state
from lightning_tp.compat import (
    BackwardSyncControl,
    all_gather_ddp_if_available,
    distributed_is_initialized,
    sync_ddp_if_available,
)
from lightning_tp.options import TRAINER_ONLY, document
from lightning_tp.parallel.fsdp import micro_batch_grads
from lightning_tp.parallel.grad import clip_grad_norm_
from lightning_tp.parallel_options import ParallelOptions
from lightning_tp.parallelize import apply_parallelisms
from lightning_tp.state import parallel_state
from lightning_tp.strategies.shared import MeshMixin, StrategyOptions

#: meta.pt's entry naming which state keys of ``fabric.save`` hold the model and the optimizers.
FABRIC_KEY = "lightning_tp_fabric"
#: How to load a checkpoint that holds arbitrary objects, in the error that refuses it.
_LOAD_OPT_IN = "pass `weights_only=False` to `fabric.load`"


@document("fabric")
class TensorParallelStrategy(MeshMixin, ModelParallelStrategy):
    """Tensor parallelism (and FSDP2 over the remaining ranks) for Transformers models in Lightning Fabric.

    ``fabric.setup(model, optimizer)`` / ``fabric.setup_module(model)`` shard the model with its own TP plan (or
    ``tp_plan``) through :func:`lightning_tp.parallelize`; an optimizer built before the setup is pointed at the
    sharded parameters. ``fabric.setup_dataloaders`` splits the data over the data-parallel ranks only (the ranks of a
    TP group read the same batches); ``fabric.all_reduce``/``all_gather`` default to the data-parallel group;
    ``fabric.clip_gradients`` computes the global norm exactly; ``fabric.save``/``fabric.load`` write and read the
    format of the Trainer strategy (a DCP directory that loads on any layout, at a local path published by rename once
    complete, or at an fsspec URL committed by a marker), which ``python -m lightning_tp.export`` reads.

    Each argument is defined, with its meaning, in :data:`lightning_tp.options.OPTIONS`, from which ``Args:`` below is
    assembled.
    """

    strategy_name = "tp"
    _BUILT_IN = "`fabric.launch()`"

    def __init__(
        self,
        tp_size: int | None = None,
        *,
        tp_plan: Literal["auto"] | dict[str, Any] = "auto",
        dp_shard_size: int | None = None,
        dp_replicate_size: int = 1,
        cp_size: int = 1,
        cp_comm: Literal["all_gather", "ring"] = "all_gather",
        ep_size: int = 1,
        parallelism_config: Any | None = None,
        pp_size: int = 1,
        pp_schedule: str | None = None,
        pp_microbatches: int | None = None,
        pp_stages_per_rank: int = 1,
        pp_split: list[int] | None = None,
        pp_pad_to_multiple_of: int | None = None,
        activation_checkpointing: bool = False,
        compile: bool | dict[str, Any] = False,
        reshard_after_forward: bool = True,
        cpu_offload: bool = False,
        accumulate_grads: Literal["sharded", "unsharded"] = "sharded",
        fsdp_blocks: list[str] | None = None,
        fsdp_param_dtype: Literal["auto", "bf16"] | None = "auto",
        tp_grad_reduce_dtype: Literal["fp32"] | None = None,
        sequence_parallel: bool = False,
        loss_parallel: bool = False,
        save_distributed_checkpoint: bool = True,
        save_frozen_weights: bool = True,
        process_group_backend: str | None = None,
        timeout: timedelta | None = default_pg_timeout,
        **trainer_only: Any,
    ) -> None:
        for name in trainer_only:
            if name in TRAINER_ONLY:
                raise ValueError(
                    f"`{name}` is an argument of the Trainer's TensorParallelStrategy, not Fabric's: "
                    f"{TRAINER_ONLY[name]}. Drop it."
                )
            raise TypeError(f"{type(self).__name__}.__init__() got an unexpected keyword argument {name!r}")
        super().__init__(
            parallelize_fn=_unused_parallelize_fn,
            save_distributed_checkpoint=save_distributed_checkpoint,
            process_group_backend=process_group_backend,
            timeout=timeout,
        )
        # Checked here, without processes, so that a typo fails when the strategy is built.
        self.options = StrategyOptions.build(
            tp_size=tp_size,
            dp_shard_size=dp_shard_size,
            dp_replicate_size=dp_replicate_size,
            cp_size=cp_size,
            ep_size=ep_size,
            pp_size=pp_size,
            parallelism_config=parallelism_config,
            tp_plan=tp_plan,
            fsdp_blocks=fsdp_blocks,
            sequence_parallel=sequence_parallel,
            cp_comm=cp_comm,
            loss_parallel=loss_parallel,
            pp_schedule=pp_schedule,
            pp_microbatches=pp_microbatches,
            pp_stages_per_rank=pp_stages_per_rank,
            pp_split=pp_split,
            pp_pad_to_multiple_of=pp_pad_to_multiple_of,
            activation_checkpointing=activation_checkpointing,
            compile=compile,
            reshard_after_forward=reshard_after_forward,
            cpu_offload=cpu_offload,
            fsdp_param_dtype=fsdp_param_dtype,
            tp_grad_reduce_dtype=tp_grad_reduce_dtype,
            save_distributed_checkpoint=save_distributed_checkpoint,
            save_frozen_weights=save_frozen_weights,
            accumulate_grads=accumulate_grads,
        )
        self._backward_sync_control = _MicroBatchGrads(self.options.accumulate_grads)

    # ------------------------------------------------------------------ layout and mesh

    @override
    def setup_environment(self) -> None:
        # The configuration is checked before the process group starts: a mistake raises on every rank alike. Fabric's
        # connector refused the precisions TP does not support already.
        layout = self.options.layout(self.world_size)
        self.parallel_options().check_layout(layout, device=self.root_device)
        Strategy.setup_environment(self)  # the accelerator's device; not ModelParallelStrategy's mesh
        self._start_processes_and_mesh(layout)

    # ------------------------------------------------------------------ sharding

    def parallel_options(self) -> ParallelOptions:
        """The options :func:`lightning_tp.parallelize` gets, with Fabric's precision (set after construction)."""
        precision = str(getattr(self.precision, "precision", "32-true"))
        return ParallelOptions(**{**vars(self.options.parallel), "precision": precision})

    @override
    def setup_module(self, module: nn.Module) -> nn.Module:
        """Shard ``module`` in place (TP, then FSDP2 over the data-parallel ranks), materialising and loading what was
        built on the meta device."""
        from torch.distributed.fsdp import FullyShardedDataParallel

        if any(isinstance(m, FullyShardedDataParallel) for m in module.modules()):
            raise TypeError(
                f"The model holds `FullyShardedDataParallel` (FSDP1) modules; {type(self).__name__} applies FSDP2 "
                "itself: pass the unwrapped model."
            )
        apply_parallelisms(
            module,
            mesh=self.device_mesh,
            layout=self.layout,
            options=self.parallel_options(),
            device=self.root_device,
            expert_mesh=self.expert_mesh,
            convert_module=lambda converted: converted,  # Fabric's precision plugin cast it before `setup_module`
        )
        return module

    @override
    def setup_module_and_optimizers(
        self, module: nn.Module, optimizers: list[Optimizer], scheduler: Any | None = None
    ) -> tuple[nn.Module, list[Optimizer], Any | None]:
        """``fabric.setup(model, optimizer)``: sharding replaces the parameters (DTensors, materialised meta tensors),
        so the optimizers, built on the originals, are pointed at their replacements by name (under pipeline
        parallelism, at this rank's stages' only)."""
        names = _parameter_names(module)
        for optimizer in optimizers:
            _check_fresh(optimizer, names)
        module = self.setup_module(module)
        replacements = {_unwrapped_name(n): p for n, p in module.named_parameters(remove_duplicate=False)}
        for optimizer in optimizers:
            for group in optimizer.param_groups:
                # Under pipeline parallelism a rank keeps its stages' parameters only; elsewhere a missing one raises.
                group["params"] = [
                    replacements[names[id(p)]]
                    for p in group["params"]
                    if self.layout.pp_size == 1 or names[id(p)] in replacements
                ]
        return module, optimizers, scheduler

    @override
    def module_to_device(self, module: nn.Module) -> None:
        pass  # `parallelize` places every shard

    @override
    def module_init_context(self, empty_init: bool | None = None) -> AbstractContextManager:
        """``empty_init=True``: built on the meta device; ``setup_module`` allocates only each rank's shards and fills
        them from the model's files (``lightning_tp.from_pretrained``) or with Transformers' own initialisation."""
        return super().module_init_context(empty_init=empty_init)

    # ------------------------------------------------------------------ collectives

    def _default_to_data_parallel(self, group: Any | None) -> Any | None:
        """``fabric.all_reduce``/``all_gather`` pass the world group when the user gives none (Fabric fills it in
        before the strategy sees it): that default, or ``None``, means the data-parallel group here."""
        if group is not None and group is not torch.distributed.group.WORLD:
            return group
        return self._data_parallel_group() or group

    @override
    def all_reduce(self, tensor: Tensor, group: Any | None = None, reduce_op: ReduceOp | str | None = "mean") -> Tensor:
        """Over the data-parallel group by default (and for the world group, Fabric's default): the ranks of a TP group
        hold the same values, and a sum over the world would count each one ``tp_size`` times. Over every rank:
        ``torch.distributed.all_reduce``."""
        if isinstance(tensor, Tensor):
            return sync_ddp_if_available(tensor, self._default_to_data_parallel(group), reduce_op)
        return tensor

    @override
    def barrier(self, *args: Any, **kwargs: Any) -> None:
        refuse_waiting_saves("the strategy's barrier")  # a rank waiting in a save this rank skipped raises, not hangs
        super().barrier(*args, **kwargs)

    @override
    def all_gather(self, tensor: Tensor, group: Any | None = None, sync_grads: bool = False) -> Tensor:
        """Over the data-parallel group by default, as ``all_reduce``: one entry per data-parallel replica."""
        return all_gather_ddp_if_available(tensor, group=self._default_to_data_parallel(group), sync_grads=sync_grads)

    @override
    def reduce_boolean_decision(self, decision: bool, all: bool = True) -> bool:
        """Over every rank (``all_reduce`` defaults to the data-parallel group; a decision is compared with the world
        size)."""
        flag = torch.tensor(int(decision), device=self.root_device)
        world = torch.distributed.group.WORLD if distributed_is_initialized() else None
        flag = sync_ddp_if_available(flag, world, reduce_op="sum")
        return bool(flag == self.world_size) if all else bool(flag > 0)

    @override
    def clip_gradients_norm(
        self,
        module: nn.Module,
        optimizer: Optimizer,
        max_norm: float | int,
        norm_type: float | int = 2.0,
        error_if_nonfinite: bool = True,
    ) -> Tensor:
        """The global norm over every shard, the one a single process computes (torch's ``clip_grad_norm_`` fails on
        gradients that are DTensors on several meshes mixed with plain tensors)."""
        self.precision.unscale_gradients(optimizer)
        parameters = self.precision.main_params(optimizer)
        return clip_grad_norm_(
            parameters,
            max_norm,
            norm_type,
            error_if_nonfinite=error_if_nonfinite,
            pp_group=self.pp_group,
            state=parallel_state(module),
        )

    @override
    def clip_gradients_value(self, module: nn.Module, optimizer: Optimizer, clip_val: float | int) -> None:
        """Element-wise, on each rank's shards (torch's foreach version refuses DTensors mixed with tensors)."""
        self.precision.unscale_gradients(optimizer)
        for parameter in self.precision.main_params(optimizer):
            if parameter.grad is not None:
                parameter.grad.clamp_(-clip_val, clip_val)

    # ------------------------------------------------------------------ checkpoints

    @override
    def save_checkpoint(
        self,
        path: str | Path,
        state: dict[str, nn.Module | Optimizer | Any],
        storage_options: Any | None = None,
        filter: dict[str, Callable[[str, Any], bool]] | None = None,
    ) -> None:
        """Save in the Trainer strategy's format (see :func:`lightning_tp.checkpoint.state.save_checkpoint`: crash-safe,
        resharding, at a local path or an fsspec URL): the model's weights under ``state_dict``, each optimizer under
        its key, the rest (plain values, the ``state_dict()`` of stateful objects) and what export needs in
        ``meta.pt``. One model per checkpoint."""
        if storage_options is not None:
            raise TypeError(f"`{type(self).__name__}.save_checkpoint` takes no `storage_options` (it writes with DCP).")
        if filter is not None:
            raise ValueError(f"`fabric.save(..., filter=...)` is not supported by {type(self).__name__}; drop it.")
        module_key, module, optimizers = _split_state(state, action="save")
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            get_model_state_dict,
        )

        options = StateDictOptions(
            full_state_dict=not self._save_distributed_checkpoint,
            cpu_offload=True,
            ignore_frozen_params=not self.options.save_frozen_weights,
            flatten_optimizer_state_dict=flat_optimizer_state(self.layout.pp_size),
        )
        checkpoint: dict[str, Any] = {
            key: (value.state_dict() if _is_stateful(value) else value)
            for key, value in state.items()
            if key != module_key and key not in optimizers
        }
        checkpoint[FABRIC_KEY] = {"model": module_key, "optimizers": list(optimizers)}
        if not self._save_distributed_checkpoint and self.layout.pp_size > 1:  # one file from every stage
            checkpoint[MODEL_KEY] = full_model_state(module, ignore_frozen=not self.options.save_frozen_weights)
            for key, optimizer in optimizers.items():
                checkpoint[key] = full_optimizer_state(module, optimizer, by_position=False)
        else:
            checkpoint[MODEL_KEY] = get_model_state_dict(module, options=options)
            for key, optimizer in optimizers.items():
                checkpoint[key] = optimizer_state_dict(module, optimizer, options=options)
        checkpoint_io.save_checkpoint(
            checkpoint,
            path,
            tensor_keys=[MODEL_KEY, *optimizers],
            root=module,
            layout=self._layout,
            distributed=self._save_distributed_checkpoint,
            write_file=TorchCheckpointIO().save_checkpoint,  # fsspec-aware (URLs), makes the parent directory
        )

    @override
    def load_checkpoint(
        self,
        path: str | Path,
        state: nn.Module | Optimizer | dict[str, nn.Module | Optimizer | Any] | None = None,
        strict: bool = True,
        weights_only: bool | None = None,
    ) -> dict[str, Any]:
        """Load a checkpoint written on any layout (DCP reshards) into ``state``'s model and optimizers, after
        checking on every rank that it is whole and fits the model (see
        :func:`lightning_tp.checkpoint.state.load_checkpoint`). Plain values the state asks for are set in it (stateful
        objects get ``load_state_dict``); the rest is returned. Only tensors and plain values are unpickled unless
        ``weights_only=False``."""
        weights_only = True if weights_only is None else weights_only  # a checkpoint is untrusted input
        if isinstance(state, nn.Module):
            # `fabric.load_raw(path, model)`: a plain state-dict file, Lightning's loader (rank by rank, into shards).
            return super().load_checkpoint(path, state, strict=strict, weights_only=weights_only)
        if not isinstance(state, dict) or not state:
            raise ValueError(
                f"{type(self).__name__} loads into a state dict holding the model: "
                "`fabric.load(path, {'model': model, 'optimizer': optimizer, ...})`."
            )
        module_key, module, optimizers = _split_state(state, action="load")
        metadata = checkpoint_io.load_checkpoint(
            path,
            model=module,
            modules={MODEL_KEY: module},
            optimizers=optimizers,
            weights_only=weights_only,
            strict=strict,
            opt_in=_LOAD_OPT_IN,
        )
        metadata.pop(FABRIC_KEY, None)
        # Random states are not restored: a Fabric loop seeds as it sees fit (`fabric.seed_everything`).
        checkpoint_io.pop_rng_entry(metadata, layout=self.layout, restore=False)
        requested = [key for key in state if key != module_key and key not in optimizers]
        missing = [key for key in requested if key not in metadata]
        if strict and missing:
            raise KeyError(
                f"The checkpoint {path} holds no {missing} (it holds {sorted(metadata)}). Pass `strict=False` to "
                "load what it has."
            )
        for key in requested:
            if key not in metadata:
                continue
            value = metadata.pop(key)
            if _is_stateful(state[key]):
                state[key].load_state_dict(value)
            else:
                state[key] = value
        return metadata

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: Any) -> None:
        strategy_registry.register(
            cls.strategy_name,
            cls,
            description="Tensor parallelism for Transformers models in Fabric (lightning_tp)",
            override=True,
        )


class _MicroBatchGrads(BackwardSyncControl):
    """``fabric.no_backward_sync(model)``: FSDP2 holds the gradients of a micro-batch that does not end an optimizer
    step as ``accumulate_grads`` says (:func:`lightning_tp.parallel.fsdp.micro_batch_grads`). Lightning's own control
    skips every reduction, and after ``enabled=False`` leaves it switched off (its exit sets the flag to
    ``enabled``)."""

    def __init__(self, accumulate_grads: Literal["sharded", "unsharded"]) -> None:
        self.accumulate_grads = accumulate_grads

    @override
    def no_backward_sync(self, module: nn.Module, enabled: bool) -> AbstractContextManager:
        if not enabled:
            return nullcontext()
        return micro_batch_grads(module, accumulate_grads=self.accumulate_grads)


def _is_stateful(value: Any) -> bool:
    """An object ``fabric.save`` stores by its ``state_dict()`` (a scheduler, a data loader, ...), as Fabric does."""
    return callable(getattr(value, "state_dict", None)) and callable(getattr(value, "load_state_dict", None))


def _unused_parallelize_fn(module: nn.Module, mesh: Any) -> nn.Module:  # pragma: no cover
    raise AssertionError("TensorParallelStrategy.setup_module calls lightning_tp.parallelize")


def _parameter_names(module: nn.Module) -> dict[int, str]:
    """Each parameter's first name (a tied one has several)."""
    names: dict[int, str] = {}
    for name, parameter in module.named_parameters(remove_duplicate=False):
        names.setdefault(id(parameter), _unwrapped_name(name))
    return names


def _unwrapped_name(name: str) -> str:
    """A parameter's name without the wrapper torch's activation checkpointing inserts (FSDP2 inserts none)."""
    return name.replace("_checkpoint_wrapped_module.", "")


def _check_fresh(optimizer: Optimizer, names: dict[int, str]) -> None:
    """An optimizer given to ``fabric.setup`` is re-pointed at the sharded parameters: only one that has not stepped
    yet, over parameters of the model, can be (its state would be of the unsharded tensors)."""
    if optimizer.state:
        raise ValueError(
            f"{type(optimizer).__name__} has state already (it has stepped): sharding replaces its parameters. "
            "Create the optimizer fresh, or set up the model first (`model = fabric.setup_module(model)`) and create "
            "the optimizer on `model.parameters()`."
        )
    foreign = sum(1 for group in optimizer.param_groups for p in group["params"] if id(p) not in names)
    if foreign:
        raise ValueError(
            f"{type(optimizer).__name__} holds {foreign} parameter(s) that are not the model's; `fabric.setup(model, "
            "optimizer)` needs an optimizer over the model's parameters."
        )


def _split_state(state: Mapping[str, Any], *, action: str) -> tuple[str, nn.Module, dict[str, Optimizer]]:
    """The one model of a ``fabric.save``/``fabric.load`` state (by its key) and its optimizers (by theirs)."""
    # A module without parameters (a torchmetrics Metric) is stored by its state dict, like any stateful object.
    modules = {
        key: value
        for key, value in state.items()
        if isinstance(value, nn.Module) and any(True for _ in value.parameters())
    }
    if len(modules) != 1:
        raise ValueError(
            f"`fabric.{action}` with TensorParallelStrategy needs exactly one model in the state, got "
            f"{len(modules)} ({sorted(modules)}). Save several models to separate paths."
        )
    ((module_key, module),) = modules.items()
    optimizers = {key: value for key, value in state.items() if isinstance(value, Optimizer)}
    if MODEL_KEY in optimizers or (MODEL_KEY in state and module_key != MODEL_KEY):
        raise ValueError(
            f"The state key {MODEL_KEY!r} is where the checkpoint keeps the model's weights: name the other entry "
            "differently."
        )
    return module_key, module, optimizers


__all__ = ["FABRIC_KEY", "TensorParallelStrategy"]
