"""Forward hooks shared by the parallel styles: a module's parameters seen through a view during each call, and a
module's ``hidden_states`` input passed through a function."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from lightning_tp.compat import parameter_dict

#: Set on a module whose call computes nothing with the parameters below it: a pipelined model, whose forward runs the
#: schedule while its stages call the modules themselves. Nothing swaps views in for its whole call, which spans the
#: schedule's backward passes too (a zero-bubble weight pass looks up the stages' parameters then, and must find them).
RUNS_NO_PARAMETERS_ATTR = "_lightning_tp_runs_no_parameters"


def run_on_parameter_views(
    module: nn.Module, views: dict[str, Callable[[torch.Tensor], torch.Tensor]], *, holder: nn.Module | None = None
) -> None:
    """During each call of ``module``, replace the named parameters of ``holder`` (default: ``module``) by
    ``view(parameter)``, and put them back afterwards, also when the forward raises.

    A forward pre-hook swaps, a forward hook with ``always_call=True`` restores (torch runs it on error too; not
    under ``torch.compile``, which does not catch errors inside a module). The restore is prepended so that it runs
    before any other forward hook, as if it ended the forward itself: FSDP2's hook after it may then reshard the
    parameters it put in place (FSDP2's own pre-hook is prepended and runs before the swap). A stack keeps nested
    calls of the same module apart."""
    holder = module if holder is None else holder
    pending: list[tuple[dict[str, Any], dict[str, torch.Tensor]]] = []

    def swap(_module: nn.Module, _args: Any) -> None:
        params = parameter_dict(holder)  # looked up at each call, as the forward read its parameters
        swapped = {}
        for name, view in views.items():
            param = params[name]
            if param is None:
                continue
            swapped[name] = param
            params[name] = view(param)
        pending.append((params, swapped))

    def restore(_module: nn.Module, _args: Any, _output: Any) -> None:
        if pending:  # empty when a pre-hook before `swap` raised
            params, swapped = pending.pop()
            params.update(swapped)

    module.register_forward_pre_hook(swap)
    module.register_forward_hook(restore, prepend=True, always_call=True)


def on_hidden_states(fn: Callable[[Any], Any]) -> Callable[..., tuple[tuple, dict]]:
    """A forward pre-hook (``with_kwargs=True``) that passes the module's ``hidden_states`` through ``fn``."""

    def hook(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        if args:
            return (fn(args[0]), *args[1:]), kwargs
        if "hidden_states" in kwargs:
            return args, {**kwargs, "hidden_states": fn(kwargs["hidden_states"])}
        raise ValueError(f"{type(module).__name__} was called without `hidden_states`; its TP region needs them.")

    return hook
