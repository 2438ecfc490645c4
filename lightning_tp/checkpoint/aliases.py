"""One name in a checkpoint for a tensor that has several: an input embedding tied to the head
(``tie_word_embeddings``) is one parameter under two names, and under pipeline parallelism the last stage's head holds
a copy of the first stage's embedding.

torch's ``get_optimizer_state_dict`` keeps a shared parameter's state under one of its names, picked from a ``set``:
the pick follows the process's string hashes, so two processes (the run that saves, the run that resumes; two ranks of
one run) may pick differently, and a resume then asks for a name the checkpoint does not hold. Here every alias is
written and read under the *canonical* name, the first of ``named_parameters()``'s (the input embedding's, as one
process's ``model.parameters()`` keeps it), which any layout and any process agree on.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from lightning_tp.parallel.pipeline import pipeline_runner

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
        runner = pipeline_runner(module)
        tied = runner.tied if runner is not None else None
        if tied is not None:
            prefix = f"{path}." if path else ""
            aliases[f"{prefix}{tied.head}.weight"] = f"{prefix}{tied.embedding}.weight"
    return aliases


def renamed(state: Mapping[str, Any], names: Mapping[str, str]) -> dict[str, Any]:
    """An optimizer state dict (nested or flat) with each parameter name in ``names`` replaced by its value."""
    if not names:
        return dict(state)
    if isinstance(state.get("state"), Mapping):  # nested: {"state": {name: ...}, "param_groups": [{"params": [...]}]}
        groups = [{**group, "params": [names.get(n, n) for n in group["params"]]} for group in state["param_groups"]]
        return {**state, "state": {names.get(k, k): v for k, v in state["state"].items()}, "param_groups": groups}
    out = {}
    for key, value in state.items():
        prefix = next((p for p in _FLAT_PREFIXES if key.startswith(p)), None)
        if prefix is not None:
            name, _, entry = key[len(prefix) :].rpartition(".")
            key = f"{prefix}{names.get(name, name)}.{entry}"
        out[key] = value
    return out


def parameter_names(state: Mapping[str, Any]) -> set[str]:
    """The parameter names an optimizer state dict (nested or flat) holds."""
    if isinstance(state.get("state"), Mapping):
        return set(state["state"]) | {n for group in state["param_groups"] for n in group["params"]}
    return {
        key[len(prefix) :].rpartition(".")[0] for key in state for prefix in _FLAT_PREFIXES if key.startswith(prefix)
    }


def optimizer_state_dict(root: nn.Module, optimizer: torch.optim.Optimizer, *, options: Any) -> dict[str, Any]:
    """torch's ``get_optimizer_state_dict``, every alias under its canonical name."""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    return renamed(get_optimizer_state_dict(root, optimizer, options=options), parameter_aliases(root))
