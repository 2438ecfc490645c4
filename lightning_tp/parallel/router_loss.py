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
whose router logits do not come from a registered model's forward: the decoder stack's forward hook records them, for
the call that follows, in a context variable (per call; nothing global holds a model's state). Each registered
model's first call checks, on every rank together, that the family's function is the formula reimplemented here, and
raises on every rank where it is not.

Under pipeline parallelism the batch is also cut into micro-batches and the layers into stages on other ranks. The
loss's numbers are sums (:func:`router_statistics`), so each stage adds its layers' to the ones it received and passes
them on beside its activation (their gradient comes back the same way), and the last stage hands each micro-batch's to
the call's :class:`RouterTotals`. The gradient of every micro-batch's router probabilities is the whole batch's
``num_experts x f_e / tokens``: it needs every micro-batch's routing, so the schedule must run every forward of the
last stage before its first backward (GPipe, LoopedBFS; the pipeline's plan refuses the others by name). There the
family's function is checked when the plan is resolved, on made-up logits, the same on every rank.
"""

from __future__ import annotations

import sys
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn

from lightning_tp.compat import remove_forward_hooks
from lightning_tp.parallel.collectives import SumOverGroup
from lightning_tp.patches import install, installed

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

#: The name of the function Transformers' MoE modeling files compute the loss with.
FUNCTION_NAME = "load_balancing_loss_func"
#: The wrapper's attribute holding the family's own function (read by tests that want it whatever is installed).
_ORIGINAL = "_lightning_tp_original"

#: The attribute that marks the recording hook on a registered model's decoder stack (found again to replace it).
_HOOK_MARKER = "_lightning_tp_router_hook"


@dataclass(eq=False)
class _Registration:
    """One registered model's router loss: the data-parallel group its tokens are summed over (of ``size`` ranks),
    and whether its family's function was checked against the formula here (at its first loss, on every rank
    together)."""

    group: dist.ProcessGroup
    size: int
    checked: bool = False


@dataclass(frozen=True)
class _Recorded:
    first: weakref.ref  # the forward's first router-logits tensor
    registration: _Registration


#: The router logits of the registered forward that ran last in this context, set by its decoder stack's hook and
#: read by the causal LM's call of the function right after (per call: no model's state outlives its forward here).
_RECORDED: ContextVar[_Recorded | None] = ContextVar("lightning_tp_router_recorded", default=None)


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
    registration = _Registration(dp_mesh.get_group(), dp_mesh.size())
    owner = weakref.ref(model)  # the hook sits inside the model: no reference cycle through it

    def remember(_decoder: nn.Module, _args: Any, output: Any) -> None:
        logits = getattr(output, "router_logits", None)
        model = owner()
        if model is not None and isinstance(logits, tuple) and logits and isinstance(logits[0], torch.Tensor):
            _hold(module, model)  # before the causal LM calls the function, which it looks up by name
            _RECORDED.set(_Recorded(weakref.ref(logits[0]), registration))

    setattr(remember, _HOOK_MARKER, True)
    remove_forward_hooks(decoder, _HOOK_MARKER)  # an earlier registration's
    decoder.register_forward_hook(remember)
    return True


def _hold(module: Any, model: nn.Module) -> None:
    """``module``'s function wrapped (see the module docstring), the patch held by ``model`` among its owners."""
    patch = installed(module, FUNCTION_NAME)
    if patch is None:
        install(module, FUNCTION_NAME, _wrap(getattr(module, FUNCTION_NAME)), owner=model)
    else:
        patch.add_owner(model)


def _wrap(original: Callable[..., Any]) -> Callable[..., Any]:
    def load_balancing_loss_func(gate_logits: Any, num_experts: Any = None, top_k: Any = 2, attention_mask: Any = None):
        stage = _LAST_STAGE.get()
        if stage is not None:
            return _last_stage_loss(stage, gate_logits, attention_mask)
        first = gate_logits[0] if isinstance(gate_logits, tuple) and gate_logits else None
        recorded = _RECORDED.get()
        if recorded is None or first is None or recorded.first() is not first or not isinstance(num_experts, int):
            return original(gate_logits, num_experts, top_k, attention_mask)
        _RECORDED.set(None)  # used once: the registration (and its group) is held no longer than the forward
        registration = recorded.registration
        expected = None
        if not registration.checked:
            with torch.no_grad():
                expected = original(gate_logits, num_experts, top_k, attention_mask)
        loss, _ = global_load_balancing_loss(
            gate_logits,
            num_experts,
            top_k,
            attention_mask,
            group=registration.group,
            size=registration.size,
            expected=expected,
        )
        registration.checked = True
        return loss

    setattr(load_balancing_loss_func, _ORIGINAL, original)
    return load_balancing_loss_func


def router_statistics(
    gate_logits: tuple[torch.Tensor, ...],
    num_experts: int,
    top_k: int,
    attention_mask: torch.Tensor | None,
    *,
    device: torch.device | None = None,
) -> torch.Tensor:
    """What Switch Transformer's loss needs of these layers' router logits, as one fp32 tensor of ``2 x num_experts
    + 1`` numbers (the one layout: :func:`_switch_loss` reads it): the router probabilities summed over the tokens and
    layers (differentiable), the tokens each expert was chosen for, and the number of (token, layer) pairs. Padding
    (``attention_mask`` 0) counts for nothing. Sums, so the statistics of any parts of a batch (ranks, pipeline stages,
    micro-batches) add up to the whole batch's."""
    device = gate_logits[0].device if gate_logits else device
    counts = torch.zeros(num_experts, dtype=torch.float32, device=device)
    probs = torch.zeros(num_experts, dtype=torch.float32, device=device)
    rows = torch.zeros(1, dtype=torch.float32, device=device)
    mask = attention_mask.reshape(-1).to(device=device, dtype=torch.float32) if attention_mask is not None else None
    for layer in gate_logits:
        weights = torch.softmax(layer.to(device), dim=-1)
        chosen = torch.topk(weights, top_k, dim=-1).indices.reshape(-1)
        per_row = torch.ones(weights.shape[0], dtype=torch.float32, device=device) if mask is None else mask
        counts = counts.scatter_add(0, chosen, per_row.repeat_interleave(top_k))
        probs = probs + (weights.float() * per_row.unsqueeze(-1)).sum(dim=0)
        rows = rows + per_row.sum()
    return torch.cat([probs, counts, rows])


def _switch_loss(stats: torch.Tensor, num_experts: int) -> torch.Tensor:
    """``num_experts x sum_e f_e P_e`` of :func:`router_statistics`' numbers."""
    probs, counts, rows = stats[:num_experts], stats[num_experts : 2 * num_experts], stats[2 * num_experts]
    return num_experts * torch.sum((counts / rows) * (probs / rows))


def _switch_gradient(stats: torch.Tensor, num_experts: int) -> torch.Tensor:
    """The gradient of :func:`_switch_loss` with respect to its numbers (the counts are not differentiable: the
    probabilities' part alone)."""
    counts, rows = stats[num_experts : 2 * num_experts], stats[2 * num_experts]
    gradient = torch.zeros_like(stats)
    gradient[:num_experts] = num_experts * counts / (rows * rows)
    return gradient


def _differs(local: torch.Tensor, expected: torch.Tensor) -> bool:
    """Whether the family's own loss is not the formula's (on the same tokens)."""
    return not torch.allclose(local.detach(), expected.float(), rtol=1e-4, atol=1e-6)


#: Raised (on every rank together) when a family's function is not the formula reimplemented here.
_NOT_SWITCH = (
    "The model's `load_balancing_loss_func` is not Switch Transformer's loss that lightning_tp computes over the whole "
    "batch of the data-parallel ranks and pipeline micro-batches, so its value would differ from one process's. Train "
    "it without data or pipeline parallelism, or with `output_router_logits=False`."
)


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
    stats = router_statistics(gate_logits, num_experts, top_k, attention_mask)
    local = _switch_loss(stats, num_experts)
    mismatch = torch.zeros(1, device=stats.device)
    if expected is not None and _differs(local, expected):
        mismatch += 1
    if group is None:
        return local, local
    # One all-reduce: the probability sums (differentiable) with the counts, the token total and the check's flag.
    counts_and_rows = stats[num_experts:].detach()
    total = SumOverGroup.apply(torch.cat([stats[:num_experts], counts_and_rows, mismatch]), group, size)
    if expected is not None and total[-1] > 0:  # read on the host on the checked (first) call only
        raise ValueError(_NOT_SWITCH)
    return _switch_loss(total[:-1], num_experts), local


# ---------------------------------------------------------------------------------------------------------------------
# Under pipeline parallelism


@dataclass(frozen=True)
class PipelinedRouterLoss:
    """A pipelined model's router loss, read from the causal LM before anything moves: what its forward passes to
    ``load_balancing_loss_func`` (the number of experts and how many each token is routed to) and the loss's weight
    in the model's loss (``router_aux_loss_coef``)."""

    num_experts: int
    top_k: int
    coefficient: float


def pipelined_router_loss(model: nn.Module) -> PipelinedRouterLoss | None:
    """The router loss ``model`` adds (``config.output_router_logits``), or ``None``. Its modeling module's function
    is checked here against the formula the stages compute, on made-up router logits (with and without padding):
    the same answer on every rank, before anything moves.

    Raises:
        ValueError: the model adds one but its modeling module has no such function, the function is not Switch
            Transformer's loss, or the causal LM does not say the numbers its forward gives that function.
    """
    config = getattr(model, "config", None)
    if not getattr(config, "output_router_logits", False):
        return None
    values = {
        name: getattr(model, name, getattr(config, name, None))
        for name in ("num_experts", "num_experts_per_tok", "router_aux_loss_coef")
    }
    module = router_loss_module(model)
    numbers = all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values.values())
    if module is None or not numbers:
        raise ValueError(
            f"{type(model).__name__} adds its routers' load-balancing loss (`output_router_logits=True`), but its "
            f"modeling module has no `{FUNCTION_NAME}` or its causal LM does not give {sorted(values)} as numbers "
            f"({values}), which a pipeline needs to add every stage's part. Set `config.output_router_logits=False` "
            "or use pp_size=1."
        )
    spec = PipelinedRouterLoss(
        num_experts=int(values["num_experts"]),
        top_k=int(values["num_experts_per_tok"]),
        coefficient=float(values["router_aux_loss_coef"]),
    )
    function = getattr(module, FUNCTION_NAME)
    function = getattr(function, _ORIGINAL, function)
    generator = torch.Generator().manual_seed(0)
    logits = tuple(torch.randn(6, spec.num_experts, generator=generator) for _ in range(2))  # 2 layers, 2 x 3 tokens
    for mask in (None, torch.tensor([[0, 1, 1], [1, 1, 1]])):
        expected = function(logits, spec.num_experts, spec.top_k, mask)
        stats = router_statistics(logits, spec.num_experts, spec.top_k, mask)
        if not isinstance(expected, torch.Tensor) or _differs(_switch_loss(stats, spec.num_experts), expected):
            raise ValueError(_NOT_SWITCH)
    return spec


