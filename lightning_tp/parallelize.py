"""``parallelize(module, ...)``: the one place where the order of the parallelisms is written, with the reason for each.

Used by the Trainer strategy, the Fabric strategy and plain PyTorch scripts alike::

    torch.distributed.init_process_group("gloo")  # torchrun --nproc-per-node 4 train.py
    model = AutoModelForCausalLM.from_config(config)
    model = lightning_tp.parallelize(model, tp_size=2)  # tp 2 x FSDP2 over the 2 data-parallel ranks

Every stage is a small function of this module; each technique lives in its own module
(:mod:`~lightning_tp.plans.resolve`, :mod:`~lightning_tp.parallel.tensor_parallel`,
:mod:`~lightning_tp.parallel.sequence_parallel`, :mod:`~lightning_tp.parallel.fsdp`, ...).

May import (checked by tests/unit/test_repo.py): ``compat``, ``composition``, ``patches``, ``layout``, ``state``,
``options``, ``plans``, ``parallel``, ``checkpoint``, ``runtime``: every layer below the strategies.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, Literal

import torch
import torch.distributed as dist
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from torch import nn

from lightning_tp.checkpoint.hf_saves import install_distributed_save, install_distributed_save_pretrained
from lightning_tp.checkpoint.loading import materialize, materialize_modules
from lightning_tp.compat import (
    buffer_dict,
    distributed_is_initialized,
    drop_always_called_hooks,
    flatten_mesh,
    parameter_dict,
    record_module_device,
)
from lightning_tp.composition import ignored, refusal
from lightning_tp.layout import (
    CP_AXIS,
    DP_AXIS,
    DP_REPLICATE_AXIS,
    DP_SHARD_AXIS,
    DP_SHARD_CP_AXIS,
    EP_AXIS,
    MESH_AXES,
    PP_AXIS,
    TP_AXIS,
    ParallelLayout,
)
from lightning_tp.parallel.collectives import TP_GRAD_REDUCE_DTYPES
from lightning_tp.parallel.context_parallel import install_context_parallel
from lightning_tp.parallel.cp_checks import context_parallel_problem
from lightning_tp.parallel.expert_parallel import (
    apply_expert_parallel,
    check_expert_mesh,
    expert_modules_of,
    expert_parallel_problem,
    resolve_expert_plan,
    shard_experts,
)
from lightning_tp.parallel.fsdp import BF16_NAMES, apply_fsdp, apply_fsdp_per_child, fsdp_mixed_precision
from lightning_tp.parallel.fsdp import fsdp_units as check_fsdp_units
from lightning_tp.parallel.hooks import no_cache_under_grad
from lightning_tp.parallel.lora import check_peft_supported, extend_plan_to_adapters, has_peft, initialize_adapters
from lightning_tp.parallel.loss_parallel import install_loss_parallel, loss_parallel_plan
from lightning_tp.parallel.pipeline import install_pipeline, pipeline_runner, stage_modules_of
from lightning_tp.parallel.pipeline_plan import (
    SPLIT_BACKWARD_SCHEDULES,
    PipelinePlan,
    pipeline_problem,
    resolve_pipeline_plan,
    schedule_class,
)
from lightning_tp.parallel.pipeline_tied import tied_head
from lightning_tp.parallel.random_init import random_state_of_rank_zero
from lightning_tp.parallel.rng import prepare_dtensor_random, warn_repeated_dropout
from lightning_tp.parallel.router_loss import install_global_router_loss
from lightning_tp.parallel.sequence_parallel import sequence_parallel_plan
from lightning_tp.parallel.tensor_parallel import (
    SHARDED_MARKER,
    adopt_transformers_sharding,
    apply_tensor_parallel,
    dense_layers_plan,
    is_sharded,
    on_meta,
    replicate_unsharded_parameters,
    take_rank_zero_values,
    transformers_tp_mesh,
)
from lightning_tp.plans.checks import check_style
from lightning_tp.plans.discovery import modules_outside, peft_models, torchmetrics_in, transformers_models
from lightning_tp.plans.heads import uneven_kv_projections
from lightning_tp.plans.mixers import find_mixers
from lightning_tp.plans.resolve import no_plan, resolve_plan
from lightning_tp.plans.resolved import ResolvedPlan
from lightning_tp.plans.source import is_transformers_model
from lightning_tp.plans.structure import block_classes
from lightning_tp.state import ParallelState

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

#: Precisions (Lightning's flags) whose parameters and gradients stay exact under TP, and the dtype the ``-true``
#: ones cast the module to before sharding.
PRECISION_DTYPES: Mapping[str, torch.dtype | None] = MappingProxyType(
    {"32-true": None, "bf16-mixed": None, "bf16-true": torch.bfloat16, "16-true": torch.float16}
)
SUPPORTED_PRECISIONS = tuple(PRECISION_DTYPES)
#: How context parallelism may exchange keys and values (``cp_comm``; see :mod:`lightning_tp.parallel.ring`).
CP_COMMS = ("all_gather", "ring")


@dataclass(frozen=True)
class ParallelOptions:
    """How to parallelise, apart from the sizes: each field but ``precision`` (the Trainer's or Fabric's flag) is the
    strategies' argument of that name, defined in :data:`lightning_tp.options.OPTIONS` (tests/unit/test_options.py
    checks the defaults agree). Checked when built, so that a typo fails before any process starts.

    Args:
        Each field: the strategies' argument of that name (:data:`lightning_tp.options.OPTIONS` has its meaning).

    Raises:
        ValueError: a field of the wrong type or value (named, with the values it takes).
    """

    tp_plan: Literal["auto"] | Mapping[str, Any] = "auto"
    sequence_parallel: bool = False
    loss_parallel: bool = False
    activation_checkpointing: bool = False
    compile: bool | Mapping[str, Any] = False
    cp_comm: Literal["all_gather", "ring"] = "all_gather"
    reshard_after_forward: bool = True
    cpu_offload: bool = False
    fsdp_blocks: tuple[str, ...] | None = None
    fsdp_param_dtype: Literal["auto", "bf16"] | None = "auto"
    tp_grad_reduce_dtype: Literal["fp32"] | None = None
    pp_schedule: str | None = None
    pp_microbatches: int | None = None
    pp_stages_per_rank: int = 1
    pp_split: tuple[int, ...] | None = None
    pp_pad_to_multiple_of: int | None = None
    precision: str = "32-true"

    def __post_init__(self) -> None:
        if isinstance(self.tp_plan, Mapping):
            for key, style in self.tp_plan.items():
                check_style(key, style)
            object.__setattr__(self, "tp_plan", dict(self.tp_plan))  # a copy (a proxy would not pickle)
        elif self.tp_plan != "auto":
            raise ValueError(f'`tp_plan` must be "auto" or a dict of module path to style, got {self.tp_plan!r}.')
        if self.fsdp_blocks is not None:
            object.__setattr__(self, "fsdp_blocks", tuple(self.fsdp_blocks) or None)
        if isinstance(self.compile, Mapping):
            object.__setattr__(self, "compile", dict(self.compile))
            check_compile_options(self.compile)
        elif not isinstance(self.compile, bool):
            raise ValueError(
                f"`compile` must be True, False or a dict of `torch.compile` keyword arguments (say "
                f'{{"fullgraph": True}}), got {self.compile!r}.'
            )
        if self.cp_comm not in CP_COMMS:
            raise ValueError(
                f"`cp_comm` must be one of {', '.join(map(repr, CP_COMMS))} (how context parallelism exchanges keys "
                f"and values), got {self.cp_comm!r}."
            )
        if self.pp_split is not None:
            object.__setattr__(self, "pp_split", tuple(self.pp_split))
        if self.pp_schedule is not None:
            schedule_class(self.pp_schedule)  # an unknown name fails here, naming torch's
        if (
            not isinstance(self.pp_stages_per_rank, int)
            or isinstance(self.pp_stages_per_rank, bool)
            or self.pp_stages_per_rank < 1
        ):
            raise ValueError(f"`pp_stages_per_rank` must be a positive integer, got {self.pp_stages_per_rank!r}.")
        if self.fsdp_param_dtype not in (None, "auto", *BF16_NAMES):
            raise ValueError(
                "`fsdp_param_dtype` must be 'auto' (bf16 all-gathers under `bf16-mixed`), 'bf16' (gather bf16 copies, "
                "reduce gradients in fp32) or None (gather parameters in their own dtype), got "
                f"{self.fsdp_param_dtype!r}. fp16 would need loss scaling, which sharded gradients do not have."
            )
        if self.tp_grad_reduce_dtype not in TP_GRAD_REDUCE_DTYPES:
            raise ValueError(
                "`tp_grad_reduce_dtype` must be None (TP sums activation gradients in their own dtype) or 'fp32' (sums "
                f"16-bit ones in fp32), got {self.tp_grad_reduce_dtype!r}."
            )
        if self.precision not in PRECISION_DTYPES:
            raise ValueError(
                f"Tensor parallelism does not support precision={self.precision!r}. Choose one of "
                f"{', '.join(SUPPORTED_PRECISIONS)} (for 16-bit mixed precision use 'bf16-mixed': fp16 loss scaling "
                "is not implemented for sharded gradients)."
            )

    def check_layout(self, layout: ParallelLayout, *, device: torch.device) -> None:
        """What depends on the layout and the device: decided on every rank from the configuration alone, before the
        process group starts."""
        if layout.pp_size > 1:
            split_backward = {name.lower() for name in SPLIT_BACKWARD_SCHEDULES}
            if self.compile is not False and str(self.pp_schedule).lower() in split_backward:
                raise refusal("pp+compile+split_backward", f"`pp_schedule={self.pp_schedule!r}` with `compile`")
        elif (
            self.pp_schedule,
            self.pp_microbatches,
            self.pp_stages_per_rank,
            self.pp_split,
            self.pp_pad_to_multiple_of,
        ) != (None, None, 1, None, None):
            rank_zero_warn(
                ignored(
                    "pp_options_without_pp",
                    "Each of `pp_schedule`, `pp_microbatches`, `pp_stages_per_rank`, `pp_split` and "
                    "`pp_pad_to_multiple_of`",
                )
            )
        if layout.cp_size == 1 and self.cp_comm != "all_gather":
            rank_zero_warn(ignored("cp_comm_without_cp", f"`cp_comm={self.cp_comm!r}`"))
        if layout.cp_size > 1 and isinstance(self.compile, Mapping) and self.compile.get("fullgraph"):
            raise refusal("cp+compile+fullgraph", f"`compile={{'fullgraph': True}}` with cp_size={layout.cp_size}")
        if self.cpu_offload and device.type == "cpu":
            raise refusal("cpu_offload+cpu", f"`cpu_offload=True` on device {device!s}")
        if self.cpu_offload and layout.fsdp_size == 1:
            raise refusal("cpu_offload+no_fsdp", f"`cpu_offload=True` with the layout {layout}")
        if self.fsdp_param_dtype in (None, "auto"):  # "auto" applies where it can, silently
            return
        if self.precision in ("32-true", "16-true"):
            raise refusal(
                "fsdp_param_dtype+full_precision",
                f"`fsdp_param_dtype={self.fsdp_param_dtype!r}` with precision={self.precision!r}",
            )
        if self.precision == "bf16-true":
            rank_zero_warn(
                ignored(
                    "fsdp_param_dtype+bf16_true",
                    f"`fsdp_param_dtype={self.fsdp_param_dtype!r}`",
                    context="under `precision='bf16-true'`",
                )
            )
        elif layout.fsdp_size == 1:
            rank_zero_warn(
                ignored(
                    "fsdp_param_dtype+no_fsdp",
                    f"`fsdp_param_dtype={self.fsdp_param_dtype!r}`",
                    context=f"with the layout {layout}, which has no data or context parallelism",
                )
            )


@dataclass(frozen=True)
class Target:
    """A model to shard with its resolved plan. ``presharded_mesh``: the TP mesh of a model Transformers sharded at
    load time (``from_pretrained(distributed_config=...)``), which keeps its shards."""

    module: nn.Module
    plan: ResolvedPlan
    presharded_mesh: DeviceMesh | None = None
    pipeline: PipelinePlan | None = None


@dataclass(frozen=True)
class Targets:
    """Everything ``parallelize`` places: the models (``Target``) and the other modules that hold parameters
    (``extras``: a value head, say), replicated over the TP group and sharded by FSDP2 as one group each."""

    models: list[Target] = field(default_factory=list)
    extras: list[nn.Module] = field(default_factory=list)


def parallelize(
    module: nn.Module,
    *,
    mesh: DeviceMesh | None = None,
    tp_size: int | None = None,
    dp_shard_size: int | None = None,
    dp_replicate_size: int = 1,
    cp_size: int = 1,
    ep_size: int = 1,
    pp_size: int = 1,
    options: ParallelOptions | None = None,
    device: torch.device | str | None = None,
) -> nn.Module:
    """Shard ``module`` in place over the TP, context-parallel, expert, pipeline and data-parallel ranks and return
    it. Every rank must call it, with the same arguments: it runs collectives. The model's state (layout, meshes,
    options, plans) is then :func:`lightning_tp.parallel_state` of it.

    Args:
        module: a Transformers model, a module holding some (a LightningModule, a ``PeftModel``), or any module given
            a ``tp_plan`` in ``options``.
        mesh: a device mesh with axes named ``dp_replicate``, ``dp_shard``, ``cp``, ``tp`` (the ones missing have
            size 1; see :meth:`ParallelLayout.build_device_mesh`); or leave it out and give the sizes, on the
            initialised world group.
        tp_size: ranks of a tensor-parallel group (default: every rank the other axes leave).
        dp_shard_size: ranks FSDP2 shards over (default: what the other axes leave).
        dp_replicate_size: replicas of the sharded model (HSDP's outer axis).
        cp_size: ranks each sequence is split over; the ranks of a CP group must be given the same rows (split the
            data over the data-parallel mesh only). See :mod:`lightning_tp.parallel.context_parallel`.
        ep_size: ranks a mixture-of-experts layer's experts are split over, borrowed from the data-parallel, CP and
            TP ranks (see :mod:`lightning_tp.parallel.expert_parallel`); may be given with ``mesh``.
        pp_size: pipeline stages' ranks (see :mod:`lightning_tp.parallel.pipeline`): every rank of a pipeline must
            be given the same rows, and ``model(**batch).loss`` runs the schedule, backward included.
        options: everything else (:class:`ParallelOptions`: sequence and loss parallelism, activation
            checkpointing, compile, FSDP2's settings, a plan of one's own).
        device: where the weights live (default: the mesh's device type, this rank's CUDA device on GPU).

    Raises:
        ValueError: the process group is not initialised and no ``mesh`` is given; both a ``mesh`` and sizes are
            given; the sizes do not divide the world; the layout, options and model do not compose (each message
            names the inputs and the fix). Decided on every rank alike, before any weight moves.
    """
    options = options or ParallelOptions()
    if mesh is None:
        if not distributed_is_initialized():
            raise ValueError(
                "`parallelize` needs the process group: call `torch.distributed.init_process_group()` first (under "
                "torchrun), or pass a `mesh`."
            )
        layout = ParallelLayout.resolve(
            dist.get_world_size(),
            tp_size=tp_size,
            dp_shard_size=dp_shard_size,
            dp_replicate_size=dp_replicate_size,
            cp_size=cp_size,
            ep_size=ep_size,
            pp_size=pp_size,
        )
        device = _device(device, mesh_type=_default_device_type())
        options.check_layout(layout, device=device)
        mesh, _ = layout.build_device_mesh(device.type)
    else:
        if (tp_size, dp_shard_size, dp_replicate_size, cp_size, pp_size) != (None, None, 1, 1, 1):
            raise ValueError(
                "Pass either `mesh` or the sizes (`tp_size`, `dp_shard_size`, `dp_replicate_size`, `cp_size`, "
                "`pp_size`)."
            )
        layout = layout_of(mesh)
        if ep_size != 1:
            layout = ParallelLayout(**{**vars(layout), "ep_size": ep_size})  # validated again with the EP axis
        device = _device(device, mesh_type=mesh.device_type)
        options.check_layout(layout, device=device)
    apply_parallelisms(module, mesh=mesh, layout=layout, options=options, device=device)
    return module


def apply_parallelisms(
    root: nn.Module,
    *,
    mesh: DeviceMesh,
    layout: ParallelLayout,
    options: ParallelOptions,
    device: torch.device,
    convert_module: Callable[[nn.Module], nn.Module] | None = None,
    expert_mesh: DeviceMesh | None = None,
) -> Targets:
    """The pipeline, in its one order. Modules handled by an earlier call (fit, then validate) are left alone.
    ``convert_module``: the precision plugin's cast (Lightning's), instead of :func:`cast_precision`.
    ``expert_mesh``: the mesh of :meth:`ParallelLayout.build_expert_mesh` (built here when ``ep_size > 1`` and it is
    not given)."""
    tp_mesh = mesh[TP_AXIS]
    # 1. Resolve and check every plan before any weight moves or any collective runs: a bad plan raises the same error
    #    on every rank, where a rank failing mid-way would leave the others hanging in a collective.
    targets = resolve_targets(root, layout=layout, tp_mesh=tp_mesh, dp_mesh=data_parallel_mesh(mesh), options=options)
    #    Dropout on a rank's own heads or tokens draws the same mask on every rank of a TP/CP group: said once, here.
    warn_repeated_dropout(root, layout)
    #    DTensor's random-number tracker now, on every rank and without a collective: torch would create it at the
    #    first random DTensor op with a world broadcast, which hangs if only some ranks run that op.
    prepare_dtensor_random(mesh)
    #    No KV cache in a forward under grad unless asked for (`use_cache` defaults to the config's, True): nothing
    #    reads it in training, and under `compile` each layer's guard on its cache layer would recompile the layer
    #    code once per layer (see `no_cache_under_grad`). A hook on each model users call, before any other stage's.
    for target in targets.models:
        if is_transformers_model(target.module):
            no_cache_under_grad(target.module)
    # 2. The dtype of `*-true` precisions, before sharding: FSDP2 keeps the dtype it shards (on meta this is free).
    if convert_module is not None:
        convert_module(root)
    else:
        cast_precision(root, options.precision)
    # 3. Every rank must hold the same weights before TP and FSDP2 each slice their own copy: one checksum all-gather
    #    over every rank, then rank 0's values of what differs (as torch's styles, `src_data_rank=0`).
    take_rank_zero_weights([t.module for t in targets.models if t.presharded_mesh is None] + targets.extras)
    # 3b. Pipeline stages, after that check (the one step that needs every rank to hold the whole model) and before
    #    everything else: each rank keeps only its stages' modules, so TP, FSDP2 and a meta model's loading see those
    #    alone, and `model(...)` runs the schedule.
    if layout.pp_size > 1:
        for index, target in enumerate(targets.models):
            assert target.pipeline is not None, "a model without a pipeline plan under pp"
            # The logits a custom pipeline loss would get are this rank's share under CP or loss parallelism.
            custom_loss_refusal = (
                f"context parallelism (cp_size={layout.cp_size}) gives the last stage its rank's chunk of the sequence"
                if layout.cp_size > 1
                else "loss parallelism keeps the last stage's logits vocabulary-sharded"
                if options.loss_parallel and layout.tp_size > 1
                else None
            )
            install_pipeline(
                target.module,
                target.pipeline,
                pp_mesh=mesh[PP_AXIS],
                device=device,
                custom_loss_refusal=custom_loss_refusal,
                dp_mesh=data_parallel_mesh(mesh),
            )
            targets.models[index] = replace(target, plan=target.plan.restricted_to(target.module))
    # 4. Tensor parallelism on the `tp` axis, innermost, so its frequent collectives stay on the fastest links; loss
    #    parallelism with it, since it changes what the TP'd `lm_head` returns.
    apply_tp(
        targets,
        tp_mesh=tp_mesh,
        device=device,
        loss_parallel=options.loss_parallel and layout.tp_size > 1,
        grad_reduce_dtype=TP_GRAD_REDUCE_DTYPES[options.tp_grad_reduce_dtype],
    )
    #    A mixture-of-experts router's load-balancing loss is a product of means over the tokens: with data
    #    parallelism each rank's would cover its own rows only, so it is computed over every data-parallel rank's.
    if layout.dp_size > 1:
        dp_mesh = data_parallel_mesh(mesh)
        for target in targets.models:
            if is_transformers_model(target.module):
                install_global_router_loss(target.module, dp_mesh)
    # 5. Context parallelism after TP: it wraps the model's attention and loss functions, whatever TP made of the
    #    projections around them (each rank's attention sees its TP heads of its CP chunk), and its hooks sit on the
    #    decoder stack, outside the layers that activation checkpointing recomputes and FSDP2 wraps.
    if layout.cp_size > 1:
        apply_context_parallel(root, targets, cp_mesh=mesh[CP_AXIS], layout=layout, options=options)
    # 5b. Expert parallelism after TP, which left the experts whole: each rank keeps its experts (a slice of the
    #    identical copies, like TP's) and the experts module's tokens go to them by all-to-all. Before activation
    #    checkpointing (the recomputed layer dispatches again) and FSDP2 (which shards each rank's experts over the
    #    ranks holding the same ones, `efsdp`, and must see the final DTensors).
    if layout.ep_size > 1:
        if expert_mesh is None:
            expert_mesh = layout.build_expert_mesh(mesh.device_type)
        check_expert_mesh(mesh, expert_mesh)
        for target in targets.models:
            if target.plan.experts:
                apply_expert_parallel(target.module, target.plan, ep_mesh=expert_mesh[EP_AXIS], tp_mesh=tp_mesh)
    # 6. Activation checkpointing per decoder layer, after TP (the recomputed forward runs the TP layers) and before
    #    FSDP2 (whose hooks then wrap the checkpointed layer and gather its weights again for the recompute).
    if options.activation_checkpointing:
        apply_activation_checkpointing(targets)
    # 6b. torch.compile per decoder layer, after TP (it traces the sharded layer) and activation checkpointing (whose
    #    wrapper stays outside the compiled call), before FSDP2: each layer compiled in place (`Module.compile`), so
    #    parameter names, state dicts and checkpoints stay the uncompiled model's (torchtitan wraps each block
    #    instead, which renames its parameters).
    if options.compile is not False:
        apply_compile(
            targets,
            blocks=options.fsdp_blocks,
            compile_options=compile_options(options.compile),
            checkpointed=options.activation_checkpointing,
        )
    # 7. FSDP2 on the data-parallel axes (and the CP axis: its ranks hold the same weights and reduce their gradients
    #    together), after TP: it shards the TP shards further (2-D) and must see the final DTensor parameters. HSDP
    #    when dp_replicate_size > 1.
    if layout.fsdp_size > 1:
        apply_data_parallel(root, targets, mesh=mesh, layout=layout, options=options, expert_mesh=expert_mesh)
    # 8. Models built on the meta device are materialised only now, already sharded, and filled from their checkpoint
    #    slice by slice: no rank ever holds the whole model. With CPU offload FSDP2 keeps the shards on the CPU.
    init_device = torch.device("cpu") if options.cpu_offload else device
    materialized = materialize_and_load(root, targets, device=init_device)
    # 8b. An embedding tied to the head across pipeline stages: the last stage's copy takes the first stage's values
    #    now that both are materialised (a meta-built model's were initialised apart); their gradients are summed
    #    after every step's backward from here on.
    if layout.pp_size > 1:
        for target in targets.models:
            runner = pipeline_runner(target.module)
            if runner is not None:
                runner.sync_tied_weights()
    # 9. LoRA adapters of a meta-built model exist only now; PEFT initialises them, every rank drawing the same whole
    #    adapters and keeping its slices. Then the saves that must gather shards (adapters, save_pretrained).
    initialize_and_hook_adapters(root, materialized=materialized, device=init_device)
    install_save_hooks(targets)
    # 10. What no stage placed (buffers of the root or of parameterless modules; with CPU offload, every buffer, which
    #    the forward needs on the device while FSDP2 keeps the parameters on the CPU).
    place_on_device(root, device, cpu_offload=options.cpu_offload)
    # 11. What was made, on the module given and on each model inside it, for what runs on them later (gradient norms
    #    over every pipeline stage): read with `parallel_state(model)`.
    state = ParallelState(layout=layout, mesh=mesh, options=options, targets=targets, expert_mesh=expert_mesh)
    state.attach([root, *(target.module for target in targets.models)])
    return targets


# ---------------------------------------------------------------------------------------------------------------------
# The stages


def resolve_targets(
    root: nn.Module,
    *,
    layout: ParallelLayout,
    tp_mesh: DeviceMesh,
    dp_mesh: DeviceMesh | None,
    options: ParallelOptions,
) -> Targets:
    """The models to shard, each with its resolved (and rewritten) plan, and the other modules that hold parameters.
    Raises before anything moves; modules an earlier call sharded are left out."""
    models = transformers_models(root)
    if not models:
        if options.tp_plan == "auto":
            raise ValueError(
                f"{type(root).__name__} holds no Transformers `PreTrainedModel`, so there is no plan to apply. Build "
                "the model before it is sharded (in a LightningModule: in `configure_model` or `__init__`), or pass "
                "`tp_plan={'<module path>': 'colwise' | 'rowwise' | <ParallelStyle>}` (paths relative to the module "
                "being sharded: the LightningModule, or the module given to `fabric.setup`/`parallelize`)."
            )
        models = [root]
        if layout.ep_size > 1:
            raise ValueError(
                f"ep_size={layout.ep_size} splits the experts of Transformers mixture-of-experts models; "
                f"{type(root).__name__} holds none. Use `ep_size=1`."
            )
        if layout.cp_size > 1:
            raise ValueError(
                f"cp_size={layout.cp_size} splits the sequences of Transformers causal LMs; {type(root).__name__} "
                "holds none. Use `cp_size=1`."
            )
        if layout.fsdp_size > 1:
            check_fsdp_units(root)  # refuses children sharing a parameter, before any collective
    direct = [name for name, p in parameter_dict(root).items() if p is not None and p.requires_grad]
    if direct and not is_transformers_model(root):
        raise ValueError(
            f"{type(root).__name__} holds trainable parameters directly ({direct}); move them into a submodule "
            "(e.g. `self.head = nn.Linear(...)`) so they can be placed."
        )
    targets = Targets()
    tp_ranks = sorted(tp_mesh.mesh.flatten().tolist())
    for module in models:
        if getattr(module, SHARDED_MARKER, None) is not None:
            _check_sharded_size(module, getattr(module, SHARDED_MARKER), tp_ranks=tp_ranks, layout=layout)
            continue
        presharded_mesh = transformers_tp_mesh(module) if is_sharded(module) else None
        if presharded_mesh is not None:
            _check_sharded_size(module, presharded_mesh, tp_ranks=tp_ranks, layout=layout)
            if options.tp_plan != "auto":
                rank_zero_warn(
                    f"`tp_plan` overrides are ignored for {type(module).__name__}: Transformers sharded it at load "
                    "time with its own plan. Load it without `distributed_config` to apply them."
                )
        if layout.tp_size == 1 and options.tp_plan == "auto" and presharded_mesh is None:
            plan = no_plan(module)  # a model without a plan (or with styles refused) trains with FSDP2 or CP alone
        else:
            plan = resolve_plan(
                module,
                "auto" if presharded_mesh is not None else options.tp_plan,
                tp_size=layout.tp_size,
                # Expert parallelism places the experts: their TP rules (refused ones too) are not applied.
                leave=expert_modules_of(module) if layout.ep_size > 1 else (),
            )
        if layout.cp_size > 1 and (problem := context_parallel_problem(module)) is not None:
            raise ValueError(f"cp_size={layout.cp_size}: {problem}.")
        pipeline = None
        if layout.pp_size > 1:
            if presharded_mesh is not None or not is_transformers_model(module):
                state = "sharded by Transformers at load time" if presharded_mesh is not None else "not one"
                raise ValueError(
                    f"pp_size={layout.pp_size} cuts Transformers causal LMs along their `base_model_pp_plan`; "
                    f"{type(module).__name__} is {state}. Load it without `distributed_config`, or use pp_size=1."
                )
            if (problem := pipeline_problem(module)) is not None:
                raise ValueError(f"pp_size={layout.pp_size}: {problem}.")
            pipeline = resolve_pipeline_plan(
                module,
                pp_size=layout.pp_size,
                schedule=options.pp_schedule,
                microbatches=options.pp_microbatches,
                stages_per_rank=options.pp_stages_per_rank,
                split=options.pp_split,
                pad_to_multiple_of=options.pp_pad_to_multiple_of,
            )
            if pipeline.v_shaped and layout.fsdp_size > 1 and tied_head(module, pipeline) is not None:
                raise ValueError(
                    f"`pp_schedule={pipeline.schedule!r}` places the first and the last stage on one rank, so "
                    f"{type(module).__name__}'s embedding tied to its head is one parameter in two stages; FSDP2 "
                    f"(over {layout.fsdp_size} ranks of data parallelism) shards each stage on its own and would split "
                    "it into two. Use a loop schedule (Interleaved1F1B, InterleavedZeroBubble), no data parallelism, "
                    "or untie the embeddings."
                )
        if layout.ep_size > 1:
            problem = expert_parallel_problem(
                module,
                sequence_parallel=options.sequence_parallel,
                precision=options.precision,
                presharded=presharded_mesh,
            )
            if problem is not None:
                raise ValueError(f"ep_size={layout.ep_size}: {problem}.")
            plan = resolve_expert_plan(module, plan, ep_size=layout.ep_size)
        uneven = uneven_kv_projections(module, plan, layout.tp_size) if layout.fsdp_size > 1 else []
        if uneven:
            raise ValueError(
                f"{type(module).__name__}: the KV heads of {uneven[0]} are replicated over tp_size={layout.tp_size}, "
                f"and its width ({module.get_submodule(uneven[0]).weight.shape[0]}: KV heads x head_dim) is not "
                f"divisible by it, so its shards are uneven, which FSDP2 (over {layout.shard_size} rank(s) of "
                "data and context parallelism) cannot shard further. Use a tp_size that divides that width, or no "
                "data parallelism."
            )
        if presharded_mesh is not None and plan.kv_replicated:
            raise ValueError(
                f"{type(module).__name__} was sharded by Transformers at load time, which cannot split KV heads "
                f"that tp_size={layout.tp_size} does not divide ({sorted(set(plan.kv_replicated.values()))}: query "
                "and KV heads). Load it without `distributed_config`: the strategy then replicates the KV heads "
                "(each rank computes those of its query heads)."
            )
        if has_peft(module):
            # PEFT was applied to the whole model: shard each adapter with its base layer, and refuse what cannot be
            # sharded, before anything moves.
            check_peft_supported(module)
            if presharded_mesh is not None:
                raise ValueError(
                    f"{type(module).__name__} carries PEFT adapters but was sharded by Transformers at load time, "
                    "when the adapters did not exist yet. Load it without `distributed_config`."
                )
            plan = extend_plan_to_adapters(module, plan)
        plan = rewrite_for_regions(
            module,
            plan,
            presharded=presharded_mesh is not None,
            layout=layout,
            dp_mesh=dp_mesh,
            options=options,
            stages=pipeline.layers if pipeline is not None else (),
        )
        targets.models.append(Target(module, plan, presharded_mesh, pipeline))
    targets.extras.extend(
        m
        for m in modules_outside(root, models)
        if getattr(m, SHARDED_MARKER, None) is None and any(True for _ in m.parameters())
    )
    if options.cpu_offload and targets.extras:
        raise ValueError("`cpu_offload=True` supports parameters inside the Transformers models only.")
    if layout.pp_size > 1 and (targets.extras or len(targets.models) > 1):
        what = [type(m).__name__ for m in targets.extras] + [type(t.module).__name__ for t in targets.models[1:]]
        raise ValueError(
            f"pp_size={layout.pp_size} pipelines one Transformers model; {type(root).__name__} also holds parameters "
            f"in {what}, which no stage would run. Keep one model with parameters in the module, or use pp_size=1."
        )
    return targets


def rewrite_for_regions(
    module: nn.Module,
    plan: ResolvedPlan,
    *,
    presharded: bool,
    layout: ParallelLayout,
    dp_mesh: DeviceMesh | None,
    options: ParallelOptions,
    stages: Sequence[range] = (),
) -> ResolvedPlan:
    """Dense decoder layers with one input DTensor per attention/MLP (2 backward all-reduces per layer instead of 5),
    sequence parallelism when asked (``stages``: the decoder layers of each pipeline stage), and the
    vocabulary-sharded ``lm_head`` of loss parallelism."""
    asked = ", ".join(f"{name}=True" for name in ("sequence_parallel", "loss_parallel") if getattr(options, name))
    if not is_transformers_model(module) or presharded:
        if asked and not is_transformers_model(module):
            raise ValueError(f"{asked} applies to Transformers causal LMs; {type(module).__name__} is not one.")
        if asked:
            raise ValueError(
                f"{asked} rewrites the plan, but {type(module).__name__} was sharded by Transformers at load "
                "time. Load it without `distributed_config`."
            )
        return plan
    if layout.tp_size == 1:
        if asked:
            rank_zero_warn(f"{asked} is ignored: tp_size=1 splits nothing over a TP group.")
        return plan
    if options.sequence_parallel and has_peft(module):
        raise ValueError("sequence_parallel=True does not support PEFT adapters yet; drop one of them.")
    blocks = block_classes(module, options.fsdp_blocks)
    if options.sequence_parallel:
        plan = sequence_parallel_plan(
            module, plan, blocks=blocks, recomputed=options.activation_checkpointing, stages=stages
        )
    elif not has_peft(module):  # PEFT's LoRA layers take plain-tensor inputs
        plan = dense_layers_plan(
            module, plan, blocks=blocks, grad_reduce_dtype=TP_GRAD_REDUCE_DTYPES[options.tp_grad_reduce_dtype]
        )
    if options.loss_parallel:
        plan = loss_parallel_plan(module, plan)
    return plan


def cast_precision(root: nn.Module, precision: str) -> None:
    """``module.to(dtype)`` for the ``-true`` precisions, as Lightning's precision plugins do."""
    dtype = PRECISION_DTYPES[precision]
    if dtype is not None:
        root.to(dtype=dtype)


