"""The private names of torch outside ``torch.distributed`` that lightning_tp uses, each with why: fused ops with no
public spelling, ``nn.Module``'s and tensors' private state (parameters, buffers, child slots, forward hooks, views)
and dynamo's compile callbacks and graph count."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

__all__ = [
    "assert_async",
    "foreach_norm",
    "foreach_mul_",
    "parameter_dict",
    "module_slots",
    "buffer_dict",
    "drop_always_called_hooks",
    "has_forward_pre_hook",
    "remove_forward_hooks",
    "is_view",
    "add_compile_callbacks",
    "compiled_graph_count",
    "TorchDispatchMode",
    "tree_leaves",
    "fake_tensor_mode",
    "DATA_DEPENDENT_ERRORS",
]


def assert_async(condition: torch.Tensor, message: str) -> None:
    """A device-side assert (no host sync on GPU), as torch's own losses check their targets; no public spelling."""
    torch._assert_async(condition, message)


def foreach_norm(tensors: list[torch.Tensor], norm_type: float, *, dtype: torch.dtype) -> list[torch.Tensor]:
    """One norm per tensor in one fused kernel, what ``torch.nn.utils.clip_grad_norm_`` runs itself; the public
    ``get_total_norm`` reduces them to one number, and we combine norms of several meshes ourselves."""
    return torch._foreach_norm(tensors, norm_type, dtype=dtype)


def foreach_mul_(tensors: list[torch.Tensor], scalar: torch.Tensor) -> None:
    """In-place scaling of many tensors in one kernel (``clip_grad_norm_``'s own step); no public spelling."""
    torch._foreach_mul_(tensors, scalar)


def parameter_dict(module: nn.Module) -> dict[str, Any]:
    """``module._parameters``: name -> parameter held by the module itself. Assigning into it swaps a tensor in
    without ``register_parameter``'s type check (a plain-tensor view in forward) and without hooks; nn.Module has no
    public setter that does."""
    return module._parameters


def module_slots(module: nn.Module) -> list[str]:
    """The names of ``module``'s child slots in registration order, empty ones (``None``) included:
    ``named_children()`` skips those, and a pipeline rank keeps the other stages' modules as ``None`` in their slots,
    whose order still says where a module comes in the whole model."""
    return list(module._modules)


def buffer_dict(module: nn.Module) -> dict[str, Any]:
    """``module._buffers``, for the same reason as :func:`parameter_dict`."""
    return module._buffers


def drop_always_called_hooks(module: nn.Module) -> int:
    """Make ``module``'s forward hooks registered with ``always_call=True`` ordinary ones (run after a forward that
    returns, not after one that raises), emptying its private ``_forward_hooks_always_called``; returns how many.

    Why: dynamo (torch 2.13 to 2.15) guards a compiled module's graph on ``hook_id in
    self._forward_hooks_always_called`` for every submodule with such a hook (``Module._call_impl``), and hook ids are
    one counter for the whole process, so the decoder layers, which share one code object, fail each other's guards:
    one recompilation per layer, and the layers past ``torch._dynamo.config.recompile_limit`` run uncompiled. Inside a
    compiled layer the flag buys nothing: the hooks' mutations (a parameter swapped for its local tensor and put back)
    are side effects dynamo applies after its graph has run, so a graph that raises leaves none behind. No public way
    to unset it: ``RemovableHandle`` removes the hook itself."""
    always_called = module._forward_hooks_always_called
    count = len(always_called)
    always_called.clear()
    return count


def has_forward_pre_hook(module: nn.Module, marker: str) -> bool:
    """Whether ``module`` has a forward pre-hook whose function carries the attribute ``marker`` (one this package
    registered, found without keeping its handle anywhere: the hooks live in the module's private
    ``_forward_pre_hooks``)."""
    return any(getattr(hook, marker, False) for hook in module._forward_pre_hooks.values())


def remove_forward_hooks(module: nn.Module, marker: str) -> int:
    """Remove the forward hooks of ``module`` whose function carries the attribute ``marker`` (hooks this package
    registered, found again without keeping their handles anywhere: torch's public handles are per registration,
    the hooks themselves live in the module's private ``_forward_hooks``); returns how many."""
    hooks = module._forward_hooks
    marked = [key for key, hook in hooks.items() if getattr(hook, marker, False)]
    for key in marked:
        del hooks[key]
        module._forward_hooks_with_kwargs.pop(key, None)
        module._forward_hooks_always_called.pop(key, None)
    return len(marked)


def is_view(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` is a view of another (``Tensor._is_view``: no public spelling)."""
    return tensor._is_view()


def add_compile_callbacks(start: Callable[[], None], end: Callable[[], None]) -> Callable[[], None]:
    """Call ``start`` when torch.compile (dynamo) begins compiling in this process and ``end`` when it is done (the
    outermost compilation: nested ones do not call them again); returns what removes them. torch runs them on the
    compiling thread (``torch._dynamo.callback.callback_handler``, which passes a ``CallbackArgs`` dropped here); no
    public registration."""
    from torch._dynamo.callback import callback_handler

    def on_start(*_args: Any) -> None:
        start()

    def on_end(*_args: Any) -> None:
        end()

    callback_handler.register_start_callback(on_start)
    callback_handler.register_end_callback(on_end)

    def remove() -> None:
        callback_handler.remove_start_callback(on_start)
        callback_handler.remove_end_callback(on_end)

    return remove


def compiled_graph_count() -> int:
    """The graphs dynamo has built in this process so far (``torch._dynamo.utils.counters["stats"]["unique_graphs"]``;
    ``torch.compiler.reset()`` does not clear it): a recompilation builds one more. torch has no public count."""
    from torch._dynamo.utils import counters

    return counters["stats"]["unique_graphs"]


# The dry run (lightning_tp.dryrun) watches a step at the dispatcher, on fake tensors. torch keeps these under private
# modules in every version this package supports (torchtitan's estimation and torch's own ``CommDebugMode`` and
# ``MemTracker`` use the same): ``TorchDispatchMode``, the base class of a mode that sees every operation, and
# ``tree_leaves``, which flattens an operation's nested arguments.
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402
from torch.utils._pytree import tree_leaves  # noqa: E402


def fake_tensor_mode() -> Any:
    """A ``FakeTensorMode`` in which tensors carry shapes, dtypes and devices but no data, real tensors (a mesh's
    rank map, a model's constants) taken in as fake ones."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    return FakeTensorMode(allow_non_fake_inputs=True)


def _data_dependent_errors() -> tuple[type[Exception], ...]:
    from torch._subclasses.fake_tensor import DataDependentOutputException, DynamicOutputShapeException

    return (DataDependentOutputException, DynamicOutputShapeException)


#: What a fake tensor raises where an operation needs its values (``.item()``, ``nonzero``).
DATA_DEPENDENT_ERRORS = _data_dependent_errors()
