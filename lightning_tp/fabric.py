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
from contextlib import AbstractContextManager
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import torch
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.strategies import ModelParallelStrategy
from lightning.fabric.strategies.strategy import Strategy, _validate_keys_for_strict_loading
from lightning.fabric.utilities.distributed import (
    _all_gather_ddp_if_available,
    _distributed_is_initialized,
    _sync_ddp_if_available,
)
from lightning.fabric.utilities.types import ReduceOp, _Stateful
from torch import Tensor, nn
from torch.optim import Optimizer
from typing_extensions import override

from lightning_tp import remote
from lightning_tp.checkpoint import (
    META_FILENAME,
    MODEL_KEY,
    MODELS_KEY,
    check_checkpoint,
    clear_partial,
    frozen_parameter_names,
    index_reader,
    load_torch_file,
    match_model_state,
    partial_path,
    publish,
    run_on_main_and_share_failure,
    safe_load_planner,
    save_target_refusal,
    stored_entries,
    unpickling_guard,
)
from lightning_tp.discovery import describe_models
from lightning_tp.fsdp import BF16_NAMES
from lightning_tp.grad import clip_grad_norm_
from lightning_tp.layout import TP_AXIS, ParallelLayout
from lightning_tp.parallelize import ParallelOptions, parallelize
from lightning_tp.plan import check_style

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

#: meta.pt's entry naming which state keys of ``fabric.save`` hold the model and the optimizers.
FABRIC_KEY = "lightning_tp_fabric"
#: Arguments of the Trainer strategy that have no meaning in Fabric, and what to do instead.
_TRAINER_ONLY = {
    "throughput_monitor": "it adds a Trainer callback; in Fabric, measure in your loop (lightning.fabric.utilities."
    "throughput.ThroughputMonitor)",
    "preemption_signals": "it saves through the Trainer's loop; in Fabric, handle the signal in your loop and call "
    "`fabric.save`",
    "step_timeout": "it watches the Trainer's steps; in Fabric, `timeout` bounds every collective",
}
#: How to load a checkpoint that holds arbitrary objects, in the error that refuses it.
_LOAD_OPT_IN = "pass `weights_only=False` to `fabric.load`"