def take_rank_zero_weights(modules: list[nn.Module]) -> None:
    """Ranks that built the model with different values (a seed per rank, say) train rank 0's values, as Lightning's
    ``ModelParallelStrategy`` does: the run equals one process initialised like rank 0."""
    for module in modules:
        taken = take_rank_zero_values(module)  # over WORLD: TP and data parallelism both need identical copies
        if taken:
            rank_zero_info(
                f"{type(module).__name__}: {len(taken)} tensor(s) differed between ranks (first: {taken[0]!r}) and "
                "were set to rank 0's values on every rank. Seed before building the model to silence this."
            )


def apply_tp(
    targets: Targets,
    *,
    tp_mesh: DeviceMesh,
    device: torch.device,
    loss_parallel: bool,
    grad_reduce_dtype: torch.dtype | None = None,
) -> None:
    """Each model sharded by its plan (a model Transformers sharded at load time keeps its shards and only gets the
    replicated DTensors); modules outside the models replicated over the TP group. ``grad_reduce_dtype``: the dtype
    TP's backward sums activation gradients in (``None``: their own)."""
    for target in targets.models:
        if target.presharded_mesh is None:
            apply_tensor_parallel(
                target.module, tp_mesh, target.plan, device=device, grad_reduce_dtype=grad_reduce_dtype
            )
            if loss_parallel:
                install_loss_parallel(target.module)  # the logits stay vocabulary-sharded: the loss runs on the shards
        else:
            adopt_transformers_sharding(target.module, target.presharded_mesh, target.plan)
    for module in targets.extras:
        if not on_meta(module):
            module.to(device)
        replicate_unsharded_parameters(module, tp_mesh)
        setattr(module, SHARDED_MARKER, tp_mesh)