class RouterTotals:
    """One pipelined call's router statistics on the last stage: each micro-batch's (its stages' layers added on
    their way through the pipeline), by micro-batch, and once every micro-batch has run, the whole batch's, summed
    over the data-parallel ranks (``group``, ``None`` without data parallelism, of ``size`` ranks) in one all-reduce.
    Every micro-batch's router loss is the whole batch's: its value is counted once, after the schedule
    (:meth:`loss`), and its gradient taken when the backward reaches it (:class:`_WholeBatchLoss`), after the last
    micro-batch's forward (the plan refuses schedules that run a backward first).

    By micro-batch, not by call: torch's stages infer their shapes with a forward and a backward of the first
    micro-batch's inputs before the schedule runs, whose statistics the first micro-batch's then replace."""

    def __init__(
        self, spec: PipelinedRouterLoss, *, microbatches: int, group: dist.ProcessGroup | None, size: int
    ) -> None:
        self.spec, self.microbatches, self.group, self.size = spec, microbatches, group, size
        self._parts: dict[int, torch.Tensor] = {}
        self._total: torch.Tensor | None = None

    def put(self, microbatch: int, stats: torch.Tensor) -> None:
        self._parts[microbatch] = stats.detach()
        self._total = None

    def total(self) -> torch.Tensor | None:
        """The whole batch's statistics, or ``None`` before every micro-batch has run (the all-reduce over the
        data-parallel ranks, at the first call after the last micro-batch)."""
        if self._total is None and len(self._parts) == self.microbatches:
            total = torch.stack([self._parts[index] for index in sorted(self._parts)]).sum(dim=0)
            if self.group is not None:
                dist.all_reduce(total, group=self.group)
            self._total = total
        return self._total

    def loss(self) -> torch.Tensor:
        """The whole batch's router loss, weighted as the model weighs it (once every micro-batch has run)."""
        total = self.total()
        assert total is not None, "the router loss read before the pipeline's last micro-batch"
        return self.spec.coefficient * _switch_loss(total, self.spec.num_experts)


