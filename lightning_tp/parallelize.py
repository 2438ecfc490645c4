"""``parallelize(module, ...)``: the one place where the order of the parallelisms is written, with the reason for each.

Used by the Trainer strategy, the Fabric strategy and plain PyTorch scripts alike::

    torch.distributed.init_process_group("gloo")  # torchrun --nproc-per-node 4 train.py
    model = AutoModelForCausalLM.from_config(config)
    model = lightning_tp.parallelize(model, tp_size=2)  # tp 2 x FSDP2 over the 2 data-parallel ranks

Every stage is a small function of :mod:`lightning_tp.stages`, and the options are
:class:`~lightning_tp.parallel_options.ParallelOptions`; each technique lives in its own module
(:mod:`~lightning_tp.plans.resolve`, :mod:`~lightning_tp.parallel.tensor_parallel`,
:mod:`~lightning_tp.parallel.sequence_parallel`, :mod:`~lightning_tp.parallel.fsdp`, ...).

May import (checked by tests/unit/test_repo.py): ``compat``, ``composition``, ``patches``, ``layout``, ``state``,
``options``, ``plans``, ``parallel``, ``checkpoint``, ``runtime``, ``parallel_options``, ``stages``: every layer below
the strategies.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import nn

from lightning_tp.compat import distributed_is_initialized, flatten_mesh
from lightning_tp.layout import (
    CP_AXIS,
    DP_AXIS,
    DP_REPLICATE_AXIS,
    DP_SHARD_AXIS,
    EP_AXIS,
    MESH_AXES,
    PP_AXIS,
    TP_AXIS,
    ParallelLayout,
)
from lightning_tp.parallel.collectives import TP_GRAD_REDUCE_DTYPES
from lightning_tp.parallel.expert_parallel import apply_expert_parallel, check_expert_mesh
from lightning_tp.parallel.hooks import no_cache_under_grad
from lightning_tp.parallel.pipeline import install_pipeline, pipeline_runner
from lightning_tp.parallel.rng import prepare_dtensor_random, warn_repeated_dropout
from lightning_tp.parallel.router_loss import install_global_router_loss
from lightning_tp.parallel_options import ParallelOptions
from lightning_tp.plans.source import is_transformers_model
from lightning_tp.stages import (
    Targets,
    apply_activation_checkpointing,
    apply_compile,
    apply_context_parallel,
    apply_data_parallel,
    apply_tp,
    cast_precision,
    compile_options,
    initialize_and_hook_adapters,
    install_save_hooks,
    materialize_and_load,
    place_on_device,
    resolve_targets,
    take_rank_zero_weights,
)
from lightning_tp.state import ParallelState

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh


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
            ``"meta"`` with a model built on the meta device is a dry run: every check and every shard's shape as
            on the real devices (on a CPU ``mesh`` of a fake process group of the real world size, say), nothing
            allocated.

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
                f"context parallelism (cp_size={layout.cp_size})"
                if layout.cp_size > 1
                else f"loss parallelism (tp_size={layout.tp_size})"
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
    #    `device="meta"` is a dry run: everything above ran as it would (every check, every shard's shape), and
    #    nothing is allocated, initialised or exchanged from here on.
    if device.type == "meta":
        _attach_state(root, targets, layout=layout, mesh=mesh, options=options, expert_mesh=expert_mesh)
        return targets
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
    _attach_state(root, targets, layout=layout, mesh=mesh, options=options, expert_mesh=expert_mesh)
    return targets


def _attach_state(
    root: nn.Module,
    targets: Targets,
    *,
    layout: ParallelLayout,
    mesh: DeviceMesh,
    options: ParallelOptions,
    expert_mesh: DeviceMesh | None,
) -> None:
    """The :class:`ParallelState` of what was made, on ``root`` and on each model inside it."""
    runners = [pipeline_runner(target.module) for target in targets.models]
    state = ParallelState(
        layout=layout,
        mesh=mesh,
        options=options,
        targets=targets,
        expert_mesh=expert_mesh,
        pipelines=tuple(runner for runner in runners if runner is not None),
    )
    state.attach([root, *(target.module for target in targets.models)])


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


__all__ = ["apply_parallelisms", "data_parallel_mesh", "layout_of", "parallelize"]
