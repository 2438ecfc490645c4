"""``TensorParallelStrategy``: the Lightning hooks. Each technique lives in its own module; this file decides the
order in which they run and why."""

from __future__ import annotations

import atexit
import gc
import io
import tempfile
import types
from collections.abc import Generator, Mapping, Sequence
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import torch
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.utilities.data import _set_sampler_epoch
from lightning.fabric.utilities.distributed import (
    _all_gather_ddp_if_available,
    _distributed_is_initialized,
    _sync_ddp_if_available,
)
from lightning.fabric.utilities.optimizer import _optimizers_to_device
from lightning.fabric.utilities.types import ReduceOp
from lightning.pytorch.strategies import ModelParallelStrategy
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from torch import Tensor, nn
from torch.distributed.fsdp import FSDPModule
from typing_extensions import override

from lightning_tp import remote
from lightning_tp.checkpoint import (
    META_FILENAME,
    MODELS_KEY,
    RNG_KEY,
    IncompleteCheckpointError,
    UntrustedCheckpointError,
    check_checkpoint,
    clear_partial,
    frozen_parameter_names,
    gather_rng_states,
    index_reader,
    install_distributed_save_pretrained,
    load_torch_file,
    match_model_state,
    partial_path,
    publish,
    remove_written,
    run_on_main_and_share_failure,
    safe_load_planner,
    save_target_refusal,
    set_rng_state,
    stored_entries,
    unpickling_guard,
)
from lightning_tp.discovery import describe_models, modules_outside, transformers_models
from lightning_tp.fsdp import (
    BF16_NAMES,
    apply_fsdp,
    apply_fsdp_per_child,
    block_classes,
    fsdp_mixed_precision,
    fsdp_units,
)
from lightning_tp.grad import clip_grad_norm_
from lightning_tp.inference import gather_for_inference, mark_synced_generate, release_after_inference
from lightning_tp.layout import DP_REPLICATE_AXIS, DP_SHARD_AXIS, TP_AXIS, ParallelLayout
from lightning_tp.loading import materialize, materialize_modules
from lightning_tp.lora import (
    check_peft_supported,
    extend_plan_to_adapters,
    has_peft,
    initialize_adapters,
    install_distributed_save,
    peft_models,
)
from lightning_tp.loss_parallel import install_loss_parallel
from lightning_tp.monitor import ThroughputMonitor
from lightning_tp.plan import ResolvedPlan, check_style, is_transformers_model, resolve_plan
from lightning_tp.preemption import (
    DEFAULT_PREEMPTION_SIGNALS,
    PreemptionCheckpoint,
    resolve_signals,
    skip_unfinished_hpc_checkpoint,
)
from lightning_tp.random_init import random_state_of_rank_zero
from lightning_tp.sequence_parallel import rewrite_plan
from lightning_tp.tensor_parallel import (
    SHARDED_MARKER,
    adopt_transformers_sharding,
    apply_tensor_parallel,
    is_sharded,
    on_meta,
    replicate_unsharded_parameters,
    take_rank_zero_values,
    transformers_tp_mesh,
)
from lightning_tp.watchdog import StepWatchdog, resolve_step_timeout

if TYPE_CHECKING:
    import lightning.pytorch as pl
    from torch.distributed.device_mesh import DeviceMesh

#: Precisions whose parameters and gradients this strategy keeps exact under TP.
SUPPORTED_PRECISIONS = ("32-true", "bf16-mixed", "bf16-true", "16-true")


#: The errors rank 0's look at a URL raises again on every rank by their own type (others become ``OSError``).
_SHARED_ERRORS = (IncompleteCheckpointError, UntrustedCheckpointError, FileNotFoundError, ValueError)
#: How to load a checkpoint that holds arbitrary objects, in the error that refuses it.
_LOAD_OPT_IN = "pass `weights_only=False` to `trainer.fit`/`validate`/`test`/`predict` along with `ckpt_path`"


