"""One name in a checkpoint for a tensor that has several: an input embedding tied to the head
(``tie_word_embeddings``) is one parameter under two names, and under pipeline parallelism the last stage's head holds
a copy of the first stage's embedding under the head's name.

torch's ``get_optimizer_state_dict`` names a shared parameter's state by the first of its names in
``named_parameters()`` (the embedding's). A pipeline's last stage holds only the head, so its copy's state would be
written and asked for under the head's name, which a checkpoint of one process or of TP does not hold (a resume from
it on pp 2 fails with "Missing key"), and the other way round. Here every alias is written and read under the
*canonical* name, the first of ``named_parameters()`` on a rank holding the whole model, which every layout agrees on.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import torch
from torch import nn

from lightning_tp.parallel.pipeline import RUNNER_ATTR

#: The prefixes of a flat optimizer state dict's keys (``StateDictOptions(flatten_optimizer_state_dict=True)``):
#: ``state.<parameter>.<entry>`` and ``param_groups.<parameter>.<hyperparameter>``.
_FLAT_PREFIXES = ("state.", "param_groups.")


def parameter_aliases(root: nn.Module) -> dict[str, str]:
    """Every other name of a parameter of ``root`` -> its canonical name: the names one tensor has on this rank
    (``named_parameters(remove_duplicate=False)``), and the head of a pipeline's last stage whose weight is a copy of
    the first stage's tied embedding."""
    names: dict[int, list[str]] = {}
    for name, param in root.named_parameters(remove_duplicate=False):
        names.setdefault(id(param), []).append(name)
    aliases = {alias: every[0] for every in names.values() for alias in every[1:]}
    for path, module in root.named_modules():
        runner = getattr(module, RUNNER_ATTR, None)  # the pipelined model itself, not its ancestors
        tied = runner.tied if runner is not None else None
        if tied is not None:
            prefix = f"{path}." if path else ""
            aliases[f"{prefix}{tied.head}.weight"] = f"{prefix}{tied.embedding}.weight"
    return aliases


def _flat_name(key: str, names: Iterable[str]) -> tuple[str, str, str] | None:
    """``(prefix, name, rest)`` of a flat state dict's key (``state.<name>.<entry...>`` or
    ``param_groups.<name>.<hyperparameter>``) whose parameter is one of ``names`` (a parameter's name has dots, and so
    may an entry of a nested optimizer state, so the names are matched, not the dots counted); else ``None``."""
    for prefix in _FLAT_PREFIXES:
        if key.startswith(prefix):
            rest = key[len(prefix) :]
            for name in names:
                if rest.startswith(f"{name}."):
                    return prefix, name, rest[len(name) :]
    return None


def renamed(state: Mapping[str, Any], names: Mapping[str, str]) -> dict[str, Any]:
    """An optimizer state dict (nested or flat) with each parameter name in ``names`` replaced by its value."""
    if not names:
        return dict(state)
    if isinstance(state.get("state"), Mapping):  # nested: {"state": {name: ...}, "param_groups": [{"params": [...]}]}
        groups = [{**group, "params": [names.get(n, n) for n in group["params"]]} for group in state["param_groups"]]
        return {**state, "state": {names.get(k, k): v for k, v in state["state"].items()}, "param_groups": groups}
    longest_first = sorted(names, key=len, reverse=True)
    out = {}
    for key, value in state.items():
        found = _flat_name(key, longest_first)
        if found is not None:
            prefix, name, rest = found
            key = f"{prefix}{names[name]}{rest}"
        out[key] = value
    return out


def holds(state: Mapping[str, Any], name: str) -> bool:
    """Whether an optimizer state dict (nested or flat) holds parameter ``name``."""
    if isinstance(state.get("state"), Mapping):
        return name in state["state"] or any(name in group["params"] for group in state["param_groups"])
    return any(_flat_name(key, (name,)) is not None for key in state)


def optimizer_state_dict(root: nn.Module, optimizer: torch.optim.Optimizer, *, options: Any) -> dict[str, Any]:
    """torch's ``get_optimizer_state_dict``, every alias under its canonical name."""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    return renamed(get_optimizer_state_dict(root, optimizer, options=options), parameter_aliases(root))
