"""Single-file checkpoints of pipelined models (``save_distributed_checkpoint=False`` with ``pp_size > 1``).

Each rank holds only its stages. To save, every tensor of the model and of its optimizer states is gathered whole
over its stage's ranks, one tensor at a time (as ``save_pretrained`` does); only the pipeline that holds rank 0 keeps
the whole tensors, in host memory, and streams them to rank 0
(:func:`~lightning_tp.parallel.pipeline_gather.gather_stages`), which writes the file one process would write: the
model's state dict under its own keys, and the optimizer's state under each parameter's name (Fabric) or, as
Lightning's Trainer writes it, under the parameter's position in one process's ``parameters()``
(:func:`whole_parameter_order` rebuilds that order from the stages' module trees, which keep every slot). A tied
embedding's state is written once, under its canonical name
(:mod:`lightning_tp.checkpoint.aliases`). Host memory: rank 0 holds the whole file, as one process saving it would,
and each other rank of its pipeline its own stages' share.

To load, every rank reads the file (memory-mapped, as without a pipeline) and takes its own stages' entries: no
broadcast from rank 0, which ranks holding different stages could not follow. Such a file loads on any layout, and a
file of any layout loads on a pipeline. What is missing from the file, or left over, is decided on every rank before
anything loads.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from lightning_tp.checkpoint.aliases import holds, optimizer_state_dict, parameter_aliases, renamed
from lightning_tp.checkpoint.publish import on_every_rank
from lightning_tp.compat import module_slots
from lightning_tp.parallel.gather import whole_tensor
from lightning_tp.parallel.pipeline import pipeline_runner
from lightning_tp.parallel.pipeline_gather import gather_stages

#: Joins a parameter's name and its state's entry into one key for :func:`gather_stages` (a name has no newline).
_JOIN = "\n"


def _pipeline_group(root: nn.Module) -> dist.ProcessGroup | None:
    runner = pipeline_runner(root)
    return runner.pp_mesh.get_group() if runner is not None else None


def _everyone(value: Any, group: dist.ProcessGroup | None) -> list[Any]:
    """``value`` of every rank of ``group`` (``[value]`` without one)."""
    if group is None:
        return [value]
    values: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(values, value, group=group)
    return values


def _position(root: nn.Module, name: str) -> tuple[tuple[int, int], ...]:
    """Where parameter ``name`` comes in ``root.named_parameters()`` of the whole model: the path of slots down the
    module tree (a module's own parameters before its children, the children in their slots' order, empty slots
    included: a pipeline rank keeps the other stages' modules as ``None``)."""
    *path, leaf = name.split(".")
    module, key = root, []
    for part in path:
        key.append((1, module_slots(module).index(part)))
        module = getattr(module, part)
    own = [own_name for own_name, _ in module.named_parameters(recurse=False, remove_duplicate=False)]
    key.append((0, own.index(leaf)))
    return tuple(key)


#: The entries of a parameter group that list its parameters (torch keeps their names too, for an optimizer built
#: from ``named_parameters()``): each stage's own.
_PARAMETER_LISTS = ("params", "param_names")


def _plain(value: Any) -> Any:
    """``value`` comparable across ranks: a tensor by its value (not its device), an object by its type."""
    if isinstance(value, torch.Tensor):
        return value.tolist()
    if isinstance(value, (tuple, list)):
        return tuple(_plain(v) for v in value)
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return type(value).__qualname__


def _hyperparameters(group: Mapping[str, Any]) -> tuple[tuple[str, str], ...]:
    """A parameter group's settings, comparable across ranks."""
    return tuple(sorted((k, repr(_plain(v))) for k, v in group.items() if k not in _PARAMETER_LISTS))


def whole_parameter_order(root: nn.Module) -> list[str]:
    """The names of ``root``'s parameters in the order of one process's ``root.parameters()`` (each tensor once, under
    its first name), over every stage of its pipeline: a collective over the pipeline's ranks (every rank calls it).
    Without a pipeline, ``root``'s own."""
    aliases = parameter_aliases(root)
    local = [(name, _position(root, name)) for name, _ in root.named_parameters() if name not in aliases]
    merged = {name: key for part in _everyone(local, _pipeline_group(root)) for name, key in part}
    return sorted(merged, key=merged.__getitem__)


def _writes(root: nn.Module) -> bool:
    """Whether this rank's pipeline holds rank 0, which writes the file: the one pipeline whose ranks keep the whole
    tensors and send them on."""
    group = _pipeline_group(root)
    return group is None or 0 in dist.get_process_group_ranks(group)


def _gathered(root: nn.Module, tensors: dict[str, torch.Tensor], plain: dict[str, Any]) -> dict[str, Any]:
    """Every stage's ``tensors`` (whole, on the CPU) and ``plain`` values, merged on rank 0 (``{}`` elsewhere): the
    ranks of rank 0's pipeline call it, together."""
    group = _pipeline_group(root)
    merged = gather_stages(root, tensors)
    plains = _everyone(plain, group)
    if group is not None and dist.get_rank(group) != 0:
        return {}
    for part in plains:
        merged.update(part)
    return merged


def full_model_state(root: nn.Module, *, ignore_frozen: bool) -> dict[str, Any]:
    """``root``'s state dict with every stage's whole tensors, on rank 0 (``{}`` on the others).
    Every rank must call it.

    Args:
        root: the module holding the pipelined model (the LightningModule).
        ignore_frozen: leave out parameters that do not require gradients (``save_frozen_weights=False``).
    """
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    sharded = get_model_state_dict(root, options=StateDictOptions(ignore_frozen_params=ignore_frozen))
    keep = _writes(root)
    tensors, plain, seen = {}, {}, {}
    for name, value in sharded.items():
        if not isinstance(value, torch.Tensor):
            plain[name] = value
            continue
        if id(value) not in seen:  # a tied weight held under two names here: gathered once, kept as one tensor
            seen[id(value)] = whole_tensor(value, keep=keep)  # a collective over the stage's ranks
        tensors[name] = seen[id(value)]
    return _gathered(root, tensors, plain) if keep else {}


def full_optimizer_state(root: nn.Module, optimizer: torch.optim.Optimizer, *, by_position: bool) -> dict[str, Any]:
    """``optimizer``'s state over every stage, whole, on rank 0 (``{}`` on the others), as one
    process's: keyed by parameter name, or with ``by_position`` by the parameter's position in one process's
    ``root.parameters()`` (Lightning's Trainer's single files). Every rank must call it.

    Args:
        root: the module the optimizer's parameters belong to (the LightningModule).
        optimizer: the (unwrapped) optimizer.
        by_position: key the state by position, not by name.
    """
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    order = whole_parameter_order(root)  # a collective: before any rank returns early
    sharded = optimizer_state_dict(root, optimizer, options=StateDictOptions())  # aliases under canonical names
    group = _pipeline_group(root)
    groups = _everyone(sharded["param_groups"], group)
    if len({tuple(_hyperparameters(g) for g in part) for part in groups}) > 1:  # the same decision on every rank
        raise ValueError(
            "A single-file checkpoint of a pipelined model writes one optimizer whose parameter groups every stage "
            "shares, but the stages' optimizers have different groups ("
            f"{[[{k: v for k, v in g.items() if k != 'params'} for g in part] for part in groups]}). Build the same "
            "groups on every stage (an empty group is fine), or keep `save_distributed_checkpoint=True`."
        )
    keep = _writes(root)
    tensors: dict[str, torch.Tensor] = {}
    plain: dict[str, Any] = {}
    for name, entries in sharded["state"].items():
        for entry, value in entries.items():
            key = f"{name}{_JOIN}{entry}"
            if isinstance(value, torch.Tensor):
                tensors[key] = whole_tensor(value, keep=keep)  # a collective over the stage's ranks
            else:
                plain[key] = value
    merged = _gathered(root, tensors, plain) if keep else {}
    if group is not None and dist.get_rank() != 0:
        return {}
    state: dict[str, dict[str, Any]] = {}
    for key, value in merged.items():
        name, entry = key.split(_JOIN, 1)
        state.setdefault(name, {})[entry] = value
    position = {name: index for index, name in enumerate(order)}
    param_groups = []
    for index, group in enumerate(groups[0]):
        params = sorted({name for part in groups for name in part[index]["params"]}, key=position.__getitem__)
        merged_group = {**group, "params": params}
        # The names torch keeps beside the parameters (an optimizer built from `named_parameters()`), in their order;
        # left out where a stage's do not pair with its parameters.
        pairs = [(g["params"], g.get("param_names")) for g in (part[index] for part in groups)]
        merged_group.pop("param_names", None)
        if all(names is not None and len(names) == len(ps) for ps, names in pairs):
            named = {p: n for ps, names in pairs for p, n in zip(ps, names, strict=True)}
            merged_group["param_names"] = [named[p] for p in params]
        param_groups.append(merged_group)
    if not by_position:
        return {"state": state, "param_groups": param_groups}
    return {
        "state": {position[name]: entries for name, entries in state.items()},
        "param_groups": [{**group, "params": [position[n] for n in group["params"]]} for group in param_groups],
    }


def load_stage_file(
    checkpoint: dict[str, Any],
    *,
    module_key: str,
    module: nn.Module,
    optimizers: Mapping[str, torch.optim.Optimizer],
    strict: bool,
    optimizer_states_from_list: bool,
    shown: str,
) -> dict[str, Any]:
    """Load a whole-file checkpoint (every rank's copy, read already) into pipelined ``module`` and its optimizers:
    each rank takes its own stages' entries. Returns what is left of ``checkpoint`` (the metadata). Every rank must
    call it.

    Raises:
        ValueError: with ``strict``, the file holds weights that no stage of the model has, or misses some of its
            weights (decided on every rank alike, before anything loads).
        RuntimeError: torch refused some rank's share (an optimizer state missing with ``strict``, a shape that
            differs): raised on every rank.
    """
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    saved = checkpoint.pop(module_key)
    local = set(get_model_state_dict(module))
    everywhere = {name for part in _everyone(sorted(local), _pipeline_group(module)) for name in part}
    for what, names in (
        ("holds weights that no stage of this model has", set(saved) - everywhere),
        ("misses weights of this model", everywhere - set(saved)),
    ):
        if strict and names:
            shown_names = sorted(names)
            raise ValueError(
                f"{shown} {what}: {shown_names[:5]}{' ...' if len(names) > 5 else ''}. Load it into the model it was "
                "written from, or load the weights with `strict_loading = False` on the LightningModule."
            )
    options = StateDictOptions(full_state_dict=True, strict=strict)
    mine = {name: value for name, value in saved.items() if name in local}
    on_every_rank(lambda: set_model_state_dict(module, mine, options=options), what=f"Loading {shown}")
    order = whole_parameter_order(module)  # a collective, on every rank
    aliases = parameter_aliases(module)
    for index, (name, optimizer) in enumerate(optimizers.items()):
        state = checkpoint["optimizer_states"][index] if optimizer_states_from_list else checkpoint.pop(name)
        if any(isinstance(p, int) for group in state["param_groups"] for p in group["params"]):  # one process's
            state = {
                "state": {order[key]: value for key, value in state["state"].items()},
                "param_groups": [{**g, "params": [order[i] for i in g["params"]]} for g in state["param_groups"]],
            }
        state = renamed(state, aliases)  # a file of one process holds a tied weight's state under its first name
        asked = _asked(module, optimizer)
        back = {canonical: alias for alias, canonical in aliases.items() if holds(asked, alias)}
        state = renamed(state, back)
        on_every_rank(
            lambda optimizer=optimizer, state=state: set_optimizer_state_dict(
                module, optimizer, state, options=options
            ),
            what=f"Loading {shown}'s optimizer state",
        )
    if optimizer_states_from_list:
        checkpoint.pop("optimizer_states", None)
    return checkpoint


def _asked(module: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """The names under which torch asks for ``optimizer``'s state on this rank."""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    return get_optimizer_state_dict(module, optimizer)


__all__ = ["full_model_state", "full_optimizer_state", "load_stage_file", "whole_parameter_order"]