def apply_context_parallel(
    root: nn.Module, targets: Targets, *, cp_mesh: DeviceMesh, layout: ParallelLayout, options: ParallelOptions
) -> None:
    """Each model's sequences split over the CP group (every model passed ``context_parallel_problem`` when its
    target was resolved). Lengths are padded to a multiple of ``2 x cp`` (two pieces per rank), times ``tp`` under
    sequence parallelism, which splits each rank's tokens over the TP group again."""
    multiple = 2 * layout.cp_size * (layout.tp_size if options.sequence_parallel else 1)
    wrappers = {id(peft_model.get_base_model()): peft_model for peft_model in peft_models(root)}
    for target in targets.models:
        blocks = block_classes(target.module)  # the decoder layers (`fsdp_blocks` may name other classes too)
        # What calls the model's forward: its pipeline stages (the model's own call runs the schedule), a PEFT
        # wrapper (which calls the model's `forward` past its hooks), or the model.
        stages = stage_modules_of(target.module)
        wrapper = wrappers.get(id(target.module))
        outers = tuple(stages) if stages else (wrapper,) if wrapper is not None else ()
        install_context_parallel(
            target.module, cp_mesh, multiple=multiple, blocks=blocks, outers=outers, comm=options.cp_comm
        )


def apply_activation_checkpointing(targets: Targets) -> None:
    for target in targets.models:
        module = target.module
        if is_transformers_model(module) and getattr(module, "supports_gradient_checkpointing", False):
            module.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
        else:
            rank_zero_warn(
                f"`activation_checkpointing=True` is ignored for {type(module).__name__}: it applies to "
                "Transformers models that support it. Wrap your blocks with `torch.utils.checkpoint` instead."
            )