class TensorParallelStrategy(ModelParallelStrategy):
    """Tensor parallelism (and FSDP2 over the remaining ranks) for Transformers models in Lightning Fabric.

    ``fabric.setup(model, optimizer)`` / ``fabric.setup_module(model)`` shard the model with its own TP plan (or
    ``tp_plan``) through :func:`lightning_tp.parallelize`; an optimizer built before the setup is pointed at the
    sharded parameters. ``fabric.setup_dataloaders`` splits the data over the data-parallel ranks only (the ranks of a
    TP group read the same batches); ``fabric.all_reduce``/``all_gather`` default to the data-parallel group;
    ``fabric.clip_gradients`` computes the global norm exactly; ``fabric.save``/``fabric.load`` write and read the
    format of the Trainer strategy (a DCP directory that loads on any layout, published by rename once complete), which
    ``python -m lightning_tp.export`` reads.

    Args: as :class:`lightning_tp.TensorParallelStrategy` (the Trainer's), except ``throughput_monitor``,
    ``preemption_signals`` and ``step_timeout``, which are Trainer features: passing them raises a ``ValueError``
    saying what to use instead.
    """

    strategy_name = "tp"

    def __init__(
        self,
        tp_size: int | None = None,
        *,
        tp_plan: Literal["auto"] | dict[str, Any] = "auto",
        dp_shard_size: int | None = None,
        dp_replicate_size: int = 1,
        parallelism_config: Any | None = None,
        activation_checkpointing: bool = False,
        reshard_after_forward: bool = True,
        cpu_offload: bool = False,
        fsdp_blocks: list[str] | None = None,
        fsdp_param_dtype: Literal["bf16"] | None = None,
        sequence_parallel: bool = False,
        loss_parallel: bool = False,
        save_distributed_checkpoint: bool = True,
        save_frozen_weights: bool = True,
        process_group_backend: str | None = None,
        timeout: timedelta | None = default_pg_timeout,
        **trainer_only: Any,
    ) -> None:
        for name in trainer_only:
            if name in _TRAINER_ONLY:
                raise ValueError(
                    f"`{name}` is an argument of the Trainer's TensorParallelStrategy, not Fabric's: "
                    f"{_TRAINER_ONLY[name]}. Drop it."
                )
            raise TypeError(f"{type(self).__name__}.__init__() got an unexpected keyword argument {name!r}")
        super().__init__(
            parallelize_fn=_unused_parallelize_fn,
            save_distributed_checkpoint=save_distributed_checkpoint,
            process_group_backend=process_group_backend,
            timeout=timeout,
        )
        if parallelism_config is not None:
            from lightning_tp.strategy import _sizes_from_parallelism_config

            tp_size, dp_shard_size, dp_replicate_size = _sizes_from_parallelism_config(
                parallelism_config, tp_size=tp_size, dp_shard_size=dp_shard_size, dp_replicate_size=dp_replicate_size
            )
        # Checked here, without processes, so that a typo fails when the strategy is built.
        ParallelLayout.resolve(
            (tp_size or 1) * (dp_shard_size or 1) * dp_replicate_size,
            tp_size=tp_size,
            dp_shard_size=dp_shard_size,
            dp_replicate_size=dp_replicate_size,
        )
        if isinstance(tp_plan, Mapping):
            for key, style in tp_plan.items():
                check_style(key, style)
        elif tp_plan != "auto":
            raise ValueError(f'`tp_plan` must be "auto" or a dict of module path to style, got {tp_plan!r}.')
        if fsdp_param_dtype is not None and fsdp_param_dtype not in BF16_NAMES:
            raise ValueError(
                "`fsdp_param_dtype` must be None (gather parameters in their own dtype) or 'bf16' (gather bf16 copies, "
                f"reduce gradients in fp32), got {fsdp_param_dtype!r}."
            )
        if not save_frozen_weights and not save_distributed_checkpoint:
            raise ValueError(
                "`save_frozen_weights=False` needs `save_distributed_checkpoint=True`: a full checkpoint file is "
                "loaded weight by weight and must hold every weight."
            )
        self._tp_size = tp_size
        self._dp_shard_size = dp_shard_size
        self._dp_replicate_size = dp_replicate_size
        self._save_frozen_weights = save_frozen_weights
        # Everything but the precision, which Fabric's connector sets after construction.
        self._options = dict(
            tp_plan=tp_plan,
            sequence_parallel=sequence_parallel,
            loss_parallel=loss_parallel,
            activation_checkpointing=activation_checkpointing,
            reshard_after_forward=reshard_after_forward,
            cpu_offload=cpu_offload,
            fsdp_blocks=list(fsdp_blocks) if fsdp_blocks else None,
            fsdp_param_dtype=fsdp_param_dtype,
        )
        self._layout: ParallelLayout | None = None
        self._dp_mesh: DeviceMesh | None = None

    # ------------------------------------------------------------------ layout and mesh

    @property
    def layout(self) -> ParallelLayout:
        """The resolved sizes of the mesh axes (from ``fabric.launch()`` on)."""
        if self._layout is None:
            raise RuntimeError("The parallel layout is resolved in `fabric.launch()`, once the world size is known.")
        return self._layout

    @property
    @override
    def device_mesh(self) -> DeviceMesh:
        """The mesh with axes ``dp_replicate``, ``dp_shard``, ``tp``."""
        if self._device_mesh is None:
            raise RuntimeError("The device mesh is built in `fabric.launch()`, after the processes have started.")
        return self._device_mesh

    @property
    def tp_mesh(self) -> DeviceMesh:
        """The 1-D tensor-parallel sub-mesh of this rank."""
        return self.device_mesh[TP_AXIS]

    @property
    def dp_mesh(self) -> DeviceMesh:
        """The flattened 1-D data-parallel sub-mesh of this rank (``dp_replicate`` x ``dp_shard``)."""
        if self._dp_mesh is None:
            return self.device_mesh  # raises the clear error: nothing is built yet
        return self._dp_mesh

    @override
    def setup_environment(self) -> None:
        # The configuration is checked before the process group starts: a mistake raises on every rank alike.
        self._layout = ParallelLayout.resolve(
            self.world_size,
            tp_size=self._tp_size,
            dp_shard_size=self._dp_shard_size,
            dp_replicate_size=self._dp_replicate_size,
        )
        if self._options["cpu_offload"] and self.root_device.type == "cpu":
            raise ValueError(
                "`cpu_offload=True` moves FSDP2's shards from an accelerator to pinned host memory; on "
                f"`accelerator='cpu'` the model is in host memory already. Drop `cpu_offload` (device: "
                f"{self.root_device})."
            )
        if self._options["cpu_offload"] and self._layout.dp_size == 1:
            raise ValueError(
                f"`cpu_offload=True` is FSDP2's offload and needs data parallelism, but the layout ({self._layout}) "
                "has none. Use fewer TP ranks or drop `cpu_offload`."
            )
        Strategy.setup_environment(self)  # the accelerator's device; not ModelParallelStrategy's mesh
        from lightning_tp.strategy import _destroy_process_groups_at_exit

        owns_process_group = not _distributed_is_initialized()
        self._setup_distributed()
        if owns_process_group:
            _destroy_process_groups_at_exit()
        self._device_mesh, self._dp_mesh = self._layout.build_device_mesh(self.root_device.type, timeout=self._timeout)

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        # Every rank of a TP group must see the same batch: split the data over the data-parallel ranks only.
        return {"num_replicas": self.dp_mesh.size(), "rank": self.dp_mesh.get_local_rank()}

    # ------------------------------------------------------------------ sharding

    def parallel_options(self) -> ParallelOptions:
        """The options :func:`lightning_tp.parallelize` gets (Fabric's precision included)."""
        return ParallelOptions(**self._options, precision=str(getattr(self.precision, "precision", "32-true")))

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
        return parallelize(module, mesh=self.device_mesh, options=self.parallel_options(), device=self.root_device)

    @override
    def setup_module_and_optimizers(
        self, module: nn.Module, optimizers: list[Optimizer], scheduler: Any | None = None
    ) -> tuple[nn.Module, list[Optimizer], Any | None]:
        """``fabric.setup(model, optimizer)``: sharding replaces the parameters (DTensors, materialised meta tensors),
        so the optimizers, built on the originals, are pointed at their replacements by name."""
        names = _parameter_names(module)
        for optimizer in optimizers:
            _check_fresh(optimizer, names)
        module = self.setup_module(module)
        replacements = {_unwrapped_name(n): p for n, p in module.named_parameters(remove_duplicate=False)}
        for optimizer in optimizers:
            for group in optimizer.param_groups:
                group["params"] = [replacements[names[id(p)]] for p in group["params"]]
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
        if self._device_mesh is None or not _distributed_is_initialized():
            return group
        return self.dp_mesh.get_group()

    @override
    def all_reduce(self, tensor: Tensor, group: Any | None = None, reduce_op: ReduceOp | str | None = "mean") -> Tensor:
        """Over the data-parallel group by default (and for the world group, Fabric's default): the ranks of a TP group
        hold the same values, and a sum over the world would count each one ``tp_size`` times. Over every rank:
        ``torch.distributed.all_reduce``."""
        if isinstance(tensor, Tensor):
            return _sync_ddp_if_available(tensor, self._default_to_data_parallel(group), reduce_op)
        return tensor

    @override
    def all_gather(self, tensor: Tensor, group: Any | None = None, sync_grads: bool = False) -> Tensor:
        """Over the data-parallel group by default, as ``all_reduce``: one entry per data-parallel replica."""
        return _all_gather_ddp_if_available(tensor, group=self._default_to_data_parallel(group), sync_grads=sync_grads)

    @override
    def reduce_boolean_decision(self, decision: bool, all: bool = True) -> bool:
        """Over every rank (``all_reduce`` defaults to the data-parallel group; a decision is compared with the world
        size)."""
        flag = torch.tensor(int(decision), device=self.root_device)
        world = torch.distributed.group.WORLD if _distributed_is_initialized() else None
        flag = _sync_ddp_if_available(flag, world, reduce_op="sum")
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
        return clip_grad_norm_(parameters, max_norm, norm_type, error_if_nonfinite=error_if_nonfinite)

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
        """Save in the Trainer strategy's format: the model under ``state_dict``, each optimizer under its key, the
        rest (plain values, ``state_dict()`` of stateful objects) and what export needs in ``meta.pt``. Written to
        ``.NAME.partial`` and renamed to ``NAME`` once every rank has finished: a run killed during a save leaves the
        previous checkpoint whole."""
        if storage_options is not None:
            raise TypeError(f"`{type(self).__name__}.save_checkpoint` takes no `storage_options` (it writes with DCP).")
        if filter is not None:
            raise ValueError(f"`fabric.save(..., filter=...)` is not supported by {type(self).__name__}; drop it.")
        module_key, module, optimizers = _split_state(state, action="save")
        _refuse_url(path)
        # Rank 0 decides whether the path may be replaced (never what this package did not write); every rank learns
        # it in the broadcast of the path and raises the same error before anything is written.
        local = Path(path)
        refusal = save_target_refusal(local) if self.is_global_zero else None
        path, refusal = self.broadcast((str(path), refusal))
        if refusal is not None:
            raise refusal
        path = Path(path)
        from torch.distributed.checkpoint import save
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            get_model_state_dict,
            get_optimizer_state_dict,
        )

        options = StateDictOptions(
            full_state_dict=not self._save_distributed_checkpoint,
            cpu_offload=True,
            ignore_frozen_params=not self._save_frozen_weights,
        )
        tensors: dict[str, Any] = {MODEL_KEY: get_model_state_dict(module, options=options)}
        for key, optimizer in optimizers.items():
            tensors[key] = get_optimizer_state_dict(module, optimizer, options=options)
        metadata = {
            key: (value.state_dict() if isinstance(value, _Stateful) else value)
            for key, value in state.items()
            if key != module_key and key not in optimizers
        }
        metadata[MODELS_KEY] = describe_models(module)
        metadata[FABRIC_KEY] = {"model": module_key, "optimizers": list(optimizers)}
        staged = partial_path(path)
        run_on_main_and_share_failure(lambda: clear_partial(path), is_main=self.is_global_zero)
        if self._save_distributed_checkpoint:
            save(tensors, checkpoint_id=staged)  # every rank writes its shards; DCP shares failures itself
            run_on_main_and_share_failure(
                lambda: torch.save(metadata, staged / META_FILENAME), is_main=self.is_global_zero
            )
        else:
            run_on_main_and_share_failure(
                lambda: torch.save({**tensors, **metadata}, staged), is_main=self.is_global_zero
            )
        run_on_main_and_share_failure(lambda: publish(path), is_main=self.is_global_zero)

    @override
    def load_checkpoint(
        self,
        path: str | Path,
        state: nn.Module | Optimizer | dict[str, nn.Module | Optimizer | Any] | None = None,
        strict: bool = True,
        weights_only: bool | None = None,
    ) -> dict[str, Any]:
        """Load a checkpoint written on any layout (DCP reshards) into ``state``'s model and optimizers, after
        checking on every rank that it is whole and fits the model. Plain values the state asks for are set in it;
        the rest is returned. Only tensors and plain values are unpickled unless ``weights_only=False``."""
        weights_only = True if weights_only is None else weights_only
        if isinstance(state, nn.Module):
            # `fabric.load_raw(path, model)`: a plain state-dict file, Lightning's loader (rank by rank, into shards).
            return super().load_checkpoint(path, state, strict=strict, weights_only=weights_only)
        if not isinstance(state, dict) or not state:
            raise ValueError(
                f"{type(self).__name__} loads into a state dict holding the model: "
                "`fabric.load(path, {'model': model, 'optimizer': optimizer, ...})`."
            )
        module_key, module, optimizers = _split_state(state, action="load")
        _refuse_url(path)
        path = Path(self.broadcast(str(path)))
        check_checkpoint(path)  # on every rank, before any collective: every rank raises the same error
        if path.is_file():
            metadata = self._load_file(path, module, optimizers, strict=strict, weights_only=weights_only)
        else:
            metadata = self._load_directory(path, module, optimizers, strict=strict, weights_only=weights_only)
        metadata.pop(MODELS_KEY, None)
        metadata.pop(FABRIC_KEY, None)
        requested = [key for key in state if key != module_key and key not in optimizers]
        _validate_keys_for_strict_loading(requested, metadata.keys(), strict=strict)
        for key in requested:
            if key not in metadata:
                continue
            value = metadata.pop(key)
            if isinstance(state[key], _Stateful):
                state[key].load_state_dict(value)
            else:
                state[key] = value
        return metadata

    def _load_directory(
        self, path: Path, module: nn.Module, optimizers: dict[str, Optimizer], *, strict: bool, weights_only: bool
    ) -> dict[str, Any]:
        from torch.distributed.checkpoint import load
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            get_model_state_dict,
            get_optimizer_state_dict,
            set_optimizer_state_dict,
        )

        # Unpickled first, on every rank, before any collective: a refused meta.pt raises the same error everywhere.
        metadata = load_torch_file(path / META_FILENAME, weights_only=weights_only, opt_in=_LOAD_OPT_IN)
        reader = index_reader(path)  # never runs code from the index
        stored = stored_entries(path, reader=reader)
        planner = safe_load_planner(weights_only=weights_only, opt_in=_LOAD_OPT_IN)  # nor from the shard files
        template = get_model_state_dict(module)
        keys = match_model_state(
            template, stored, frozen=frozen_parameter_names(list(template), module), strict=strict, path=path
        )
        written = {key.split(".", 1)[0] for key in stored}
        missing = [key for key in optimizers if key not in written]
        if missing:
            raise ValueError(
                f"The checkpoint {path} holds no state for the optimizer(s) {missing}; it holds "
                f"{sorted(written - {MODEL_KEY})}. Load with the keys it was saved with."
            )
        model_state = {MODEL_KEY: {key: template[key] for key in keys}}
        load(model_state, checkpoint_id=path, storage_reader=reader, planner=planner)
        module.load_state_dict(model_state[MODEL_KEY], strict=False)  # completeness was checked above
        for key, optimizer in optimizers.items():
            optimizer_state = {key: get_optimizer_state_dict(module, optimizer)}
            load(optimizer_state, checkpoint_id=path, storage_reader=reader, planner=planner)
            set_optimizer_state_dict(
                module, optimizer, optim_state_dict=optimizer_state[key], options=StateDictOptions(cpu_offload=True)
            )
        return metadata

    def _load_file(
        self, path: Path, module: nn.Module, optimizers: dict[str, Optimizer], *, strict: bool, weights_only: bool
    ) -> dict[str, Any]:
        from lightning.fabric.strategies.model_parallel import _load_checkpoint

        # Lightning's loader of a full file (every rank memory-maps it; weights broadcast into the shards).
        state: dict[str, Any] = {MODEL_KEY: module, **optimizers}
        with unpickling_guard(path, weights_only=weights_only, opt_in=_LOAD_OPT_IN):
            return _load_checkpoint(path=path, state=state, strict=strict, weights_only=weights_only)

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: Any) -> None:
        strategy_registry.register(
            cls.strategy_name,
            cls,
            description="Tensor parallelism for Transformers models in Fabric (lightning_tp)",
            override=True,
        )


def _refuse_url(path: str | Path) -> None:
    if remote.is_url(path):
        raise ValueError(
            f"{path}: Fabric's TensorParallelStrategy saves and loads local paths (a shared file system across "
            "nodes); checkpoints at URLs are the Trainer strategy's for now."
        )


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
    modules = {key: value for key, value in state.items() if isinstance(value, nn.Module)}
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