class _WholeBatchLoss(torch.autograd.Function):
    """A micro-batch's router statistics in, nothing out (the value is the whole batch's, counted once by
    :meth:`RouterTotals.loss`); the backward gives the statistics the whole batch's loss's gradient, times the
    data-parallel group's size (FSDP2's average of the ranks' gradients then sums their parts, as
    :class:`~lightning_tp.parallel.collectives.SumOverGroup` does)."""

    @staticmethod
    def forward(ctx, stats, totals, microbatch):  # type: ignore[override]
        totals.put(microbatch, stats)
        ctx.totals, ctx.shape = totals, stats.shape
        return stats.new_zeros(())

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        totals = ctx.totals
        total = totals.total()
        if total is None:  # torch's shape inference, before the schedule: only the gradient's shape counts
            return grad.new_zeros(ctx.shape), None, None
        return _switch_gradient(total, totals.spec.num_experts) * (grad * totals.size), None, None


@dataclass(frozen=True)
class _LastStageCall:
    received: torch.Tensor | None  # the earlier stages' statistics of this micro-batch
    totals: RouterTotals
    microbatch: int


#: Set around the last stage's model forward: its call of ``load_balancing_loss_func`` adds its own layers' part to
#: the earlier stages' and hands the micro-batch to the call's totals.
_LAST_STAGE: ContextVar[_LastStageCall | None] = ContextVar("lightning_tp_router_last_stage", default=None)


