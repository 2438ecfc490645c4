"""Expert parallelism: each rank of an EP group holds ``1/ep`` of a mixture-of-experts layer's experts, whole, and the
tokens routed to them travel there and back with two all-to-alls per layer.

The plan is the model's own (Transformers' ``ep_plan``, from the config's ``base_model_ep_plan``): ``grouped_gemm`` on
the stacked expert weights (``Shard(0)`` on the ``ep`` axis: the expert dim) and ``ep_dispatch_experts`` on the
experts module. It is resolved and checked with the TP plan, before anything moves; the TP plan's rules for the same
modules (``moe_tp_experts`` and its packed column-/row-wise weights) are dropped, so TP leaves the experts whole and
shards the rest (attention, the router's neighbours, shared experts) as usual.

Applied with Transformers' own layers (``apply_expert_parallelism``): its all-to-all dispatch (``AllToAllEP``) is
right for training (differentiable exchanges, routing weights applied on the sender, each token of a TP group sent
by one of its ranks, an empty exchange kept in the graph), so it is used as is. What Transformers' FSDP path does
around it is done here instead (:func:`shard_experts`): the experts get an FSDP2 unit of their own on the expert
mesh's ``efsdp`` axis, whose gradient is divided by the number of batches the whole job sees, not by the unit's size.

Dropless: every token reaches its ``top_k`` experts, whatever the load, as on one process (the families with a plan
have no capacity factor). Each experts module records how many of its rank's tokens went to each expert in its last
forward (:func:`expert_load`), which :class:`lightning_tp.runtime.monitor.ExpertLoadMonitor` logs.
"""

from __future__ import annotations

import inspect
from dataclasses import replace
from typing import TYPE_CHECKING, Any

import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch import nn

from lightning_tp.compat import is_view, transformers_apply_expert_parallelism, uses_experts_interface
from lightning_tp.composition import problem
from lightning_tp.layout import DP_REPLICATE_AXIS, EFSDP_AXIS
from lightning_tp.parallel.fsdp import apply_fsdp
from lightning_tp.plans.resolved import ResolvedPlan
from lightning_tp.plans.source import key_regex
from lightning_tp.plans.styles import facts, style_names

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

    from lightning_tp.layout import ParallelLayout

#: The style names of an expert-parallel plan (the one table: :data:`lightning_tp.plans.styles.STYLES`).
EP_STYLES = style_names(expert_parallel=True)
#: Those that name a stacked expert weight (the rest name the experts module).
_WEIGHT_STYLES = style_names(expert_parallel=True, kind="expert")
#: The arguments Transformers' dispatch hands the experts module (hidden states, global expert ids, weights).
_EXPERTS_ARGUMENTS = 3
#: Where each experts module keeps the tokens per expert of its last forward (this rank's tokens).
LOAD_ATTRIBUTE = "_lightning_tp_tokens_per_expert"
_TOTAL_ATTRIBUTE = "_lightning_tp_num_experts"


def expert_parallel_problem(
    model: nn.Module, *, sequence_parallel: bool, precision: str, presharded: object | None
) -> str | None:
    """Why ``model`` cannot have its experts split over the EP ranks with these options, or ``None``: decided from
    the configuration alone, the same on every rank."""
    name = type(model).__name__
    if presharded is not None:
        return problem("ep+presharded", f"{name} was sharded by Transformers at load time")
    if sequence_parallel:
        return problem("ep+sequence_parallel", "sequence_parallel=True is not supported with expert parallelism yet")
    if precision == "16-true":
        # FSDP2 divides fp16 gradients before and after the reduction and, on a one-rank group, once more.
        return problem("ep+fp16", "precision='16-true' is not supported with expert parallelism")
    return None


def expert_modules_of(model: nn.Module) -> tuple[str, ...]:
    """The keys of ``model``'s expert-parallel plan that name experts modules (with ``*``), before it is resolved."""
    rules = getattr(model, "ep_plan", None) or {}
    return tuple(key for key, style in rules.items() if style in EP_STYLES and facts(style).kind != "expert")


