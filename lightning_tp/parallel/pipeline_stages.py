"""A rank's pipeline stages: the modules it keeps (the others set to ``None`` in their parents, under their own
names) and the stand-ins with which the model's own forward runs one stage (:class:`PipelineStageModule`).
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import AbstractContextManager, nullcontext
from contextvars import ContextVar
from typing import Any

import torch
from torch import nn

from lightning_tp.parallel.pipeline_plan import PipelinePlan
from lightning_tp.parallel.router_loss import RouterTotals, last_stage_router_loss, router_statistics

#: The router statistics of the runner's call, set around its schedule where the model adds a router loss and
#: computes its own loss (read by the last stage).
ROUTER_TOTALS: ContextVar[RouterTotals | None] = ContextVar("lightning_tp_router_totals", default=None)

#: What the runner gives every stage besides them, split by micro-batch as well: the micro-batch's token ids (a stage
#: after the first sizes the model's inputs by the whole sequence, which it receives cut by sequence or context
#: parallelism), its labels and the batch's labelled tokens, one copy per row (the last stage's model computes the
#: loss).
TOKENS_KWARG, LABELS_KWARG, ITEMS_KWARG = "stage_input_ids", "labels", "num_items_in_batch"


# ---------------------------------------------------------------------------------------------------------------------
# Keeping a rank's stages


def keep_stages(model: nn.Module, plan: PipelinePlan, stages: Sequence[int]) -> None:
    """Set every module that none of ``stages`` holds to ``None`` in its parent, so this rank keeps (and later
    shards, materialises and saves) only its stages' modules, under their own names."""
    held = {name for stage in stages for name in plan.modules_of(stage)}
    everything = {n for s in range(plan.num_stages) for n in plan.modules_of(s)}
    for name in sorted(everything - held):
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, child, None)  # keeps the slot (and the other layers' indices), unlike `del`


class _StageDone(Exception):  # noqa: N818 (control flow, not an error)
    """Raised by the stand-in after a stage's last layer: carries that layer's output out of the model's forward."""

    def __init__(self, hidden: torch.Tensor) -> None:
        super().__init__()
        self.hidden = hidden


def plain_attributes(layer: nn.Module) -> dict[str, Any]:
    """What the model's forward may read of a decoder layer besides calling it (Nemotron-H's loop reads
    ``layer.block_type``): its public attributes of plain types, kept for the layers a rank does not hold."""
    plain = (str, int, float, bool, type(None))
    return {k: v for k, v in vars(layer).items() if not k.startswith("_") and isinstance(v, plain)}


class _Placeholder:
    """What a layer before the stage's first one returns: the loop around the layers may take it as the hidden states,
    index it (``outputs[0]``) or unpack it (``hidden, weights = layer(...)``); it reaches no computation, since the
    stage's first layer takes the received activation instead (see :class:`_Receiver`)."""

    def __getitem__(self, index: int) -> Any:
        return self if index == 0 else None

    def __iter__(self) -> Any:
        return iter((self, None))


class _StandIn(nn.Module):
    """A layer this stage does not hold, for one call, with its plain attributes: before the stage's layers it returns
    a :class:`_Placeholder`; the one after them (``stop``) takes its input as the stage's output and ends the forward
    (:class:`_StageDone`), or where the model's own outputs are needed (``last``: the stage's last layer, recording
    its output) it and the later ones return what that layer returned, and the forward runs to its end.

    ``layer``: the layer it stands for where this rank holds it (another of its stages), never called: kept in the
    model's tree during the call, which then holds each of the rank's modules once, as outside it (Transformers
    installs its output-recording hooks, the routers' logits among them, by walking the tree at the first call that
    records)."""

    def __init__(
        self, attributes: dict[str, Any], *, stop: bool, last: _Receiver | None = None, layer: nn.Module | None = None
    ) -> None:
        super().__init__()
        self.__dict__.update(attributes)
        self.stop, self.stood_for = stop, layer
        self.__dict__["last"] = last  # not a child: the layer is in the tree where it runs
        self.output: torch.Tensor | None = None

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if self.stop:
            hidden = args[0] if args else kwargs["hidden_states"]
            if self.last is None:
                raise _StageDone(hidden)
            self.output = hidden
        if self.last is not None:
            return self.last.output
        return _Placeholder()


class _Skipped(nn.Module):
    """The final norm, for one call of a stage before the last that runs the model's forward to its end: its input
    unchanged. Holds the norm where this rank holds it (see :class:`_StandIn`'s ``layer``)."""

    def __init__(self, norm: nn.Module | None) -> None:
        super().__init__()
        self.stood_for = norm

    def forward(self, hidden: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        return hidden


class _Receiver(nn.Module):
    """The stage's first layer, for one call, given the activation received from the previous stage as its hidden
    states (``received``; ``None``: its own input); it returns what the layer returns, to the model's own loop
    (whatever form that takes), and keeps it (``output``)."""

    def __init__(self, layer: nn.Module, received: torch.Tensor | None) -> None:
        super().__init__()
        self.layer, self.received = layer, received
        self.output: Any = None

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self.layer, name)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if self.received is not None and args:
            args = (self.received, *args[1:])
        elif self.received is not None:
            kwargs = {**kwargs, "hidden_states": self.received}
        self.output = self.layer(*args, **kwargs)
        return self.output