#: ``torch.compile`` arguments ``compile={...}`` may not set: the strategy compiles each layer in place itself.
_COMPILE_OWN_ARGUMENTS = ("model",)


def check_compile_options(options: Mapping[str, Any]) -> None:
    """``compile={...}`` holds ``torch.compile`` keyword arguments only (checked against its signature)."""
    import inspect

    accepted = [name for name in inspect.signature(torch.compile).parameters if name not in _COMPILE_OWN_ARGUMENTS]
    for key in options:
        if key not in accepted:
            raise ValueError(
                f"`compile={{{key!r}: ...}}`: {key!r} is not a `torch.compile` argument here. Use some of "
                f"{', '.join(accepted)}, or `compile=True` for its defaults."
            )


def compile_options(compile: bool | Mapping[str, Any]) -> dict[str, Any]:
    """The ``torch.compile`` keyword arguments ``compile`` asks for: none for ``True``."""
    return dict(compile) if isinstance(compile, Mapping) else {}


def apply_compile(
    targets: Targets,
    *,
    blocks: tuple[str, ...] | None,
    compile_options: Mapping[str, Any],
    checkpointed: bool = False,
) -> None:
    """Each decoder layer (``blocks`` or ``_no_split_modules``) of each model compiled in place with
    ``compile_options`` (``torch.compile``'s arguments); the first forward compiles it. By default graph breaks are
    allowed (a family's hooks may break some); ``{"fullgraph": True}`` makes one an error, naming the break.
    ``checkpointed``: the layers are recomputed by activation checkpointing, whose recomputation stops each layer's
    forward with an exception once it has what backward needs (torch's early stop), in eager where dynamo skips the
    checkpointed frame: their always-called hooks (which put swapped parameters back) stay always called."""
    for target in targets.models:
        classes = block_classes(target.module, blocks)
        layers = [m for m in target.module.modules() if type(m) in classes]
        if not layers:
            rank_zero_warn(
                f"`compile` is ignored for {type(target.module).__name__}: no module of the block classes "
                f"({sorted(blocks) if blocks else '`_no_split_modules`'}) to compile; name its layers with "
                "`fsdp_blocks`, or compile it yourself."
            )
        eager = [layer for layer in layers if any(not kind.compiles for kind in find_mixers(layer).values())]
        if eager:
            kinds = sorted({k.description for layer in eager for k in find_mixers(layer).values() if not k.compiles})
            rank_zero_warn(
                f"`compile`: {len(eager)} of {len(layers)} decoder layers of {type(target.module).__name__} run "
                f"uncompiled: they hold {', '.join(kinds)}, whose compiled backward fails in torch "
                f"{torch.__version__.split('+')[0]} (see lightning_tp.plans.mixer_kinds.MixerKind.compiles)."
            )
        for layer in layers:
            if layer not in eager:
                if not checkpointed:
                    for module in layer.modules():
                        drop_always_called_hooks(module)  # else each layer's graph is guarded on its hooks' ids
                layer.compile(**compile_options)