def resolve_expert_plan(module: nn.Module, plan: ResolvedPlan, *, ep_size: int) -> ResolvedPlan:
    """``plan`` with the model's expert-parallel rules (``plan.experts``: concrete names, weights before their module,
    as Transformers applies them) and without the TP rules on the experts. Raises, naming the model and the sizes
    that work, before anything moves."""
    name = type(module).__name__
    rules = dict(getattr(module, "ep_plan", None) or {})
    if not rules:
        raise ValueError(
            f"ep_size={ep_size}: "
            + problem("ep+no_plan", f"{name} has no expert-parallel plan (its config has no `base_model_ep_plan`)")
            + "."
        )
    tp_rules = {key: style for key, style in rules.items() if style not in EP_STYLES and facts(style) is not None}
    unknown = {key: style for key, style in rules.items() if style not in EP_STYLES and key not in tp_rules}
    if unknown:
        raise ValueError(
            f"ep_size={ep_size}: "
            + problem(
                "ep+no_plan",
                f"{name}'s expert-parallel plan uses styles this strategy does not apply: {unknown} (it applies "
                f"{list(EP_STYLES)})",
            )
            + "."
        )
    if tp_rules:
        # Gemma 4's lists the dense MLP's column-/row-wise rules too (its published layout keeps the attention
        # whole): how the rest is split is the TP plan's business here, whatever the EP size.
        rank_zero_info(
            f"{name}'s expert-parallel plan also lists TP rules ({sorted(tp_rules)[:3]}, ...): the TP plan splits "
            f"those modules (tp_size), the expert-parallel plan only the experts."
        )
        rules = {key: style for key, style in rules.items() if key not in tp_rules}
    modules = dict(module.named_modules())
    params = dict(module.named_parameters())
    weights: dict[str, str] = {}
    dispatched: dict[str, str] = {}
    for key, style in rules.items():
        regex = key_regex(key)
        found = params if style in _WEIGHT_STYLES else modules
        for target in found:
            if regex.fullmatch(target):
                (weights if style in _WEIGHT_STYLES else dispatched)[target] = style
    if not dispatched:
        raise ValueError(
            f"ep_size={ep_size}: {name}'s expert-parallel plan ({list(rules)}) matches no module: every layer of this "
            "config is dense. Use ep_size=1."
        )
    for experts_name in dispatched:
        _check_experts(module, experts_name, modules[experts_name], weights, ep_size=ep_size)
    orphans = [w for w in weights if w.rpartition(".")[0] not in dispatched]
    if orphans:
        raise ValueError(
            f"ep_size={ep_size}: {name}'s expert-parallel plan splits {orphans[:3]}, whose module gets no "
            "'ep_dispatch_experts': its tokens would not reach the rank holding each expert. Use ep_size=1."
        )
    under = tuple(f"{d}." for d in dispatched)
    styles = {key: style for key, style in plan.styles.items() if key not in dispatched and not key.startswith(under)}
    return replace(plan, styles=styles, experts={**weights, **dispatched})


def _check_experts(
    model: nn.Module, experts_name: str, experts: nn.Module, weights: dict[str, str], *, ep_size: int
) -> None:
    name = type(model).__name__
    count = getattr(experts, "num_experts", None)
    if not isinstance(count, int) or not uses_experts_interface(experts):
        raise ValueError(
            f"ep_size={ep_size}: {name}.{experts_name} ({type(experts).__name__}) is not an experts module of "
            "Transformers' experts interface (`num_experts` and `@use_experts_implementation`), which the "
            "expert-parallel dispatch runs on local expert ids. Use ep_size=1."
        )
    signature = inspect.signature(type(experts).forward)
    if len([p for p in signature.parameters.values() if p.name != "self"]) < _EXPERTS_ARGUMENTS:
        raise ValueError(
            f"ep_size={ep_size}: {name}.{experts_name}.forward takes {list(signature.parameters)[1:]}, not the "
            "(hidden_states, top_k_index, top_k_weights) that the dispatch hands it. Use ep_size=1."
        )
    if count % ep_size:
        good = [n for n in range(1, count + 1) if count % n == 0]
        raise ValueError(
            f"ep_size={ep_size}: {name}.{experts_name} has {count} experts, not divisible by ep_size={ep_size}, so "
            f"they cannot be split evenly over the EP ranks. Use an ep_size that divides {count}: one of {good}."
        )
    split = {w.rpartition(".")[2] for w in weights if w.rpartition(".")[0] == experts_name}
    whole = [p for p, param in experts.named_parameters(recurse=True) if p not in split]
    if whole:
        raise ValueError(
            f"ep_size={ep_size}: {name}.{experts_name} holds {whole}, which its expert-parallel plan does not split "
            "with the experts: each rank would apply it to other experts' tokens. Use ep_size=1."
        )
    for param_name in split:
        shape = tuple(getattr(experts, param_name).shape)
        if shape[0] != count:
            raise ValueError(
                f"ep_size={ep_size}: {name}.{experts_name}.{param_name} has shape {shape}, whose first dim is not its "
                f"{count} experts, so it cannot be split by expert. Use ep_size=1."
            )


def apply_expert_parallel(module: nn.Module, plan: ResolvedPlan, *, ep_mesh: DeviceMesh, tp_mesh: DeviceMesh) -> None:
    """Split each experts module's weights over ``ep_mesh`` (``Shard(0)``: a slice of the local copy, no
    communication, so every rank must hold the same weights) and route its tokens there; record its load.

    Transformers' style replaces the experts module's ``forward`` (an instance attribute): its dispatch takes the
    place of the experts' own loop, which no hook can do. ``tp_mesh`` is the group of ranks holding the same tokens,
    of which each sends a slice.
    """
    names = plan.expert_modules
    for name in names:
        experts = module.get_submodule(name)
        setattr(experts, _TOTAL_ATTRIBUTE, experts.num_experts)  # Transformers sets `num_experts` to the local count
    transformers_apply_expert_parallelism()(module, ep_mesh, tp_mesh, dict(plan.experts), "auto")
    for name in names:
        experts = module.get_submodule(name)
        experts.register_forward_pre_hook(_record_load)
        # Before FSDP2's own (registered later): its pre-backward hook on a view output would be lost to an in-place
        # op of the caller (`out += shared_expert(x)`), skipping the backward all-gather. The dispatch's TP gather
        # returns a view; a copy of one layer's hidden states is cheap.
        experts.register_forward_hook(_not_a_view)


