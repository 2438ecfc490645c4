"""The router's load-balancing loss of a mixture-of-experts model, over the whole batch of the data-parallel ranks.

Transformers' MoE causal LMs add ``router_aux_loss_coef x load_balancing_loss_func(router_logits, ...)`` (Switch
Transformer's loss: ``num_experts x sum_e f_e P_e``, ``f_e`` the fraction of tokens routed to expert ``e``, ``P_e``
its mean router probability) when ``output_router_logits`` is on. The loss is a product of two means over the tokens,
so each data-parallel rank's loss over its own rows is not one process's loss over the whole batch, and averaging the
ranks' gradients does not give one process's gradient either. Here each rank's call is replaced, for the models this
package sharded, by the loss over every data-parallel rank's tokens: the token counts, probability sums and token
totals are summed over the group (one all-reduce of ``2 x num_experts + 2`` numbers per forward); the backward
scales by the group's size, so that FSDP2's average over the ranks sums their parts.

The modeling module's ``load_balancing_loss_func`` is wrapped (once per module, by :mod:`lightning_tp.patches`; it is
a module-level function the model's forward calls by name), a patch of the whole process that each registered model
owns: a strategy's teardown gives it up (``undo_owned(model, instances=False)``), so that the module's own function
is back once no registered model holds it, until a registered model runs again. The wrapper changes nothing for a call
whose router logits do not come from a registered model (the decoder stack's forward hook records them). The first
call checks, on every rank together, that the family's function is the formula reimplemented here, and raises on every
rank where it is not.
"""

from __future__ import annotations

import sys
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn

from lightning_tp.parallel.collectives import SumOverGroup
from lightning_tp.patches import install, installed

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

#: The name of the function Transformers' MoE modeling files compute the loss with.
FUNCTION_NAME = "load_balancing_loss_func"
#: The wrapper's attribute holding the family's own function (read by tests that want it whatever is installed).
_ORIGINAL = "_lightning_tp_original"

#: id of the first router-logits tensor of a registered forward -> (the tensor, weakly; the group; its size).
_RECORDED: dict[int, tuple[weakref.ref, dist.ProcessGroup, int]] = {}
#: Modeling modules whose function was checked against the formula here.
_CHECKED: set[str] = set()
#: The decoder stack of each registered model -> its recording hook (replaced when the model is registered again).
_HOOKS: weakref.WeakKeyDictionary[nn.Module, Any] = weakref.WeakKeyDictionary()


def router_loss_module(model: nn.Module) -> Any | None:
    """The modeling module of ``model`` whose ``load_balancing_loss_func`` its forward calls, or ``None``."""
    module = sys.modules.get(type(model).__module__)
    return module if callable(getattr(module, FUNCTION_NAME, None)) else None


def install_global_router_loss(model: nn.Module, dp_mesh: DeviceMesh) -> bool:
    """Make ``model``'s load-balancing loss the whole data-parallel batch's (see the module docstring). The model
    owns the patch of its modeling module's function; a strategy's teardown gives it up
    (:func:`lightning_tp.patches.undo_owned`), and the model takes it again at its next forward (a later ``fit`` of
    the same model, whose setup leaves a sharded model alone). Registering a model again replaces its group. Returns
    whether the model has such a loss."""
    module = router_loss_module(model)
    decoder = getattr(model, "base_model", None)
    if module is None or not isinstance(decoder, nn.Module) or decoder is model:
        return False
    _hold(module, model)
    group, size = dp_mesh.get_group(), dp_mesh.size()
    owner = weakref.ref(model)  # the hook sits inside the model: no reference cycle through it

    def remember(_decoder: nn.Module, _args: Any, output: Any) -> None:
        logits = getattr(output, "router_logits", None)
        model = owner()
        if model is not None and isinstance(logits, tuple) and logits and isinstance(logits[0], torch.Tensor):
            _hold(module, model)  # before the causal LM calls the function, which it looks up by name
            for key in [k for k, (ref, _, _) in _RECORDED.items() if ref() is None]:
                del _RECORDED[key]
            _RECORDED[id(logits[0])] = (weakref.ref(logits[0]), group, size)

    previous = _HOOKS.pop(decoder, None)
    if previous is not None:
        previous.remove()
    _HOOKS[decoder] = decoder.register_forward_hook(remember)
    return True