def apply_data_parallel(
    root: nn.Module,
    targets: Targets,
    *,
    mesh: DeviceMesh,
    layout: ParallelLayout,
    options: ParallelOptions,
    expert_mesh: DeviceMesh | None = None,
) -> None:
    """FSDP2 over each model (its blocks one by one, then the model), and over each module outside the models as one
    group, so that every trainable parameter has its gradients reduced over the data-parallel ranks. A root that is
    the model itself gets one group per child (see :func:`apply_fsdp_per_child`)."""
    # HSDP takes the 2-D (replicate, shard) mesh, even when the shard axis has one rank; FSDP the shard axis. The
    # shard axis is `dp_shard` x `cp` with context parallelism (built with the mesh, see `build_device_mesh`).
    shard_axis = DP_SHARD_CP_AXIS if layout.cp_size > 1 else DP_SHARD_AXIS
    if layout.cp_size > 1:
        flatten_mesh(mesh[(DP_SHARD_AXIS, CP_AXIS)], DP_SHARD_CP_AXIS)  # the one built already, or a user mesh's
    if layout.dp_replicate_size > 1:
        fsdp_mesh = mesh[(DP_REPLICATE_AXIS, shard_axis)]
    else:
        fsdp_mesh = mesh[shard_axis]
    fsdp_options = dict(
        reshard_after_forward=options.reshard_after_forward,
        mp_policy=fsdp_mixed_precision(options.precision, param_dtype=options.fsdp_param_dtype),
        cpu_offload=options.cpu_offload,
    )
    blocks = list(options.fsdp_blocks) if options.fsdp_blocks else None
    for target in targets.models:
        if target.plan.experts:
            # Units of their own on the expert mesh, first: FSDP2 shards a parameter in the first unit holding it.
            assert expert_mesh is not None, "expert parallelism without the expert mesh"
            shard_experts(target.module, target.plan, expert_mesh=expert_mesh, layout=layout, **fsdp_options)
        if target.pipeline is not None:
            # Each stage its own root (torch's `PipelineStage` runs FSDP2's gradient reduction of its root once the
            # step's last micro-batch is through), its decoder layers units inside it. A stage's root leaves its
            # inputs' dtype alone where they carry the router loss's statistics (fp32 counts and sums, which bf16
            # would round): its layers cast their own inputs.
            cast = target.pipeline.router is None
            for stage in stage_modules_of(target.module):
                stage_blocks = block_classes(target.module, blocks)
                apply_fsdp(stage, fsdp_mesh, blocks=stage_blocks, cast_root_inputs=cast, **fsdp_options)
        elif target.module is root and not is_transformers_model(root):
            # A plain module tree: the training loop calls its children, never the root's forward.
            apply_fsdp_per_child(root, fsdp_mesh, fsdp_blocks=blocks, **fsdp_options)
        else:
            apply_fsdp(target.module, fsdp_mesh, blocks=block_classes(target.module, blocks), **fsdp_options)
    for module in targets.extras:
        apply_fsdp(module, fsdp_mesh, blocks=set(), **fsdp_options)