class PipelineStageModule(nn.Module):
    """One stage of a pipelined model, the module torch's ``PipelineStage`` runs: ``forward(x, **batch_kwargs)``
    takes the stage's input (the micro-batch's ``input_ids`` on the first stage, the previous stage's activation on the
    others) and returns the next stage's input, or on the last stage the micro-batch's share of the loss as the
    model's forward computes it from ``labels`` (its loss function, with what sequence, context and loss parallelism
    installed there), or the logits without labels (a custom pipeline loss). Its parameters are the stage's own
    (registered here too, for FSDP2 and torch's stage); the model keeps them under their own names."""

    def __init__(self, model: nn.Module, plan: PipelinePlan, stage: int) -> None:
        super().__init__()
        object.__setattr__(self, "model", model)  # not a child: the model's names stay its own
        self.stage, self.plan = stage, plan
        self.is_first, self.is_last = stage == 0, stage == plan.num_stages - 1
        self.parts = nn.ModuleDict(
            {name.replace(".", "__"): model.get_submodule(name) for name in plan.modules_of(stage)}
        )
        # Read while the model holds every layer (before `keep_stages`): the stand-ins of the others carry them.
        self.layer_attributes = [plain_attributes(layer) for layer in model.get_submodule(plan.layer_list)]

    def forward(self, x: torch.Tensor, *received: torch.Tensor, **kwargs: Any) -> Any:
        """``received``: the earlier stages' router statistics of the micro-batch, where the model adds a router loss
        (:attr:`PipelinePlan.router`); a stage before the last then returns its activation and the statistics with
        its own layers' added."""
        model, plan = self.model, self.plan
        tokens = kwargs.pop(TOKENS_KWARG, None)
        labels = kwargs.pop(LABELS_KWARG, None)
        items = kwargs.pop(ITEMS_KWARG, None)
        router_stats = received[0] if received else None
        # The routers' logits are an output of the model's forward: a stage before the last that adds them to the
        # statistics runs the forward to its end (the norm skipped), not stopping after its last layer.
        collect = plan.router is not None and not self.is_last
        layers = model.get_submodule(plan.layer_list)
        held = plan.layers[self.stage]
        # The layer list's slots (`None` for the layers other ranks hold), replaced for the call and put back after.
        saved = [layers[index] for index in range(len(layers))]
        receivers = {held.start: _Receiver(saved[held.start], x)} if not self.is_first else {}
        if collect:
            receivers.setdefault(held.stop - 1, _Receiver(saved[held.stop - 1], None))
        last = receivers[held.stop - 1] if collect else None
        stop = None
        for index in range(len(saved)):
            if index in receivers:
                layers[index] = receivers[index]
            elif index not in held:
                after = last if index >= held.stop else None
                attributes = self.layer_attributes[index]
                stand_in = _StandIn(attributes, stop=index == held.stop, last=after, layer=saved[index])
                stop = stand_in if index == held.stop else stop
                layers[index] = stand_in
        norm_parent, _, norm_name = plan.norm.rpartition(".")
        norm_owner = model.get_submodule(norm_parent) if collect else None
        norm = getattr(norm_owner, norm_name) if collect else None
        if collect:
            setattr(norm_owner, norm_name, _Skipped(norm))
        if self.is_first:
            inputs = {"input_ids": x}
        else:
            # Stand-in embeddings of the whole sequence (the received activation replaces them at the first layer):
            # the model computes masks and positions from them, and cuts them as it cut the first stage's.
            shape = x.shape if tokens is None else (*tokens.shape[:2], *x.shape[2:])
            inputs = {"inputs_embeds": torch.zeros(shape, dtype=x.dtype, device=x.device)}
        try:
            if self.is_last:
                # The causal LM's own forward (its class's: the instance's runs the pipeline) gives the logits, and
                # the loss, as one process computes them (scaling, soft-capping, the loss function's wrappers).
                if labels is None:  # a custom pipeline loss (refused where the model adds a router loss)
                    return type(model).forward(model, **inputs, **kwargs).logits
                loss_kwargs = {LABELS_KWARG: labels, ITEMS_KWARG: items[0] if items is not None else None}
                with self._router_loss(router_stats, labels):
                    # One element, not a scalar: torch's evaluation concatenates the micro-batches' outputs.
                    return type(model).forward(model, **inputs, **kwargs, **loss_kwargs).loss.reshape(1)
            base = model.get_submodule(plan.layer_list.rpartition(".")[0])
            outputs = base(**inputs, **kwargs)
        except _StageDone as done:
            return done.hidden
        finally:
            for index, layer in enumerate(saved):
                layers[index] = layer
            if collect:
                setattr(norm_owner, norm_name, norm)
        assert collect and stop is not None and plan.router is not None, f"stage {self.stage} ran past its last layer"
        hidden = stop.output
        assert hidden is not None, f"stage {self.stage}'s forward did not reach the layer after its last"
        router = plan.router
        mask = kwargs.get("attention_mask")
        stats = router_statistics(
            tuple(outputs.router_logits or ()), router.num_experts, router.top_k, mask, device=hidden.device
        )
        return hidden, stats if router_stats is None else stats + router_stats

    def _router_loss(self, received: torch.Tensor | None, labels: torch.Tensor) -> AbstractContextManager[None]:
        """Around the last stage's model forward: the router loss it adds is the whole batch's (see
        :class:`~lightning_tp.parallel.router_loss.RouterTotals`). The micro-batch is told by where its labels start
        in the batch's (torch cuts the batch into views; its shape inference's copy of the first micro-batch's labels
        shares their memory), which needs no read of the device. The runner put the labels on the stage's device
        already, so FSDP2's root, which moves a stage's inputs there, hands on the same views."""
        if self.plan.router is None:
            return nullcontext()
        totals = ROUTER_TOTALS.get()
        assert totals is not None, "the last stage of a router loss run outside its runner's call"
        return last_stage_router_loss(self.model, received, totals, microbatch=labels.data_ptr())


__all__ = [
    "PipelineStageModule",
    "keep_stages",
]
