"""Forward hooks shared by the parallel styles: a module's parameters seen through a view during each call, a
module's ``hidden_states`` input passed through a function, and a model's training forward kept from building a KV
cache."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from lightning_tp.compat import has_forward_pre_hook, parameter_dict

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


#: The attribute that marks :func:`no_cache_under_grad`'s hook (installed once per model, found on the model).
_NO_CACHE_MARKER = "_lightning_tp_no_cache_under_grad"


def no_cache_under_grad(model: nn.Module) -> bool:
    """Make ``model``'s forwards under autograd (a training step's) build no KV cache unless the caller asks for one.

    A Transformers model's ``use_cache`` defaults to its config's, ``True`` for most causal LMs, so
    ``model(input_ids, labels=labels)`` in a training step builds a ``DynamicCache`` that nothing reads: memory for
    every layer's keys and values, and under ``torch.compile`` one guard per layer on the lazily initialised cache
    layer it writes (``cache.layers[i].is_initialized``), so that each decoder layer recompiles the shared layer code
    and the layers past dynamo's ``recompile_limit`` run uncompiled. Transformers already turns the cache off in a
    training forward under its own gradient checkpointing; this does it for every forward under grad.

    A forward pre-hook (with kwargs) passes ``use_cache=False`` when gradients are enabled and the caller gave
    ``use_cache`` neither by keyword nor by position (``None`` counts as not given: it means the config's). Forwards
    without grad (validation, ``generate``, which passes ``use_cache`` itself) are left as they are, and so is an
    explicit ``use_cache=True``. "Under grad", not ``model.training``: a model loaded with ``from_pretrained`` is in
    eval mode and Lightning keeps a submodule's mode, so it trains in eval mode.

    Args:
        model: a module whose ``forward`` takes a ``use_cache`` parameter (others are left alone).

    Returns:
        Whether the hook was installed now: ``False`` when ``model`` already has it or its forward takes no
        ``use_cache``.
    """
    if has_forward_pre_hook(model, _NO_CACHE_MARKER):
        return False
    parameters = list(inspect.signature(type(model).forward).parameters.values())[1:]  # without `self`
    if "use_cache" not in [p.name for p in parameters]:  # not one taken through `**kwargs`: it may not reach a cache
        return False
    positional = [p.name for p in parameters if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    position = positional.index("use_cache") if "use_cache" in positional else None

    def hook(_module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
        if not torch.is_grad_enabled() or kwargs.get("use_cache") is not None:
            return None
        if position is not None and len(args) > position:  # given by position
            return None
        return args, {**kwargs, "use_cache": False}

    setattr(hook, _NO_CACHE_MARKER, True)
    model.register_forward_pre_hook(hook, with_kwargs=True)
    return True