class TensorParallelStrategy(ModelParallelStrategy):
    """Tensor-parallel training of Transformers models (and any ``nn.Module`` given a plan) in the Lightning Trainer.

    Each Transformers model in the LightningModule is sharded with its own TP plan (``config.base_model_tp_plan``
    plus class rules such as ``lm_head``) on the mesh axis ``tp``, after ``configure_model`` has run. The ranks left
    over form the data-parallel axes, sharded with FSDP2.

    Args:
        tp_size: Ranks per tensor-parallel group. ``None`` takes every rank the data-parallel sizes leave.
        tp_plan: ``"auto"`` (each Transformers model's own plan), or a dict of overrides in
            ``DistributedConfig.tp_plan`` form (``{"model.layers.*.mlp.down_proj": "rowwise"}``, paths relative to
            the Transformers model), or for a module that is not a Transformers model, a dict of path (relative to
            the LightningModule) to a style name or a torch ``ParallelStyle``.
        dp_shard_size: Ranks per FSDP2 shard group. ``None`` takes what ``tp_size`` and ``dp_replicate_size`` leave.
        dp_replicate_size: Number of replicas of the FSDP2 groups (HSDP: shard within a group, e.g. a node, and
            replicate across groups).
        parallelism_config: An ``accelerate.ParallelismConfig`` to take ``tp_size``, ``dp_shard_size`` and
            ``dp_replicate_size`` from, instead of passing them.
        activation_checkpointing: Recompute each decoder layer's activations in backward (Transformers' own
            activation checkpointing), trading compute for memory.
        reshard_after_forward: FSDP2 frees each block's gathered parameters after its forward (less memory, one more
            all-gather in backward).
        cpu_offload: FSDP2 keeps sharded parameters, gradients and optimizer states in CPU memory.
        fsdp_blocks: Class names of the blocks FSDP2 shards one by one (default: each model's ``_no_split_modules``).
        fsdp_param_dtype: ``None`` (default): FSDP2 gathers parameters in their own dtype, so ``bf16-mixed`` gives
            the numerics it gives on one device (autocast over fp32 weights) on every layout. ``"bf16"``, with
            ``bf16-mixed`` and data parallelism only: FSDP2 all-gathers bf16 copies of the fp32 parameters (half the
            all-gather bytes) and reduces gradients in fp32 (torchtitan's recipe); every layer then runs on bf16
            weights, and the loss drifts further from fp32 than one device's ``bf16-mixed`` does.
        throughput_monitor: Add :class:`lightning_tp.ThroughputMonitor` (tokens/s, step time, peak memory, MFU on
            GPU) to the Trainer's callbacks when it has none.
        save_distributed_checkpoint: Each rank writes its shards (``True``, a directory that loads on any layout) or
            rank 0 writes one full file. Either way the checkpoint is written under a hidden temporary name and
            renamed into place once complete.
        sequence_parallel: Split the activations between the TP regions (norms, residuals) on the sequence dim:
            all-gathers and reduce-scatters instead of all-reduces, 1/tp of their memory. Sequence lengths must be
            divisible by ``tp_size``. Transformers decoder models with column-/row-wise plans.
        loss_parallel: Keep the ``lm_head`` output sharded on the vocabulary and compute the cross-entropy of
            ``model(..., labels=...)`` on the shards: no rank holds the full logits. ``outputs.logits`` is then a
            DTensor when ``labels`` are passed (``.full_tensor()`` gathers it).
        save_frozen_weights: Write parameters that do not train (the base model of a LoRA run) into checkpoints.
            ``False`` keeps checkpoints to the trained weights; on resume the frozen ones come from where
            ``configure_model`` loaded them.
        preemption_signals: Signals that announce a preemption (names such as ``"SIGTERM"``). On one, every rank
            finishes its optimizer step, all save ``hpc_ckpt_N`` in ``default_root_dir`` (``ckpt_path="hpc"``
            resumes from it) and the run ends with exit code ``128 + signal``; on SLURM the requeue signal also
            requeues the job. Replaces Lightning's handlers for these signals. ``None`` turns this off.
        step_timeout: A rank that makes no training progress (no batch starting or ending, no save) for this long
            dumps every thread's stack and exits, so that the launcher ends the job instead of its peers waiting in
            a collective. ``"auto"``: a step may take 10 times the slowest step so far, at least 45 s, once the first
            two are behind; anything else (the first steps, validation, saves, epoch ends) twice ``timeout``. A number:
            that limit for everything. ``None``: no watchdog.
        process_group_backend: ``"nccl"``, ``"gloo"``, ...; by default chosen from the device.
        timeout: Timeout of collective operations.
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
        throughput_monitor: bool = True,
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
        if parallelism_config is not None:
            tp_size, dp_shard_size, dp_replicate_size = _sizes_from_parallelism_config(
                parallelism_config, tp_size=tp_size, dp_shard_size=dp_shard_size, dp_replicate_size=dp_replicate_size
            )
        # Checked here, without processes, so that a typo fails when the Trainer is built.
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
                f"reduce gradients in fp32), got {fsdp_param_dtype!r}. fp16 would need loss scaling, which sharded "
                "gradients do not have."
            )
        if not save_frozen_weights and not save_distributed_checkpoint:
            raise ValueError(
                "`save_frozen_weights=False` needs `save_distributed_checkpoint=True`: a full checkpoint file is "
                "loaded weight by weight and must hold every weight."
            )
        self._tp_size = tp_size
        self._tp_plan = tp_plan
        self._dp_shard_size = dp_shard_size
        self._dp_replicate_size = dp_replicate_size
        self._fsdp_blocks = list(fsdp_blocks) if fsdp_blocks else None
        self._activation_checkpointing = activation_checkpointing
        self._reshard_after_forward = reshard_after_forward
        self._cpu_offload = cpu_offload
        self._fsdp_param_dtype = fsdp_param_dtype
        self._throughput_monitor = throughput_monitor
        self._save_frozen_weights = save_frozen_weights
        self._preemption_signals = resolve_signals(preemption_signals)  # a bad name fails when the Trainer is built
        # "auto": learn the step time (see `StepWatchdog`); outside steps, twice the collectives' timeout, since a
        # collective waiting longer than that fails anyway.
        self._adaptive_step_timeout = step_timeout == "auto"
        if step_timeout == "auto":
            step_timeout = 2 * (timeout or default_pg_timeout)
        self._step_timeout = resolve_step_timeout(step_timeout)
        self._sequence_parallel = sequence_parallel
        self._loss_parallel = loss_parallel
        self._rng_to_restore: list[dict[str, Any]] | None = None
        self._layout: ParallelLayout | None = None
        self._dp_mesh: DeviceMesh | None = None

    # ------------------------------------------------------------------ layout and mesh

    @property
    def layout(self) -> ParallelLayout:
        """The resolved sizes of the mesh axes (available from ``setup_environment`` on)."""
        if self._layout is None:
            raise RuntimeError(
                "The parallel layout is resolved in `setup_environment`, once the world size is known: access "
                "`strategy.layout` from `configure_model` or later."
            )
        return self._layout

    @property
    @override
    def device_mesh(self) -> DeviceMesh:
        """The mesh with axes ``dp_replicate``, ``dp_shard``, ``tp`` (and flattened ``dp``)."""
        if self._device_mesh is None:
            raise RuntimeError(
                "The device mesh is built in `setup_environment`, after the processes have started: access "
                "`strategy.device_mesh` (or `self.device_mesh` in the LightningModule) in `configure_model` or later."
            )
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
        # Everything that can be wrong with the configuration is checked before the process group starts.
        self._check_precision()
        self._layout = ParallelLayout.resolve(
            self.world_size,
            tp_size=self._tp_size,
            dp_shard_size=self._dp_shard_size,
            dp_replicate_size=self._dp_replicate_size,
        )
        if self._cpu_offload and self.root_device.type == "cpu":
            raise ValueError(
                "`cpu_offload=True` moves FSDP2's shards from an accelerator to pinned host memory; on "
                f"`accelerator='cpu'` the model is in host memory already. Drop `cpu_offload` (device: "
                f"{self.root_device})."
            )
        if self._cpu_offload and self._layout.dp_size == 1:
            raise ValueError(
                "`cpu_offload=True` is FSDP2's offload and needs data parallelism, but the layout "
                f"({self._layout}) has none. Use fewer TP ranks (`tp_size` below the world size) or drop "
                "`cpu_offload`."
            )
        self._check_fsdp_param_dtype(self._layout)
        owns_process_group = not _distributed_is_initialized()
        self._setup_distributed()
        if owns_process_group:
            _destroy_process_groups_at_exit()
        self._device_mesh, self._dp_mesh = self._layout.build_device_mesh(self.root_device.type, timeout=self._timeout)
        # Users can read the mesh in `LightningModule.configure_model()`.
        assert self.lightning_module is not None
        self.lightning_module._device_mesh = self._device_mesh

    def _check_precision(self) -> None:
        precision = getattr(self.precision_plugin, "precision", None)
        if precision not in SUPPORTED_PRECISIONS:
            raise ValueError(
                f"TensorParallelStrategy does not support `Trainer(precision={precision!r})`. Choose one of "
                f"{', '.join(SUPPORTED_PRECISIONS)} (for 16-bit mixed precision use 'bf16-mixed': fp16 loss scaling is "
                "not implemented for sharded gradients)."
            )

    def _check_fsdp_param_dtype(self, layout: ParallelLayout) -> None:
        """``fsdp_param_dtype`` changes FSDP2's all-gathers under ``bf16-mixed``; decided on every rank from the
        configuration alone, before the process group starts."""
        if self._fsdp_param_dtype is None:
            return
        precision = getattr(self.precision_plugin, "precision", None)
        if precision in ("32-true", "16-true"):
            raise ValueError(
                f"`fsdp_param_dtype={self._fsdp_param_dtype!r}` gathers bf16 copies of the parameters for a bf16 "
                f"forward, but `Trainer(precision={precision!r})` asks for {precision.split('-')[0]}-bit compute. Use "
                "`precision='bf16-mixed'` with it, or drop `fsdp_param_dtype`."
            )
        if precision == "bf16-true":
            rank_zero_warn(
                f"`fsdp_param_dtype={self._fsdp_param_dtype!r}` is ignored under `precision='bf16-true'`: the "
                "parameters are bf16 already, and so are FSDP2's all-gathers."
            )
        elif layout.dp_size == 1:
            rank_zero_warn(
                f"`fsdp_param_dtype={self._fsdp_param_dtype!r}` is ignored: the layout ({layout}) has no data "
                "parallelism, so FSDP2 gathers nothing. `bf16-mixed` autocasts over fp32 weights as on one device."
            )

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        # Every rank of a TP group must see the same batch: split the data over the data-parallel ranks only.
        return {"num_replicas": self.dp_mesh.size(), "rank": self.dp_mesh.get_local_rank()}

    # ------------------------------------------------------------------ applying the parallelism

    @override
    def setup(self, trainer: pl.Trainer) -> None:
        assert self.model is not None
        assert self.accelerator is not None
        self.accelerator.setup(trainer)

        # 1. Resolve and check every plan before any weight moves or any collective runs: a bad plan raises the same
        #    error on every rank, where a rank failing mid-way would leave the others hanging in a collective.
        targets, extras = self._resolve_targets()
        # 2. The dtype of `*-true` precisions, before sharding: FSDP2 keeps the dtype it shards (on meta this is free).
        self.model = self.precision_plugin.convert_module(self.model)
        # 3. Every rank must hold the same weights before TP and FSDP2 each slice their own copy: one checksum
        #    all-gather over every rank, then rank 0's values of what differs (as torch's styles, `src_data_rank=0`).
        self._take_rank_zero_values([m for m, _, presharded in targets if presharded is None] + extras)
        # 4. Tensor parallelism on the `tp` axis, innermost, so its frequent collectives stay on the fastest links.
        #    A model Transformers sharded at load time keeps its shards and only gets the replicated DTensors; modules
        #    outside the models (a value head, say) are replicated over the TP group.
        for module, plan, presharded_mesh in targets:
            if presharded_mesh is None:
                apply_tensor_parallel(module, self.tp_mesh, plan, device=self.root_device)
                if self._loss_parallel:
                    install_loss_parallel(module)  # the logits stay vocabulary-sharded: the loss runs on the shards
            else:
                adopt_transformers_sharding(module, presharded_mesh, plan)
        for module in extras:
            if not on_meta(module):
                module.to(self.root_device)
            replicate_unsharded_parameters(module, self.tp_mesh)
            setattr(module, SHARDED_MARKER, self.tp_mesh)
        # 5. Activation checkpointing per decoder layer, after TP (the recomputed forward runs the TP layers) and
        #    before FSDP2 (whose hooks then wrap the checkpointed layer and gather its weights again for the recompute).
        if self._activation_checkpointing:
            self._apply_activation_checkpointing(targets)
        # 6. FSDP2 on the data-parallel axes, after TP: it shards the TP shards further (2-D), and must see the final
        #    DTensor parameters. HSDP when dp_replicate_size > 1.
        if self.layout.dp_size > 1:
            self._apply_fsdp([module for module, _, _ in targets], extras)
        # 7. Models built on the meta device are materialised only now, already sharded, and filled from their
        #    checkpoint slice by slice: no rank ever holds the whole model.
        #    With CPU offload, FSDP2 keeps the sharded parameters on the CPU.
        init_device = torch.device("cpu") if self._cpu_offload else self.root_device
        materialized = set()
        for module, plan, _ in targets:
            if on_meta(module) and is_transformers_model(module):
                materialize(module, init_device, tied=plan.tied)
                materialized.add(id(module))
        materialize_modules(self.model, init_device)
        for peft_model in peft_models(self.model):
            if id(peft_model.get_base_model()) in materialized:
                rank_zero_warn(
                    "LoRA adapters on a model built on the meta device are initialised fresh after sharding; an "
                    "adapter loaded with `PeftModel.from_pretrained` onto such a model is not kept. To continue "
                    "training a saved adapter, load the base with `AutoModelForCausalLM.from_pretrained`."
                )
                with random_state_of_rank_zero(init_device):  # every rank draws the same whole adapters
                    initialize_adapters(peft_model)  # PEFT's own initialisation, each rank keeping its slices
            install_distributed_save(peft_model)
        for module, _, presharded_mesh in targets:
            # A model Transformers sharded at load time saves itself on every rank (its own barrier included).
            if is_transformers_model(module) and presharded_mesh is None:
                install_distributed_save_pretrained(module)

        self.model_to_device()
        self._reduce_metrics_over_data_parallel_group()
        self.barrier()

        if trainer.state.fn == TrainerFn.FITTING:
            self.setup_optimizers(trainer)
            if self._throughput_monitor and not any(isinstance(c, ThroughputMonitor) for c in trainer.callbacks):
                trainer.callbacks.append(ThroughputMonitor())
            if self._preemption_signals and not any(isinstance(c, PreemptionCheckpoint) for c in trainer.callbacks):
                trainer.callbacks.append(PreemptionCheckpoint(self._preemption_signals))
            if self._step_timeout is not None and not any(isinstance(c, StepWatchdog) for c in trainer.callbacks):
                trainer.callbacks.append(StepWatchdog(self._step_timeout, adaptive=self._adaptive_step_timeout))
        self.setup_precision_plugin()
        self._clip_with_dtensor_support()
        if trainer.state.fn == TrainerFn.FITTING:
            _optimizers_to_device(self.optimizers, self.root_device)
        # `generate` keeps the data-parallel ranks in step on FSDP2 models; validate, test and predict gather the
        # weights once instead (here, on every rank, before a rank with no batch at all skips the loop's hooks).
        mark_synced_generate(self.model, True)
        if trainer.state.fn != TrainerFn.FITTING:
            self._gather_for_inference()

    def _take_rank_zero_values(self, modules: list[nn.Module]) -> None:
        """Ranks that built the model with different values (a seed per rank, say) train rank 0's values, as
        Lightning's ``ModelParallelStrategy`` does: the run equals one process initialised like rank 0."""
        for module in modules:
            taken = take_rank_zero_values(module)  # over WORLD: TP and data parallelism both need identical copies
            if taken:
                rank_zero_info(
                    f"{type(module).__name__}: {len(taken)} tensor(s) differed between ranks (first: {taken[0]!r}) and "
                    "were set to rank 0's values on every rank. Seed before building the model to silence this."
                )

    def _resolve_targets(self) -> tuple[list[tuple[nn.Module, ResolvedPlan, DeviceMesh | None]], list[nn.Module]]:
        """The models to shard, each with its resolved plan and, for a model Transformers sharded already, its TP
        mesh; and the other modules of the LightningModule that hold parameters. Modules this strategy handled in an
        earlier ``setup`` (fit, then validate) are left out."""
        root = self.lightning_module
        assert root is not None
        models = transformers_models(root)
        if not models:
            if self._tp_plan == "auto":
                raise ValueError(
                    f"{type(root).__name__} holds no Transformers `PreTrainedModel`, so there is no plan to apply. "
                    "Build the model in `configure_model` or `__init__`, or pass `tp_plan={'<module path>': "
                    "'colwise' | 'rowwise' | <ParallelStyle>}` (paths relative to the LightningModule)."
                )
            models = [root]
            if self.layout.dp_size > 1:
                fsdp_units(root)  # refuses children sharing a parameter, before any collective
        direct = [name for name, p in root._parameters.items() if p is not None and p.requires_grad]
        if direct:
            raise ValueError(
                f"{type(root).__name__} holds trainable parameters directly ({direct}); move them into a submodule "
                "(e.g. `self.head = nn.Linear(...)`) so the strategy can place them."
            )
        targets = []
        for module in models:
            if getattr(module, SHARDED_MARKER, None) is not None:
                self._check_sharded_size(module, getattr(module, SHARDED_MARKER))
                continue
            presharded_mesh = transformers_tp_mesh(module) if is_sharded(module) else None
            if presharded_mesh is not None:
                self._check_sharded_size(module, presharded_mesh)
                if self._tp_plan != "auto":
                    rank_zero_warn(
                        f"`tp_plan` overrides are ignored for {type(module).__name__}: Transformers sharded it at load "
                        "time with its own plan. Load it without `distributed_config` to apply them."
                    )
            plan = resolve_plan(
                module, "auto" if presharded_mesh is not None else self._tp_plan, tp_size=self.layout.tp_size
            )
            if has_peft(module):
                # PEFT was applied to the whole model (in `configure_model` or `__init__`): shard each adapter with
                # its base layer, and refuse what cannot be sharded, before anything moves.
                check_peft_supported(module)
                if presharded_mesh is not None:
                    raise ValueError(
                        f"{type(module).__name__} carries PEFT adapters but was sharded by Transformers at load time, "
                        "when the adapters did not exist yet. Load it without `distributed_config`."
                    )
                plan = extend_plan_to_adapters(module, plan)
            plan = self._rewrite_plan(module, plan, presharded=presharded_mesh is not None)
            targets.append((module, plan, presharded_mesh))
        extras = [
            m
            for m in modules_outside(root, models)
            if getattr(m, SHARDED_MARKER, None) is None and any(True for _ in m.parameters())
        ]
        if self._cpu_offload and extras:
            raise ValueError("`cpu_offload=True` supports parameters inside the Transformers models only.")
        return targets, extras

    def _rewrite_plan(self, module: nn.Module, plan: ResolvedPlan, *, presharded: bool) -> ResolvedPlan:
        """Dense decoder layers with one input DTensor per attention/MLP (2 backward all-reduces per layer instead of
        5), and the sequence/loss parallelism asked for. See :func:`lightning_tp.sequence_parallel.rewrite_plan`."""
        options = {"sequence_parallel": self._sequence_parallel, "loss_parallel": self._loss_parallel}
        asked = ", ".join(f"{k}=True" for k, v in options.items() if v)
        if not is_transformers_model(module) or presharded:
            if asked and not is_transformers_model(module):
                raise ValueError(f"{asked} applies to Transformers causal LMs; {type(module).__name__} is not one.")
            if asked:
                raise ValueError(
                    f"{asked} rewrites the plan, but {type(module).__name__} was sharded by Transformers at load "
                    "time. Load it without `distributed_config`."
                )
            return plan
        if self._sequence_parallel and has_peft(module):
            raise ValueError("sequence_parallel=True does not support PEFT adapters yet; drop one of them.")
        # Data-parallel ranks see different batches: with sequence parallelism they agree on the lengths over their
        # group before any of them raises (see `SequenceSplit`).
        agree_group = self.dp_mesh.get_group() if self._sequence_parallel and self.layout.dp_size > 1 else None
        return rewrite_plan(
            module,
            plan,
            **options,
            blocks=block_classes(module, self._fsdp_blocks),
            dense_layers=not has_peft(module),
            agree_group=agree_group,
        )

    def _check_sharded_size(self, module: nn.Module, mesh: DeviceMesh) -> None:
        """A model sharded before this setup must be sharded over exactly this rank's TP group."""
        ranks = sorted(mesh.mesh.flatten().tolist())
        expected = sorted(self.tp_mesh.mesh.flatten().tolist())
        if ranks != expected:
            raise ValueError(
                f"{type(module).__name__} is already tensor-parallel over ranks {ranks} (tp_size={len(ranks)}), but "
                f"this rank's TP group under the strategy is {expected} (tp_size={self.layout.tp_size}). Load it "
                "without `distributed_config`/`tp_plan` and let the strategy shard it, or use the same tp_size."
            )

    def _apply_activation_checkpointing(self, targets: list[tuple[nn.Module, ResolvedPlan, DeviceMesh | None]]) -> None:
        for module, _, _ in targets:
            if is_transformers_model(module) and getattr(module, "supports_gradient_checkpointing", False):
                module.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
            else:
                rank_zero_warn(
                    f"`activation_checkpointing=True` is ignored for {type(module).__name__}: it applies to "
                    "Transformers models that support it. Wrap your blocks with `torch.utils.checkpoint` instead."
                )

    def _apply_fsdp(self, models: list[nn.Module], extras: list[nn.Module]) -> None:
        """FSDP2 over each model (its blocks one by one, then the model), and over each module outside the models as
        one group, so that every trainable parameter has its gradients reduced over the data-parallel ranks. A
        LightningModule that is the model itself gets one group per child (see :func:`apply_fsdp_per_child`)."""
        # HSDP takes the 2-D (replicate, shard) mesh, even when the shard axis has one rank; FSDP the shard axis.
        if self.layout.dp_replicate_size > 1:
            dp_mesh = self.device_mesh[(DP_REPLICATE_AXIS, DP_SHARD_AXIS)]
        else:
            dp_mesh = self.device_mesh[DP_SHARD_AXIS]
        options = dict(
            reshard_after_forward=self._reshard_after_forward,
            mp_policy=fsdp_mixed_precision(
                getattr(self.precision_plugin, "precision", "32-true"), param_dtype=self._fsdp_param_dtype
            ),
            cpu_offload=self._cpu_offload,
        )
        for module in models:
            if module is self.lightning_module:
                # A plain module tree: `training_step` calls its children, never the LightningModule's forward.
                apply_fsdp_per_child(module, dp_mesh, fsdp_blocks=self._fsdp_blocks, **options)
            else:
                apply_fsdp(module, dp_mesh, blocks=block_classes(module, self._fsdp_blocks), **options)
        for module in extras:
            apply_fsdp(module, dp_mesh, blocks=set(), **options)

    def _reduce_metrics_over_data_parallel_group(self) -> None:
        """torchmetrics syncs over the world group by default, which counts each sample once per TP rank."""
        try:
            from torchmetrics import Metric
        except ImportError:  # pragma: no cover
            return
        group = self.dp_mesh.get_group()
        for module in self.lightning_module.modules():
            if isinstance(module, Metric) and module.process_group is None:
                module.process_group = group

    def _clip_with_dtensor_support(self) -> None:
        """Lightning clips with ``torch.nn.utils.clip_grad_norm_``, which fails on DTensor gradients across meshes;
        route the precision plugin's norm clipping to :func:`lightning_tp.clip_grad_norm_`, same arguments."""
        plugin = self.precision_plugin

        def clip_grad_by_norm(plugin_self: Any, optimizer: Any, clip_val: int | float) -> None:
            clip_grad_norm_(plugin_self.main_params(optimizer), clip_val)

        plugin.clip_grad_by_norm = types.MethodType(clip_grad_by_norm, plugin)  # type: ignore[method-assign]

    @override
    def reduce_boolean_decision(self, decision: bool, all: bool = True) -> bool:
        """Over every rank (``reduce`` defaults to the data-parallel group, but a decision is compared with the world
        size): ``ModelCheckpoint`` and early stopping rely on it."""
        flag = torch.tensor(int(decision), device=self.root_device)
        flag = self.reduce(
            flag, group=torch.distributed.group.WORLD if _distributed_is_initialized() else None, reduce_op="sum"
        )
        return bool(flag == self.world_size) if all else bool(flag > 0)

    # ------------------------------------------------------------------ evaluation and prediction

    _inference_modules: list[FSDPModule] | None = None  # FSDP2 modules whose weights are gathered for inference

    def _gather_for_inference(self) -> None:
        """Gather the FSDP2 weights once for a validate/test/predict loop, so that data-parallel ranks can run unequal
        numbers of forwards (uneven batches, ``generate`` of different lengths); see :mod:`lightning_tp.inference`."""
        if self._inference_modules is None and self.model is not None:
            self._inference_modules = gather_for_inference(self.model)

    def _release_after_inference(self) -> None:
        if self._inference_modules is not None and self.model is not None:
            release_after_inference(
                self.model, self._inference_modules, reshard_after_forward=self._reshard_after_forward
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
    def teardown(self) -> None:
        # The process groups stay: the sharded model still uses them after `fit` (`save_pretrained`, `generate`);
        # they are destroyed at exit (see `_destroy_process_groups_at_exit`).
        self._release_after_inference()
        super().teardown()

    # ------------------------------------------------------------------ checkpoints

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        options = StateDictOptions(
            full_state_dict=not self._save_distributed_checkpoint,
            cpu_offload=True,
            ignore_frozen_params=not self._save_frozen_weights,
        )
        assert self.model is not None
        return get_model_state_dict(self.model, options=options)

    @override
    def save_checkpoint(
        self, checkpoint: dict[str, Any], filepath: str | Path, storage_options: Any | None = None
    ) -> None:
        """Write to ``.NAME.partial`` and rename it to ``NAME`` once every rank has finished: a run killed during a
        save leaves the previous checkpoint whole. Adds every rank's random states and what export needs to rebuild
        a Transformers directory (configs, PEFT settings)."""
        if storage_options is not None:
            raise TypeError(f"`{type(self).__name__}.save_checkpoint` takes no `storage_options` (it writes with DCP).")
        from torch.distributed.checkpoint import save

        # Rank 0 decides whether a local path may be replaced (never what this package did not write) and every rank
        # learns it in the broadcast of the path: all raise the same error before anything is written, even where
        # the ranks' file systems differ. A URL's checkpoint is written by `_save_to_url`, which decides likewise.
        local = not remote.is_url(filepath)
        refusal = save_target_refusal(Path(filepath)) if self.is_global_zero and local else None
        filepath, refusal = self.broadcast((filepath, refusal))
        if refusal is not None:
            raise refusal
        path = Path(filepath)
        # Gathered on every rank (a collective), written by rank 0.
        checkpoint[RNG_KEY] = {
            "world_size": self.world_size,
            "dp_size": self.layout.dp_size,
            "layout": self._layout_sizes(),
            "states": gather_rng_states(),
        }
        checkpoint[MODELS_KEY] = describe_models(self.lightning_module)
        if not local:
            self._save_to_url(checkpoint, filepath)
            return
        staged = partial_path(path)
        # The rank-0 steps run through `run_on_main_and_share_failure`: a failure there raises on every rank, and
        # the exchange it ends with keeps the ranks in step (nobody writes into a stale staging directory).
        run_on_main_and_share_failure(lambda: clear_partial(path), is_main=self.is_global_zero)
        if self._save_distributed_checkpoint:
            tensors = {"state_dict": checkpoint.pop("state_dict")}
            for idx, optimizer_state in enumerate(checkpoint.pop("optimizer_states", [])):
                tensors[f"optimizer_{idx}"] = optimizer_state
            save(tensors, checkpoint_id=staged)  # every rank writes its shards; DCP shares failures itself
            run_on_main_and_share_failure(
                lambda: torch.save(checkpoint, staged / META_FILENAME), is_main=self.is_global_zero
            )
        else:
            from lightning.pytorch.plugins.io import AsyncCheckpointIO

            if isinstance(self.checkpoint_io, AsyncCheckpointIO):
                raise ValueError(
                    "`AsyncCheckpointIO` returns before the file is written, so the checkpoint cannot be renamed into "
                    "place once complete. Drop it, or keep `save_distributed_checkpoint=True`."
                )
            run_on_main_and_share_failure(
                lambda: self.checkpoint_io.save_checkpoint(checkpoint, staged), is_main=self.is_global_zero
            )
        run_on_main_and_share_failure(lambda: publish(path), is_main=self.is_global_zero)

    def _save_to_url(self, checkpoint: dict[str, Any], url: str) -> None:
        """A save to an fsspec URL: a fresh data directory committed by a marker written last, or one object moved
        into place (see :mod:`lightning_tp.remote`: object stores have no atomic rename)."""
        from torch.distributed.checkpoint import save

        # Rank 0 looks at what is there and names where the ranks write; every rank raises the same error.
        plan = self._decide_on_main(lambda: remote.plan_save(url, directory=self._save_distributed_checkpoint), url=url)
        if plan.get("error"):
            raise ValueError(plan["error"])
        data = plan["data"]
        if self._save_distributed_checkpoint:
            tensors = {"state_dict": checkpoint.pop("state_dict")}
            for idx, optimizer_state in enumerate(checkpoint.pop("optimizer_states", [])):
                tensors[f"optimizer_{idx}"] = optimizer_state
            save(tensors, storage_writer=remote.dcp_writer(data))  # every rank writes its shards
            run_on_main_and_share_failure(lambda: remote.write_meta(data, checkpoint), is_main=self.is_global_zero)
            run_on_main_and_share_failure(lambda: remote.commit(url, data), is_main=self.is_global_zero)
            return
        from lightning.pytorch.plugins.io import AsyncCheckpointIO

        if isinstance(self.checkpoint_io, AsyncCheckpointIO):
            raise ValueError(
                "`AsyncCheckpointIO` returns before the file is written, so the checkpoint cannot be moved into place "
                "once complete. Drop it, or keep `save_distributed_checkpoint=True`."
            )
        run_on_main_and_share_failure(
            lambda: self.checkpoint_io.save_checkpoint(checkpoint, data), is_main=self.is_global_zero
        )
        run_on_main_and_share_failure(lambda: remote.publish_file(data, url), is_main=self.is_global_zero)

    def _remove_url_checkpoint(self, filepath: str) -> None:
        if not self.is_global_zero:
            return
        try:
            kept = remote.remove_checkpoint(filepath)
        except Exception as err:  # no collective follows: rank 0 alone raising would leave the others waiting later
            rank_zero_warn(f"Removing the checkpoint {filepath} failed ({type(err).__name__}: {err}); training goes on")
            return
        for url in kept:
            rank_zero_warn(
                f"{url} was not removed: it is neither a torch.save archive nor a directory with a commit marker "
                f"({remote.COMMIT_MARKER}), so lightning_tp did not write it (or not completely)."
            )

    def _decide_on_main(self, decide: Any, *, url: str) -> Any:
        """``decide()`` on rank 0 (one look at the store, not one per rank), its result or its error on every rank: a
        failure on rank 0 alone must not leave the others in the next collective."""
        outcome: dict[str, Any] | None = None
        if self.is_global_zero:
            try:
                outcome = {"value": decide()}
            except _SHARED_ERRORS as err:
                outcome = {"error": type(err).__name__, "message": str(err)}
            except Exception as err:  # the store: permissions, network
                outcome = {"error": "OSError", "message": f"Accessing {url} failed: {type(err).__name__}: {err}"}
        outcome = self.broadcast(outcome)
        if "error" in outcome:
            kinds = {error.__name__: error for error in _SHARED_ERRORS}
            raise kinds.get(outcome["error"], OSError)(outcome["message"])
        return outcome["value"]

    @override
    def remove_checkpoint(self, filepath: str | Path) -> None:
        """``ModelCheckpoint`` removes the checkpoints it no longer keeps: only what a save of this package wrote is
        removed (a link, not its target; at a URL, what its commit marker lists); anything else there is kept, with
        a warning."""
        if remote.is_url(filepath):
            self._remove_url_checkpoint(filepath)
        elif self.is_global_zero:
            try:
                remove_written(Path(filepath))
            except FileExistsError as err:
                rank_zero_warn(f"{err} It is kept.")

    @override
    def load_checkpoint(self, checkpoint_path: str | Path, weights_only: bool | None = None) -> dict[str, Any]:
        """Load a checkpoint written on any layout (DCP reshards), after checking on every rank that it is whole.

        Only tensors and plain values are unpickled unless ``weights_only=False`` is passed (``trainer.fit(...,
        weights_only=False)``): a checkpoint is untrusted input, and unpickling other objects runs code it names."""
        weights_only = True if weights_only is None else weights_only  # Lightning passes None: never default to False
        checkpoint_path = skip_unfinished_hpc_checkpoint(checkpoint_path)  # `ckpt_path="hpc"` may name a killed save
        checkpoint_path = self.broadcast(checkpoint_path)
        if remote.is_url(checkpoint_path):
            metadata = self._load_from_url(checkpoint_path, weights_only=weights_only)
        else:
            path = Path(checkpoint_path)
            check_checkpoint(path)  # on every rank, before any collective of the load: every rank raises the same error
            if path.is_file():
                # Refused objects raise the same error on every rank, before any collective.
                with unpickling_guard(path, weights_only=weights_only, opt_in=_LOAD_OPT_IN):
                    metadata = super().load_checkpoint(path, weights_only=weights_only)
            else:
                metadata = self._load_distributed_checkpoint(path, weights_only=weights_only)
        metadata.pop(MODELS_KEY, None)
        rng = metadata.pop(RNG_KEY, None)
        if rng is not None and rng.get("dp_size", self.layout.dp_size) != self.layout.dp_size:
            self._drop_data_position(metadata, saved_dp_size=rng["dp_size"])
        self._rng_to_restore = None
        fitting = self.lightning_module is not None and self.lightning_module.trainer.state.fn == TrainerFn.FITTING
        if rng is not None and fitting and rng.get("layout") == self._layout_sizes():
            self._rng_to_restore = rng["states"]
        elif rng is not None and fitting:
            rank_zero_warn(
                f"The checkpoint was written on another layout ({rng.get('layout')}, this run: "
                f"{self._layout_sizes()}): the random states (dropout masks) are not restored; the weights, "
                "optimizer and loops are."
            )
        if self._inference_modules is not None:
            # validate/test/predict load after setup, and the load's state-dict hooks reshard what setup gathered.
            self._inference_modules = gather_for_inference(self.model)
        return metadata

    def _load_from_url(self, url: str, *, weights_only: bool) -> dict[str, Any]:
        # Checked on rank 0 before any collective of the load; every rank raises the same error.
        kind, data = self._decide_on_main(lambda: remote.resolve(url), url=url)
        if kind == "directory":
            return self._load_distributed_checkpoint(data, weights_only=weights_only)
        # A full file: each rank reads its own local copy (torch.load memory-maps it, as for a local file).
        # Private import: `ModelParallelStrategy.load_checkpoint` would broadcast rank 0's temporary path.
        from lightning.fabric.strategies.model_parallel import _load_checkpoint

        assert self.lightning_module is not None
        state = {
            "state_dict": self.model,
            **{f"optimizer_{idx}": optimizer for idx, optimizer in enumerate(self.optimizers)},
        }
        with tempfile.TemporaryDirectory(ignore_cleanup_errors=True) as tmp:
            local = Path(tmp) / "checkpoint.ckpt"
            remote.download(url, local)
            with unpickling_guard(url, weights_only=weights_only, opt_in=_LOAD_OPT_IN):
                return _load_checkpoint(
                    path=local,
                    state=state,
                    strict=self.lightning_module.strict_loading,
                    optimizer_states_from_list=True,
                    weights_only=weights_only,
                )

    def _layout_sizes(self) -> dict[str, int]:
        layout = self.layout
        return {"tp": layout.tp_size, "dp_shard": layout.dp_shard_size, "dp_replicate": layout.dp_replicate_size}

    def _drop_data_position(self, metadata: dict[str, Any], *, saved_dp_size: int) -> None:
        """A data loader's position (samples read per rank) means nothing for another number of data-parallel
        ranks, and torchdata's loaders fail restoring it; the epoch in progress restarts from its beginning."""
        fit_loop = metadata.get("loops", {}).get("fit_loop", {}).get("state_dict", {})
        if fit_loop.pop("combined_loader", None):
            rank_zero_warn(
                f"The checkpoint was written with {saved_dp_size} data-parallel rank(s) and this run has "
                f"{self.layout.dp_size}: the data loader's position is not restored, the epoch in progress restarts "
                "from its first batch. Weights, optimizer, scheduler and loop counters are restored."
            )

    def _load_distributed_checkpoint(self, path: Path | str, *, weights_only: bool) -> dict[str, Any]:
        """Lightning's DCP load, with the model's entries checked against the checkpoint's index first (names and
        shapes, with clear errors) and frozen weights the checkpoint left out skipped."""
        from torch.distributed.checkpoint import load
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            get_model_state_dict,
            get_optimizer_state_dict,
            set_optimizer_state_dict,
        )

        # Unpickled first, on every rank, before any collective: a refused meta.pt raises the same error everywhere.
        url = path if remote.is_url(path) else None
        meta = io.BytesIO(remote.read_bytes(remote.join(url, META_FILENAME))) if url else path / META_FILENAME
        metadata = load_torch_file(meta, weights_only=weights_only, opt_in=_LOAD_OPT_IN)
        assert self.model is not None and self.lightning_module is not None
        reader = remote.dcp_reader(url) if url else index_reader(path)  # neither runs code from the index
        stored = stored_entries(path, reader=reader)
        planner = safe_load_planner(weights_only=weights_only, opt_in=_LOAD_OPT_IN)  # nor from the shard files
        template = get_model_state_dict(self.model)
        keys = match_model_state(
            template,
            stored,
            frozen=frozen_parameter_names(list(template), self.model),
            strict=self.lightning_module.strict_loading,
            path=path,
        )
        written = {key.split(".", 1)[0] for key in stored if key.startswith("optimizer_")}
        missing_optimizers = [f"optimizer_{i}" for i in range(len(self.optimizers)) if f"optimizer_{i}" not in written]
        if missing_optimizers:
            raise ValueError(
                f"The checkpoint {path} holds the state of {len(written)} optimizer(s), this run has "
                f"{len(self.optimizers)}: nothing for {missing_optimizers}."
            )
        model_state = {"state_dict": {key: template[key] for key in keys}}
        load(model_state, checkpoint_id=path, storage_reader=reader, planner=planner)
        self.model.load_state_dict(model_state["state_dict"], strict=False)  # completeness was checked above
        for idx, optimizer in enumerate(self.optimizers):
            key = f"optimizer_{idx}"
            optimizer_state = {key: get_optimizer_state_dict(self.model, optimizer)}
            load(optimizer_state, checkpoint_id=path, storage_reader=reader, planner=planner)
            set_optimizer_state_dict(
                self.model, optimizer, optim_state_dict=optimizer_state[key], options=StateDictOptions(cpu_offload=True)
            )
        return metadata

    @override
    def process_dataloader(self, dataloader: object) -> object:
        self._continue_data_order(dataloader)
        return super().process_dataloader(dataloader)

    def _continue_data_order(self, dataloader: object) -> None:
        """Lightning 2.6 builds the training data iterator of a resumed run before it sets the sampler's epoch, so a
        run resumed mid-epoch replays epoch 0's order (torchdata's ``StatefulDataLoader`` then skips the batches
        already seen, of the wrong order). Set the epoch first."""
        trainer = self.lightning_module.trainer if self.lightning_module is not None else None
        if trainer is None or trainer.state.fn != TrainerFn.FITTING or not trainer.fit_loop.restarting:
            return
        _set_sampler_epoch(dataloader, trainer.fit_loop.epoch_progress.current.processed)

    @override
    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        # Random states are restored here, not at load: between the load and the first step Lightning builds the data
        # iterator, which draws its base seed from the global generator; the uninterrupted run had drawn it before
        # it saved mid-epoch.
        if self._rng_to_restore is not None:
            set_rng_state(self._rng_to_restore[self.global_rank])
            self._rng_to_restore = None
        super().on_train_batch_start(batch, batch_idx)

    @override
    def model_to_device(self) -> None:
        assert self.model is not None
        if not self._cpu_offload:
            self.model.to(self.root_device)
            return
        # FSDP2's CPU offload keeps parameters on the CPU; only buffers (rotary tables, ...) go to the device.
        for module in self.model.modules():
            for name, buffer in module._buffers.items():
                if buffer is not None:
                    module._buffers[name] = buffer.to(self.root_device)

    @contextmanager
    @override
    def block_backward_sync(self) -> Generator[None, None, None]:
        """While Lightning accumulates gradients, FSDP2 keeps them unreduced: one reduce-scatter per optimizer step,
        not one per micro-batch (Lightning's ``ModelParallelStrategy`` reduces every micro-batch)."""
        fsdp_modules = [m for m in self.model.modules() if isinstance(m, FSDPModule)] if self.model is not None else []
        for module in fsdp_modules:
            module.set_requires_gradient_sync(False, recurse=False)
        try:
            yield
        finally:
            for module in fsdp_modules:
                module.set_requires_gradient_sync(True, recurse=False)

    # ------------------------------------------------------------------ collectives seen by the LightningModule

    def _data_parallel_group(self) -> Any | None:
        if self._device_mesh is None or not _distributed_is_initialized():
            return None
        return self.dp_mesh.get_group()

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
            return _sync_ddp_if_available(
                tensor, group if group is not None else self._data_parallel_group(), reduce_op
            )
        return tensor

    @override
    def all_gather(self, tensor: Tensor, group: Any | None = None, sync_grads: bool = False) -> Tensor:
        """Gather over the data-parallel group by default (one entry per data-parallel replica)."""
        group = group if group is not None else self._data_parallel_group()
        return _all_gather_ddp_if_available(tensor, group=group, sync_grads=sync_grads)

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: Any) -> None:
        strategy_registry.register(
            cls.strategy_name,
            cls,
            description="Tensor parallelism for Transformers models (lightning_tp)",
            override=True,
        )