def materialize_and_load(root: nn.Module, targets: Targets, *, device: torch.device) -> set[int]:
    """Allocate what was built on the meta device, sharded, and fill it (from its checkpoint, else initialised as one
    process would); returns the ids of the Transformers models materialised."""
    materialized = set()
    for target in targets.models:
        if on_meta(target.module) and is_transformers_model(target.module):
            materialize(target.module, device, tied=target.plan.tied)
            materialized.add(id(target.module))
    materialize_modules(root, device)
    return materialized


def initialize_and_hook_adapters(root: nn.Module, *, materialized: set[int], device: torch.device) -> None:
    for peft_model in peft_models(root):
        if id(peft_model.get_base_model()) in materialized:
            rank_zero_warn(
                "LoRA adapters on a model built on the meta device are initialised after sharding, as one process "
                "would draw them: right for new adapters (`get_peft_model`). An adapter loaded with "
                "`PeftModel.from_pretrained` onto such a model would not be kept: to continue training a saved "
                "adapter, load the base with `AutoModelForCausalLM.from_pretrained`."
            )
            with random_state_of_rank_zero(device):  # every rank draws the same whole adapters
                initialize_adapters(peft_model)  # PEFT's own initialisation, each rank keeping its slices
        install_distributed_save(peft_model)