def _record_load(experts: nn.Module, args: tuple[Any, ...]) -> None:
    """Tokens of this rank per (global) expert, in this forward: a histogram on the device, no host sync. Kept, not
    summed: the recomputation of activation checkpointing repeats the same counts."""
    if len(args) < _EXPERTS_ARGUMENTS or not isinstance(args[1], torch.Tensor):
        return
    index = args[1]
    if hasattr(index, "to_local"):
        index = index.to_local()
    total = getattr(experts, _TOTAL_ATTRIBUTE)
    with torch.no_grad():
        load = torch.zeros(total, dtype=torch.float32, device=index.device)
        ones = torch.ones(index.numel(), dtype=torch.float32, device=index.device)  # fp32 whatever the default dtype
        load.scatter_add_(0, index.reshape(-1).long(), ones)
    setattr(experts, LOAD_ATTRIBUTE, load)


def _not_a_view(experts: nn.Module, args: Any, output: Any) -> Any:
    if isinstance(output, torch.Tensor) and is_view(output):
        return output.clone()
    return None


def expert_load(model: nn.Module) -> dict[str, torch.Tensor]:
    """Each expert-parallel experts module's tokens per expert in its last forward (this rank's tokens, before they
    were sent), by module name. Sum them over the data-parallel ranks for the whole batch's load.

    Args:
        model: a model parallelised with ``ep_size > 1`` (or a module holding one); empty otherwise.

    Raises:
        Nothing of its own: a model without expert parallelism gives an empty dict.
    """
    return {name: load for name, m in model.named_modules() if (load := getattr(m, LOAD_ATTRIBUTE, None)) is not None}


def check_expert_mesh(mesh: DeviceMesh, expert_mesh: DeviceMesh) -> None:
    """Every TP group inside one EP group (the dispatch slices the TP group's shared batch among its ranks), read
    from the meshes' rank tables, so every rank decides the same (a user's mesh may order its ranks otherwise)."""
    names, expert_names = tuple(mesh.mesh_dim_names or ()), tuple(expert_mesh.mesh_dim_names or ())
    tp, ep = mesh.size(names.index("tp")), expert_mesh.size(expert_names.index("ep"))
    ep_groups = [set(row) for row in expert_mesh.mesh.reshape(-1, ep).tolist()]
    for row in mesh.mesh.reshape(-1, tp).tolist():
        if not any(set(row) <= group for group in ep_groups):
            raise ValueError(
                f"The TP group {row} is not inside one EP group of the expert mesh ({sorted(map(sorted, ep_groups))}): "
                "the ranks of a TP group share one batch, which the expert dispatch splits among them. Build the mesh "
                "with `ParallelLayout(...).build_device_mesh(...)` (TP innermost), or pass the sizes."
            )


def shard_experts(
    module: nn.Module, plan: ResolvedPlan, *, expert_mesh: DeviceMesh, layout: ParallelLayout, **fsdp_options: Any
) -> None:
    """FSDP2 on each experts module, over the ranks holding the same experts (``efsdp``; HSDP with
    ``dp_replicate``), before the blocks around it are sharded over the dense mesh.

    FSDP2 divides a unit's gradients by the ranks it reduces over (``dp_replicate x efsdp``), but a rank's experts
    got the tokens of ``ep / tp`` batches (its EP group's TP groups), so their gradient sums the losses of
    ``dp_replicate x dp_shard x cp`` batches over the unit: that is the divisor, as for every dense parameter.
    FSDP2 applies a divisor other than the group size as NCCL's pre-multiplied sum, which gloo rejects and which NCCL
    zeroes in bf16 up to torch 2.13 (pytorch/pytorch#190747): reduce with a sum and divide after. Not on one rank:
    there FSDP2 divides its copy of the gradient already, and would divide twice."""
    axes = (DP_REPLICATE_AXIS, EFSDP_AXIS) if layout.dp_replicate_size > 1 else EFSDP_AXIS
    for name in plan.expert_modules:
        experts = apply_fsdp(module.get_submodule(name), expert_mesh[axes], blocks=set(), **fsdp_options)
        experts.set_gradient_divide_factor(float(layout.fsdp_size))
        if layout.efsdp_size > 1:
            experts.set_force_sum_reduction_for_comms(True)


__all__ = [
    "EP_STYLES",
    "apply_expert_parallel",
    "check_expert_mesh",
    "expert_load",
    "resolve_expert_plan",
    "shard_experts",
]