_destroy_registered = False


def _destroy_process_groups_at_exit() -> None:
    """Destroy the world group and every subgroup (the mesh's included) when the interpreter exits, while it can still
    run Python: left to interpreter shutdown, gloo's and NCCL's threads and sockets are torn down in no fixed order,
    and about one successful launch in 30 ended in SIGABRT ("terminate called without an active exception"). Only for
    a world group this strategy created: a group the user created before the Trainer is theirs to destroy. Lightning
    registers the same for NCCL only."""
    global _destroy_registered
    if _destroy_registered:
        return
    _destroy_registered = True

    def destroy() -> None:
        # Trainer, strategy and model form reference cycles that only the interpreter's final collection frees, when
        # gloo's threads can no longer take the GIL to drop the tensors their finished work holds: free them now.
        gc.collect()
        if _distributed_is_initialized():
            torch.distributed.destroy_process_group()
        gc.collect()

    atexit.register(destroy)


def _sizes_from_parallelism_config(
    config: Any, *, tp_size: int | None, dp_shard_size: int | None, dp_replicate_size: int
) -> tuple[int | None, int | None, int]:
    """Sizes from an ``accelerate.ParallelismConfig`` (duck-typed: accelerate is not a dependency)."""
    if tp_size is not None or dp_shard_size is not None or dp_replicate_size != 1:
        raise ValueError(
            "Pass either `parallelism_config` or the sizes (`tp_size`, `dp_shard_size`, `dp_replicate_size`), not both."
        )
    unsupported = {name: getattr(config, name, 1) for name in ("cp_size", "sp_size")}
    unsupported = {name: size for name, size in unsupported.items() if size not in (None, 1)}
    if unsupported:
        raise ValueError(f"`parallelism_config` asks for {unsupported}; this strategy offers TP, FSDP2 and HSDP only.")
    sizes = [getattr(config, name, None) for name in ("tp_size", "dp_shard_size", "dp_replicate_size")]
    if any(size is not None and not isinstance(size, int) for size in sizes):
        raise ValueError(f"`parallelism_config` must carry integer sizes, got {config!r}.")
    return sizes[0] or 1, sizes[1] or 1, sizes[2] or 1


__all__ = ["SUPPORTED_PRECISIONS", "TensorParallelStrategy"]