@contextmanager
def last_stage_router_loss(
    model: nn.Module, received: torch.Tensor | None, totals: RouterTotals, *, microbatch: int
) -> Iterator[None]:
    """Around the last stage's forward of a micro-batch of pipelined ``model``: the router loss it computes is the
    whole batch's (see :class:`RouterTotals`). ``received``: the earlier stages' statistics of the micro-batch;
    ``microbatch``: what tells it from the call's other micro-batches (any number, the same for a repeat of one)."""
    module = router_loss_module(model)
    assert module is not None, "a pipelined router loss without its modeling module's function"
    _hold(module, model)
    token = _LAST_STAGE.set(_LastStageCall(received, totals, microbatch))
    try:
        yield
    finally:
        _LAST_STAGE.reset(token)


def _last_stage_loss(call: _LastStageCall, gate_logits: Any, attention_mask: Any) -> torch.Tensor:
    """The wrapped function on a pipeline's last stage (see :func:`last_stage_router_loss`), with the numbers the
    plan read from the model (:func:`pipelined_router_loss`), whose function it checked."""
    spec = call.totals.spec
    logits = tuple(gate_logits) if isinstance(gate_logits, (tuple, list)) else ()
    device = call.received.device if call.received is not None else None
    stats = router_statistics(logits, spec.num_experts, spec.top_k, attention_mask, device=device)
    if call.received is not None:
        stats = stats + call.received
    return _WholeBatchLoss.apply(stats, call.totals, call.microbatch)


__all__ = [
    "PipelinedRouterLoss",
    "RouterTotals",
    "global_load_balancing_loss",
    "install_global_router_loss",
    "last_stage_router_loss",
    "pipelined_router_loss",
    "router_loss_module",
    "router_statistics",
]
