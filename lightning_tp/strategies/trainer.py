"""``TensorParallelStrategy``: Lightning's Trainer hooks, each delegating. The order in which the parallelisms are
applied is written once, in :func:`lightning_tp.parallelize.apply_parallelisms`; checkpoints are saved and loaded by
:mod:`lightning_tp.checkpoint.state`."""

from __future__ import annotations

from collections.abc import Generator, Sequence
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import torch
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.utilities.types import ReduceOp
from lightning.pytorch.core.optimizer import LightningOptimizer
from lightning.pytorch.strategies import ModelParallelStrategy
from lightning.pytorch.trainer.states import RunningStage, TrainerFn
from torch import Tensor
from torch.distributed.fsdp import FSDPModule
from torch.optim import Optimizer
from typing_extensions import override

from lightning_tp.checkpoint import state as checkpoint_io
from lightning_tp.checkpoint.aliases import optimizer_state_dict
from lightning_tp.checkpoint.format import MODEL_KEY, flat_optimizer_state
from lightning_tp.checkpoint.publish import refuse_waiting_saves
from lightning_tp.checkpoint.rng_state import set_rng_state
from lightning_tp.checkpoint.stage_files import full_model_state, full_optimizer_state
from lightning_tp.compat import (
    all_gather_ddp_if_available,
    distributed_is_initialized,
    forget_loader_position,
    model_checkpoint_dirs_from_file_urls,
    optimizers_to_device,
    set_device_mesh,
    set_sampler_epoch,
    sync_ddp_if_available,
)
from lightning_tp.options import document
from lightning_tp.parallel.fsdp import micro_batch_grads
from lightning_tp.parallel_options import SUPPORTED_PRECISIONS, ParallelOptions
from lightning_tp.parallelize import apply_parallelisms
from lightning_tp.runtime.garbage_collection import GarbageCollection
from lightning_tp.runtime.monitor import ExpertLoadMonitor, ThroughputMonitor
from lightning_tp.runtime.preemption import (
    DEFAULT_PREEMPTION_SIGNALS,
    PreemptionCheckpoint,
    resolve_signals,
    skip_unfinished_hpc_checkpoint,
)
from lightning_tp.runtime.watchdog import StepWatchdog
from lightning_tp.stages import place_on_device
from lightning_tp.state import parallel_state
from lightning_tp.strategies.inference import (
    check_eval_weights,
    check_even_batches,
    gather_for_inference,
    mark_synced_generate,
    release_after_inference,
    release_gathered,
)
from lightning_tp.strategies.shared import (
    MeshMixin,
    StrategyOptions,
    clip_with_dtensor_support,
    drop_data_position,
    reduce_metrics_over,
    resumes_in_the_next_epoch,
    step_timeout_seconds,
)

if TYPE_CHECKING:
    import lightning.pytorch as pl

#: How to load a checkpoint that holds arbitrary objects, in the error that refuses it.
_LOAD_OPT_IN = "pass `weights_only=False` to `trainer.fit`/`validate`/`test`/`predict` along with `ckpt_path`"