def install_save_hooks(targets: Targets) -> None:
    for target in targets.models:
        # A model Transformers sharded at load time saves itself on every rank (its own barrier included).
        if is_transformers_model(target.module) and target.presharded_mesh is None:
            install_distributed_save_pretrained(target.module)


def place_on_device(root: nn.Module, device: torch.device, *, cpu_offload: bool) -> None:
    """Everything on ``device``. With FSDP2's CPU offload the parameters stay on the CPU (FSDP2 brings each unit's to
    the device for its forward) and the rest moves: buffers (rotary tables, ...), torchmetrics' states, and the device
    that Lightning's modules report (``self.device``: where ``self.log(..., sync_dist=True)`` and ``torch.zeros(...,
    device=self.device)`` put their tensors; NCCL takes no CPU tensors)."""
    if not cpu_offload:
        root.to(device)
        return
    for metric in torchmetrics_in(root):
        metric.to(device)  # a metric's states are no buffers; `Metric._apply` moves them (it holds no parameters)
    for module in root.modules():
        buffers = buffer_dict(module)
        for name, buffer in buffers.items():
            if buffer is not None:
                buffers[name] = buffer.to(device)
        record_module_device(module, device)


# ---------------------------------------------------------------------------------------------------------------------
# Meshes


def layout_of(mesh: DeviceMesh) -> ParallelLayout:
    """The sizes of a mesh whose axes are named ``dp_replicate``, ``dp_shard``, ``cp`` and ``tp`` (missing ones:
    size 1)."""
    names = tuple(mesh.mesh_dim_names or ())
    known = MESH_AXES
    unknown = [name for name in names if name not in known]
    if TP_AXIS not in names or unknown:
        # An axis of another name (torchtitan's `dp`, say) would be taken for nothing: its ranks would train apart.
        raise ValueError(
            f"The mesh's axes are {names}; `parallelize` needs a `{TP_AXIS}` axis and knows only {known}. Build the "
            "mesh with `ParallelLayout(...).build_device_mesh(...)`, or pass the sizes instead of a mesh."
        )
    sizes = {name: mesh.size(names.index(name)) if name in names else 1 for name in known}
    layout = ParallelLayout(
        tp_size=sizes[TP_AXIS],
        dp_shard_size=sizes[DP_SHARD_AXIS],
        dp_replicate_size=sizes[DP_REPLICATE_AXIS],
        cp_size=sizes[CP_AXIS],
        pp_size=sizes[PP_AXIS],
    )
    world_size = dist.get_world_size() if distributed_is_initialized() else 1
    if layout.world_size != world_size:
        raise ValueError(
            f"The mesh covers {layout.world_size} ranks ({layout}) but the world has {world_size}: pass the whole "
            "mesh (every rank is a TP or data-parallel rank), not one of its sub-meshes."
        )
    return layout


