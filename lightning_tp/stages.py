"""Each stage of :func:`lightning_tp.parallelize`, implemented: what ``apply_parallelisms`` calls, in its order, with
the targets they pass along (:class:`Targets`: each model with its resolved plan, and the other modules holding
parameters). The order, and the reason for each stage, is written once in :mod:`lightning_tp.parallelize`; each
technique lives in its own module (:mod:`~lightning_tp.plans.resolve`, :mod:`~lightning_tp.parallel.tensor_parallel`,
:mod:`~lightning_tp.parallel.sequence_parallel`, :mod:`~lightning_tp.parallel.fsdp`, ...).

May import (checked by tests/unit/test_repo.py): ``compat``, ``composition``, ``patches``, ``layout``, ``state``,
``options``, ``plans``, ``parallel``, ``checkpoint``, ``runtime``, ``parallel_options``: every layer below the order
(parallelize.py).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from torch import nn

from lightning_tp.checkpoint.hf_saves import install_distributed_save, install_distributed_save_pretrained
from lightning_tp.checkpoint.loading import materialize, materialize_modules
from lightning_tp.compat import (
    buffer_dict,
    drop_always_called_hooks,
    flatten_mesh,
    parameter_dict,
    record_module_device,
)
from lightning_tp.composition import refusal
from lightning_tp.layout import CP_AXIS, DP_REPLICATE_AXIS, DP_SHARD_AXIS, DP_SHARD_CP_AXIS, ParallelLayout
from lightning_tp.parallel.collectives import TP_GRAD_REDUCE_DTYPES
from lightning_tp.parallel.context_parallel import install_context_parallel
from lightning_tp.parallel.cp_checks import context_parallel_problem
from lightning_tp.parallel.expert_parallel import (
    expert_modules_of,
    expert_parallel_problem,
    resolve_expert_plan,
    shard_experts,
)
from lightning_tp.parallel.fsdp import apply_fsdp, apply_fsdp_per_child, fsdp_mixed_precision
from lightning_tp.parallel.fsdp import fsdp_units as check_fsdp_units
from lightning_tp.parallel.lora import check_peft_supported, extend_plan_to_adapters, has_peft, initialize_adapters
from lightning_tp.parallel.loss_parallel import install_loss_parallel, loss_parallel_plan
from lightning_tp.parallel.pipeline import stage_modules_of
from lightning_tp.parallel.pipeline_plan import PipelinePlan, pipeline_problem, resolve_pipeline_plan
from lightning_tp.parallel.pipeline_tied import tied_head
from lightning_tp.parallel.random_init import random_state_of_rank_zero
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
from lightning_tp.parallel_options import PRECISION_DTYPES, ParallelOptions
from lightning_tp.plans.discovery import modules_outside, peft_models, torchmetrics_in, transformers_models
from lightning_tp.plans.heads import uneven_kv_problem
from lightning_tp.plans.mixers import find_mixers
from lightning_tp.plans.resolve import no_plan, resolve_plan
from lightning_tp.plans.resolved import ResolvedPlan
from lightning_tp.plans.source import is_transformers_model
from lightning_tp.plans.structure import block_classes

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh


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
                state = (
                    "sharded by Transformers at load time"
                    if presharded_mesh is not None
                    else "not a Transformers causal LM"
                )
                raise refusal("pp+not_transformers", f"pp_size={layout.pp_size}: {type(module).__name__} is {state}")
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
                raise refusal(
                    "pp+v_shaped+tied+dp",
                    f"`pp_schedule={pipeline.schedule!r}` with {type(module).__name__}'s embedding tied to its head "
                    f"and FSDP2 over {layout.fsdp_size} ranks of data parallelism",
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
        uneven = uneven_kv_problem(module, plan, layout.tp_size, fsdp=layout.fsdp_size > 1, shards=layout.shard_size)
        if uneven is not None:
            raise ValueError(f"{uneven}.")
        if presharded_mesh is not None and plan.kv_replicated:
            raise refusal(
                "tp+presharded+kv_replicated",
                f"{type(module).__name__} was sharded by Transformers at load time, and tp_size={layout.tp_size} "
                f"does not divide its KV heads ({sorted(set(plan.kv_replicated.values()))}: query and KV heads)",
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


def _check_sharded_size(module: nn.Module, mesh: DeviceMesh, *, tp_ranks: list[int], layout: ParallelLayout) -> None:
    """A model sharded before this call must be sharded over exactly this rank's TP group."""
    ranks = sorted(mesh.mesh.flatten().tolist())
    if ranks != tp_ranks:
        raise ValueError(
            f"{type(module).__name__} is already tensor-parallel over ranks {ranks} (tp_size={len(ranks)}), but "
            f"this rank's TP group is {tp_ranks} (tp_size={layout.tp_size}). Load it without "
            "`distributed_config`/`tp_plan` and let lightning_tp shard it, or use the same tp_size."
        )


__all__ = [
    "Target",
    "Targets",
    "apply_activation_checkpointing",
    "apply_compile",
    "apply_context_parallel",
    "apply_data_parallel",
    "apply_tp",
    "cast_precision",
    "compile_options",
    "initialize_and_hook_adapters",
    "install_save_hooks",
    "materialize_and_load",
    "place_on_device",
    "resolve_targets",
    "rewrite_for_regions",
    "take_rank_zero_weights",
]