@document("trainer")
class TensorParallelStrategy(MeshMixin, ModelParallelStrategy):
    """Tensor-parallel training of Transformers models (and any ``nn.Module`` given a plan) in the Lightning Trainer.

    Each Transformers model in the LightningModule is sharded with its own TP plan (``config.base_model_tp_plan``
    plus class rules such as ``lm_head``) on the mesh axis ``tp``, after ``configure_model`` has run. The ranks left
    over form the data-parallel axes, sharded with FSDP2.

    Each argument is defined, with its meaning, in :data:`lightning_tp.options.OPTIONS`, from which ``Args:`` below is
    assembled.
    """

    strategy_name = "tp"
    _BUILT_IN = "`setup_environment` (reach it from `configure_model` on)"

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
        throughput_monitor: bool = True,
        eval_weights: Literal["sharded", "gathered"] = "sharded",
        gc_every_n_steps: int | None = 50,
        sequence_parallel: bool = False,
        loss_parallel: bool = False,
        save_distributed_checkpoint: bool = True,
        save_frozen_weights: bool = True,
        preemption_signals: Sequence[str | int] | None = DEFAULT_PREEMPTION_SIGNALS,
        step_timeout: timedelta | float | Literal["auto"] | None = "auto",
        process_group_backend: str | None = None,
        timeout: timedelta | None = default_pg_timeout,
    ) -> None:
        super().__init__(
            save_distributed_checkpoint=save_distributed_checkpoint,
            process_group_backend=process_group_backend,
            timeout=timeout,
        )
        # Checked here, without processes, so that a typo fails when the Trainer is built.
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
        self._throughput_monitor = throughput_monitor
        self._eval_weights = check_eval_weights(eval_weights)
        if gc_every_n_steps is not None:
            GarbageCollection(gc_every_n_steps)  # a bad value fails when the Trainer is built
        self._gc_every_n_steps = gc_every_n_steps
        self._preemption_signals = resolve_signals(preemption_signals)  # a bad name fails when the Trainer is built
        self._step_timeout, self._adaptive_step_timeout = step_timeout_seconds(step_timeout, timeout=timeout)
        self._rng_to_restore: list[dict[str, Any]] | None = None
        self._parallel: ParallelOptions | None = None  # the options with the Trainer's precision, from setup on

    # ------------------------------------------------------------------ layout and mesh

    @override
    def setup_environment(self) -> None:
        # Everything that can be wrong with the configuration is checked before the process group starts.
        precision = getattr(self.precision_plugin, "precision", None)
        if precision not in SUPPORTED_PRECISIONS:
            raise ValueError(
                f"TensorParallelStrategy does not support `Trainer(precision={precision!r})`. Choose one of "
                f"{', '.join(SUPPORTED_PRECISIONS)} (for 16-bit mixed precision use 'bf16-mixed': fp16 loss scaling is "
                "not implemented for sharded gradients)."
            )
        self._parallel = ParallelOptions(**{**vars(self.options.parallel), "precision": precision})
        layout = self.options.layout(self.world_size)
        self._parallel.check_layout(layout, device=self.root_device)
        self._start_processes_and_mesh(layout)
        # Users can read the mesh in `LightningModule.configure_model()`.
        assert self.lightning_module is not None
        set_device_mesh(self.lightning_module, self._device_mesh)
        # Before the callbacks' setup: `ModelCheckpoint(dirpath="file:///abs/dir")` saves in /abs/dir.
        model_checkpoint_dirs_from_file_urls(self.lightning_module.trainer.callbacks)

    # ------------------------------------------------------------------ applying the parallelism

    @override
    def setup(self, trainer: pl.Trainer) -> None:
        assert self.model is not None and self.accelerator is not None and self._parallel is not None
        self.accelerator.setup(trainer)
        apply_parallelisms(
            self.model,
            mesh=self.device_mesh,
            layout=self.layout,
            options=self._parallel,
            device=self.root_device,
            expert_mesh=self.expert_mesh,
            convert_module=self.precision_plugin.convert_module,
        )
        reduce_metrics_over(self.model, self.dp_mesh.get_group())
        self.barrier()
        if trainer.state.fn == TrainerFn.FITTING:
            self.setup_optimizers(trainer)
            self._add_callbacks(trainer)
        self.setup_precision_plugin()
        clip_with_dtensor_support(self.precision_plugin, pp_group=self.pp_group, state=parallel_state(self.model))
        if trainer.state.fn == TrainerFn.FITTING:
            optimizers_to_device(self.optimizers, self.root_device)
        # `generate` keeps the data-parallel ranks in step on FSDP2 models; with `eval_weights="gathered"`,
        # validate, test and predict gather the weights once instead (here, on every rank, before a rank with no
        # batch at all skips the loop's hooks).
        mark_synced_generate(self.model, True)
        if trainer.state.fn != TrainerFn.FITTING:
            self._gather_for_inference()

    def _add_callbacks(self, trainer: pl.Trainer) -> None:
        """The throughput monitor, garbage collection, preemption checkpoint and watchdog asked for, unless the user
        added their own."""
        wanted: list[tuple[type, Any]] = []
        if self._throughput_monitor:
            wanted.append((ThroughputMonitor, ThroughputMonitor))
            if self.layout.ep_size > 1:
                wanted.append((ExpertLoadMonitor, ExpertLoadMonitor))
        if self._gc_every_n_steps is not None:
            wanted.append((GarbageCollection, lambda: GarbageCollection(self._gc_every_n_steps)))
        if self._preemption_signals:
            wanted.append((PreemptionCheckpoint, lambda: PreemptionCheckpoint(self._preemption_signals)))
        if self._step_timeout is not None:
            adaptive = self._adaptive_step_timeout
            wanted.append((StepWatchdog, lambda: StepWatchdog(self._step_timeout, adaptive=adaptive)))
        for kind, build in wanted:
            if not any(isinstance(c, kind) for c in trainer.callbacks):
                trainer.callbacks.append(build())

    @override
    def model_to_device(self) -> None:
        assert self.model is not None
        place_on_device(self.model, self.root_device, cpu_offload=self.options.parallel.cpu_offload)

    @contextmanager
    @override
    def block_backward_sync(self) -> Generator[None, None, None]:
        """While Lightning accumulates gradients: FSDP2 reduce-scatters each micro-batch's and defers only HSDP's
        all-reduce (``accumulate_grads="sharded"``), or keeps them whole until the last micro-batch
        (``"unsharded"``); see :data:`lightning_tp.parallel.fsdp.ACCUMULATE_GRADS`."""
        if self.model is None:
            yield
            return
        with micro_batch_grads(self.model, accumulate_grads=self.options.accumulate_grads):
            yield

    # ------------------------------------------------------------------ evaluation and prediction

    _inference_modules: list[FSDPModule] | None = None  # FSDP2 modules whose weights are gathered for inference

    def _gather_for_inference(self) -> None:
        """With ``eval_weights="gathered"``: gather the FSDP2 weights once for a validate/test/predict loop, so that
        data-parallel ranks can run unequal numbers of forwards; see :mod:`lightning_tp.strategies.inference`."""
        if self._eval_weights == "gathered" and self._inference_modules is None and self.model is not None:
            self._inference_modules = gather_for_inference(self.model)

    def _after_evaluation_step(self) -> None:
        """With sharded weights: free what FSDP2 keeps gathered after a forward for the backward that evaluation never
        runs (a rank holds its share between steps, as in training)."""
        if self._inference_modules is None and self.model is not None:
            release_gathered(self.model)

    @override
    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        output = super().validation_step(*args, **kwargs)
        self._after_evaluation_step()
        return output

    @override
    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        output = super().test_step(*args, **kwargs)
        self._after_evaluation_step()
        return output

    @override
    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        output = super().predict_step(*args, **kwargs)
        self._after_evaluation_step()
        return output

    def _release_after_inference(self) -> None:
        if self._inference_modules is not None and self.model is not None:
            release_after_inference(
                self.model, self._inference_modules, reshard_after_forward=self.options.parallel.reshard_after_forward
            )
        self._inference_modules = None

    @override
    def on_validation_start(self) -> None:
        self._gather_for_inference()

    @override
    def on_test_start(self) -> None:
        self._gather_for_inference()

    @override
    def on_predict_start(self) -> None:
        self._gather_for_inference()

    @override
    def on_validation_end(self) -> None:
        self._release_after_inference()

    @override
    def on_test_end(self) -> None:
        self._release_after_inference()

    @override
    def on_predict_end(self) -> None:
        self._release_after_inference()

    @override
    def barrier(self, name: str | None = None) -> None:
        refuse_waiting_saves(f"the strategy's barrier ({name})" if name else "the strategy's barrier")
        super().barrier(name)

    @override
    def teardown(self) -> None:
        # The process groups stay: the sharded model still uses them after `fit` (`save_pretrained`, `generate`);
        # they are destroyed at exit (see `destroy_process_groups_at_exit`).
        self._release_after_inference()
        super().teardown()

    # ------------------------------------------------------------------ checkpoints

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        assert self.model is not None
        if not self._save_distributed_checkpoint and self.layout.pp_size > 1:  # one file from every stage
            return full_model_state(self.model, ignore_frozen=not self.options.save_frozen_weights)
        options = StateDictOptions(
            full_state_dict=not self._save_distributed_checkpoint,
            cpu_offload=True,
            ignore_frozen_params=not self.options.save_frozen_weights,
        )
        return get_model_state_dict(self.model, options=options)

    @override
    def optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        """Lightning's; in a distributed checkpoint, flat under pipeline parallelism (see
        :func:`lightning_tp.checkpoint.format.flat_optimizer_state`) and a tied weight's state under its canonical
        name (:mod:`lightning_tp.checkpoint.aliases`)."""
        if not self._save_distributed_checkpoint and self.layout.pp_size == 1:
            return super().optimizer_state(optimizer)
        from torch.distributed.checkpoint.state_dict import StateDictOptions

        assert self.model is not None
        if isinstance(optimizer, LightningOptimizer):
            optimizer = optimizer.optimizer
        if not self._save_distributed_checkpoint:  # one file from every stage, keyed as Lightning's Trainer keys it
            return full_optimizer_state(self.model, optimizer, by_position=True)
        options = StateDictOptions(
            cpu_offload=True, flatten_optimizer_state_dict=flat_optimizer_state(self.layout.pp_size)
        )
        return optimizer_state_dict(self.model, optimizer, options=options)

    @override
    def save_checkpoint(
        self, checkpoint: dict[str, Any], filepath: str | Path, storage_options: Any | None = None
    ) -> None:
        """Crash-safe, checked and resharding: see :func:`lightning_tp.checkpoint.state.save_checkpoint`."""
        if storage_options is not None:
            raise TypeError(f"`{type(self).__name__}.save_checkpoint` takes no `storage_options` (it writes with DCP).")
        if not self._save_distributed_checkpoint:
            from lightning.pytorch.plugins.io import AsyncCheckpointIO

            if isinstance(self.checkpoint_io, AsyncCheckpointIO):
                raise ValueError(
                    "`AsyncCheckpointIO` returns before the file is written, so the checkpoint cannot be moved into "
                    "place once complete. Drop it, or keep `save_distributed_checkpoint=True`."
                )
        optimizer_states = checkpoint.pop("optimizer_states", []) if self._save_distributed_checkpoint else []
        for idx, optimizer_state in enumerate(optimizer_states):
            checkpoint[f"optimizer_{idx}"] = optimizer_state
        checkpoint_io.save_checkpoint(
            checkpoint,
            filepath,
            tensor_keys=[MODEL_KEY, *(f"optimizer_{idx}" for idx in range(len(optimizer_states)))],
            root=self.lightning_module,
            layout=self._layout,
            distributed=self._save_distributed_checkpoint,
            write_file=self.checkpoint_io.save_checkpoint,
        )

    @override
    def remove_checkpoint(self, filepath: str | Path) -> None:
        """``ModelCheckpoint`` removes only what a save of this package wrote (see
        :func:`lightning_tp.checkpoint.state.remove_checkpoint`)."""
        checkpoint_io.remove_checkpoint(filepath)

    @override
    def load_checkpoint(self, checkpoint_path: str | Path, weights_only: bool | None = None) -> dict[str, Any]:
        """Load a checkpoint written on any layout, after checking on every rank that it is whole.

        Only tensors and plain values are unpickled unless ``weights_only=False`` is passed (``trainer.fit(...,
        weights_only=False)``): a checkpoint is untrusted input, and unpickling other objects runs code it names."""
        weights_only = True if weights_only is None else weights_only  # Lightning passes None: never default to False
        checkpoint_path = skip_unfinished_hpc_checkpoint(checkpoint_path)  # `ckpt_path="hpc"` may name a killed save
        metadata = checkpoint_io.load_checkpoint(
            checkpoint_path,
            model=self.model,
            modules={MODEL_KEY: self.model},
            optimizers={f"optimizer_{idx}": optimizer for idx, optimizer in enumerate(self.optimizers)},
            weights_only=weights_only,
            strict=getattr(self.lightning_module, "strict_loading", True),
            opt_in=_LOAD_OPT_IN,
            optimizer_states_from_list=True,
        )
        assert self.model is not None and self.lightning_module is not None
        fitting = self.lightning_module.trainer.state.fn == TrainerFn.FITTING
        self._rng_to_restore, saved_dp_size = checkpoint_io.pop_rng_entry(metadata, layout=self.layout, restore=fitting)
        if saved_dp_size is not None:
            drop_data_position(metadata, saved_dp_size=saved_dp_size, dp_size=self.layout.dp_size)
        if self._inference_modules is not None:
            # validate/test/predict load after setup, and the load's state-dict hooks reshard what setup gathered.
            self._inference_modules = gather_for_inference(self.model)
        return metadata

    @override
    def process_dataloader(self, dataloader: object) -> object:
        # Lightning 2.6 builds the training data iterator of a resumed run before it sets the sampler's epoch, so a
        # run resumed mid-epoch would replay epoch 0's order (torchdata's `StatefulDataLoader` then skips the batches
        # already seen, of the wrong order). Set the epoch first: the one in progress, or the next one where the
        # checkpoint was written after the last batch of its epoch (that epoch then starts at its first batch).
        trainer = self.lightning_module.trainer if self.lightning_module is not None else None
        fitting = trainer is not None and trainer.state.fn == TrainerFn.FITTING
        if fitting and trainer.training and trainer.fit_loop.restarting:  # the training loaders, not validation's
            next_epoch = resumes_in_the_next_epoch(trainer)
            set_sampler_epoch(dataloader, trainer.fit_loop.epoch_progress.current.processed + int(next_epoch))
            if next_epoch:
                forget_loader_position(trainer)
                if self._rng_to_restore is not None:
                    # The run that saved built the next epoch's iterator after saving, drawing its base seed from
                    # the global generator: restore the random states before this run builds it.
                    set_rng_state(self._rng_to_restore[self.global_rank])
                    self._rng_to_restore = None
        dataloader = super().process_dataloader(dataloader)
        if trainer is not None and self.model is not None and self._eval_weights == "sharded":
            stage = trainer.state.stage
            loop = {
                RunningStage.SANITY_CHECKING: "validation",
                RunningStage.VALIDATING: "validation",
                RunningStage.TESTING: "test",
                RunningStage.PREDICTING: "predict",
            }.get(stage)
            if loop is not None:  # every rank, for every loader, also where the loop then has no batch for it
                limit = getattr(trainer, f"limit_{'val' if loop == 'validation' else loop}_batches")
                sanity = stage == RunningStage.SANITY_CHECKING and trainer.num_sanity_val_steps >= 0
                cap = trainer.num_sanity_val_steps if sanity else None  # sanity checking: at most this many
                check_even_batches(self.model, dataloader, loop=loop, limit=limit, cap=cap)
        return dataloader

    @override
    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        # Random states are restored here, not at load: between the load and the first step Lightning builds the data
        # iterator, which draws its base seed from the global generator; the uninterrupted run had drawn it before
        # it saved mid-epoch.
        if self._rng_to_restore is not None:
            set_rng_state(self._rng_to_restore[self.global_rank])
            self._rng_to_restore = None
        super().on_train_batch_start(batch, batch_idx)

    # ------------------------------------------------------------------ collectives seen by the LightningModule

    @override
    def reduce(
        self,
        tensor: Tensor | Any,
        group: Any | None = None,
        reduce_op: ReduceOp | str | None = "mean",
    ) -> Tensor:
        """Reduce over the data-parallel group by default: the ranks of a TP group hold the same values, and a sum over
        the world would count each one ``tp_size`` times."""
        if isinstance(tensor, Tensor):
            return sync_ddp_if_available(tensor, group if group is not None else self._data_parallel_group(), reduce_op)
        return tensor

    @override
    def all_gather(self, tensor: Tensor, group: Any | None = None, sync_grads: bool = False) -> Tensor:
        """Gather over the data-parallel group by default (one entry per data-parallel replica)."""
        group = group if group is not None else self._data_parallel_group()
        return all_gather_ddp_if_available(tensor, group=group, sync_grads=sync_grads)

    @override
    def reduce_boolean_decision(self, decision: bool, all: bool = True) -> bool:
        """Over every rank (``reduce`` defaults to the data-parallel group, but a decision is compared with the world
        size): ``ModelCheckpoint`` and early stopping rely on it."""
        flag = torch.tensor(int(decision), device=self.root_device)
        world = torch.distributed.group.WORLD if distributed_is_initialized() else None
        flag = self.reduce(flag, group=world, reduce_op="sum")
        return bool(flag == self.world_size) if all else bool(flag > 0)

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: Any) -> None:
        strategy_registry.register(
            cls.strategy_name,
            cls,
            description="Tensor parallelism for Transformers models (lightning_tp)",
            override=True,
        )


__all__ = ["SUPPORTED_PRECISIONS", "TensorParallelStrategy"]