def data_parallel_mesh(mesh: DeviceMesh) -> DeviceMesh | None:
    """The 1-D mesh over this rank's data-parallel replicas (``dp_replicate`` x ``dp_shard`` flattened), or ``None``
    for a mesh with TP only."""
    names = tuple(mesh.mesh_dim_names or ())
    axes = tuple(name for name in (DP_REPLICATE_AXIS, DP_SHARD_AXIS) if name in names)
    if not axes:
        return None
    if len(axes) == 1:
        return mesh[axes[0]]
    return flatten_mesh(mesh[axes], DP_AXIS)  # torch returns the one built already (the strategies build it)


def _check_sharded_size(module: nn.Module, mesh: DeviceMesh, *, tp_ranks: list[int], layout: ParallelLayout) -> None:
    """A model sharded before this call must be sharded over exactly this rank's TP group."""
    ranks = sorted(mesh.mesh.flatten().tolist())
    if ranks != tp_ranks:
        raise ValueError(
            f"{type(module).__name__} is already tensor-parallel over ranks {ranks} (tp_size={len(ranks)}), but "
            f"this rank's TP group is {tp_ranks} (tp_size={layout.tp_size}). Load it without "
            "`distributed_config`/`tp_plan` and let lightning_tp shard it, or use the same tp_size."
        )


def _default_device_type() -> str:
    """CUDA where the world group can talk over it: NCCL, a mixed backend ("cpu:gloo,cuda:nccl") or the default
    ``init_process_group()`` (reported as "undefined", which picks NCCL for CUDA tensors)."""
    backend = str(dist.get_backend())
    return "cuda" if torch.cuda.is_available() and ("nccl" in backend or backend == "undefined") else "cpu"


def _device(device: torch.device | str | None, *, mesh_type: str) -> torch.device:
    if device is not None:
        return torch.device(device)
    if mesh_type == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device(mesh_type)


__all__ = ["SUPPORTED_PRECISIONS", "ParallelOptions", "Target", "Targets", "parallelize", "place_on_device"]