def _hold(module: Any, model: nn.Module) -> None:
    """``module``'s function wrapped (see the module docstring), the patch held by ``model`` among its owners."""
    patch = installed(module, FUNCTION_NAME)
    if patch is None:
        install(module, FUNCTION_NAME, _wrap(getattr(module, FUNCTION_NAME), module.__name__), owner=model)
    else:
        patch.add_owner(model)


def _wrap(original: Callable[..., Any], module_name: str) -> Callable[..., Any]:
    def load_balancing_loss_func(gate_logits: Any, num_experts: Any = None, top_k: Any = 2, attention_mask: Any = None):
        first = gate_logits[0] if isinstance(gate_logits, tuple) and gate_logits else None
        entry = _RECORDED.get(id(first)) if isinstance(first, torch.Tensor) else None
        if entry is None or entry[0]() is not first or not isinstance(num_experts, int):
            return original(gate_logits, num_experts, top_k, attention_mask)
        _, group, size = entry
        expected = None
        if module_name not in _CHECKED:
            with torch.no_grad():
                expected = original(gate_logits, num_experts, top_k, attention_mask)
        loss, _ = global_load_balancing_loss(
            gate_logits, num_experts, top_k, attention_mask, group=group, size=size, expected=expected
        )
        _CHECKED.add(module_name)
        return loss

    setattr(load_balancing_loss_func, _ORIGINAL, original)
    return load_balancing_loss_func


def global_load_balancing_loss(
    gate_logits: tuple[torch.Tensor, ...],
    num_experts: int,
    top_k: int,
    attention_mask: torch.Tensor | None,
    *,
    group: dist.ProcessGroup | None,
    size: int,
    expected: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Switch Transformer's loss over the tokens of every rank of ``group`` (``None``: this rank's alone), and this
    rank's own loss. ``expected``: the family's own loss on this rank's tokens, checked against this formula with the
    other ranks (one more number in the all-reduce) so that every rank raises together."""
    device = gate_logits[0].device
    counts = torch.zeros(num_experts, dtype=torch.float32, device=device)
    probs = torch.zeros(num_experts, dtype=torch.float32, device=device)
    rows = torch.zeros((), dtype=torch.float32, device=device)
    mask = attention_mask.reshape(-1).to(device=device, dtype=torch.float32) if attention_mask is not None else None
    for layer in gate_logits:
        weights = torch.softmax(layer.to(device), dim=-1)
        chosen = torch.topk(weights, top_k, dim=-1).indices.reshape(-1)
        per_row = torch.ones(weights.shape[0], dtype=torch.float32, device=device) if mask is None else mask
        counts = counts.scatter_add(0, chosen, per_row.repeat_interleave(top_k))
        probs = probs + (weights.float() * per_row.unsqueeze(-1)).sum(dim=0)
        rows = rows + per_row.sum()
    local = num_experts * torch.sum((counts / rows) * (probs / rows))
    mismatch = torch.zeros(1, device=device)
    if expected is not None and not torch.allclose(local.detach(), expected.float(), rtol=1e-4, atol=1e-6):
        mismatch += 1
    if group is None:
        return local, local
    # One all-reduce: the probability sums (differentiable) with the counts, the token total and the check's flag.
    stats = torch.cat([probs, counts.detach(), rows.detach().reshape(1), mismatch])
    stats = SumOverGroup.apply(stats, group, size)
    if expected is not None and stats[-1] > 0:  # read on the host on the checked (first) call only
        raise ValueError(
            "The model's `load_balancing_loss_func` is not Switch Transformer's loss that lightning_tp computes over "
            "the whole data-parallel batch, so its value would differ from one process's. Train it without "
            "data parallelism, or with `output_router_logits=False`."
        )
    probs, counts, rows = stats[:num_experts], stats[num_experts : 2 * num_experts], stats[2 * num_experts]
    return num_experts * torch.sum((counts / rows) * (probs / rows)), local


__all__ = ["global_load_balancing_loss", "install_global_router_loss", "router_loss_module"]
