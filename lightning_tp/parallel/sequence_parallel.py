"""Sequence parallelism and loss parallelism: rewriting a resolved Transformers plan.

With plain TP every rank holds the whole ``(batch, seq, hidden)`` activation between the TP regions (norms, residual
adds), and each region ends in an all-reduce. With sequence parallelism (Megatron-SP, as in torchtitan) the activations
between regions are split on the sequence dim: each region starts with an all-gather (sequence shards to the whole
sequence) and ends with a reduce-scatter (partial sums to sequence shards), the same bytes as the all-reduce it
replaces, and the norms, residuals and their saved activations take 1/tp of the memory. Transformers' own
``sequence_parallel`` style is not wired up (5.24), so the plan is rewritten with torch's styles
(:func:`lightning_tp.plans.rewrite.rewrite_for_sequence_parallel`, given this module's):

- each decoder layer's column-wise projections become ``ColwiseParallel`` and its row-wise ones
  ``RowwiseParallel(output_layouts=Shard(1))`` (the reduce-scatter);
- the parent of each row-wise projection (``self_attn``, ``mlp``) gathers its input once (:class:`GatherSequence`),
  and keeps it a DTensor so that the backward of that gather is a reduce-scatter of the partial gradients;
- the first decoder layer cuts its (replicated) input into sequence shards (:class:`ShardSequence`, no communication),
  padded with zero rows to a multiple of the TP size (any length splits, :class:`SequenceSplit`): the embedding stays
  replicated so that Transformers computes the attention mask and positions from the whole sequence;
- the norms between the regions see one sequence shard each: their gradients are summed over the TP group;
- the final norm gathers its output, so the model's hidden states, ``logits_to_keep`` and ``lm_head`` see the whole
  sequence.

With loss parallelism ``lm_head`` keeps its output sharded on the vocabulary and the cross-entropy runs on the shards
(:mod:`lightning_tp.parallel.loss_parallel`).
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
from torch.distributed.tensor.parallel import ParallelStyle, RowwiseParallel, parallelize_module

from lightning_tp.parallel.hooks import on_hidden_states
from lightning_tp.plans.resolved import ResolvedPlan
from lightning_tp.plans.rewrite import rewrite_for_sequence_parallel

SEQUENCE_DIM = 1


class SequenceSplit:
    """The sequence split of the model's current forward, decided by :class:`ShardSequence` at the first decoder layer
    and read by the other hooks of the same model: ``length``, the sequence's own length, and ``padding``, the rows
    added at its end so that ``tp_size`` divides it (a length of 15 at TP 2: 16 rows, 8 per rank).

    Any length splits, in training and in decoding steps of ``generate`` alike: the padded rows are zeros, stay zeros
    through the residual stream (each region's output is cut back to the real rows before its row-wise layer, and
    padded with zeros after), and are cut off wherever the whole sequence is gathered (each region's input, the final
    norm's output). Causal attention never reads them (they come last, and the regions see the real rows only), and
    their gradients are zero. No rank needs another's length: nothing is agreed, no collective, no host sync.

    Activation checkpointing runs each layer's forward again in the backward, last layer first, possibly after other
    forwards (of other lengths) changed the current split: there each later layer records, at its call, the split its
    input was made with (:meth:`record`), and its children restore it when they are given that same input again
    (the recomputation replays the layer's forward on its saved input, without the layer's own hooks):
    :class:`FollowSplit`."""

    def __init__(self) -> None:
        self.length = 0
        self.padding = 0
        #: id of a later layer's input -> (the input, weakly; the split it was made with).
        self._made_with: dict[int, tuple[weakref.ref, int, int]] = {}

    def record(self, hidden: torch.Tensor) -> None:
        """At a later layer's call on ``hidden``: remember the current split as the one ``hidden`` was made with."""
        self._made_with = {key: value for key, value in self._made_with.items() if value[0]() is not None}
        self._made_with[id(hidden)] = (weakref.ref(hidden), self.length, self.padding)

    def restore(self, hidden: torch.Tensor) -> None:
        """Where ``hidden`` is a later layer's input (recorded), take the split it was made with again."""
        entry = self._made_with.get(id(hidden))
        if entry is not None and entry[0]() is hidden:
            self.length, self.padding = entry[1], entry[2]


class GatherSequence(ParallelStyle):
    """The module's ``hidden_states`` (first positional argument or keyword) arrive as sequence shards and enter as
    the whole sequence (its padding cut off), a replicated DTensor (all-gather; its backward reduce-scatters the
    partial gradients)."""

    def __init__(self, split: SequenceSplit) -> None:
        super().__init__()
        self.split = split

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        def gather(local: Any) -> Any:
            whole = DTensor.from_local(local, device_mesh, [Shard(SEQUENCE_DIM)], run_check=False).redistribute(
                device_mesh, [Replicate()]
            )
            return whole.narrow(SEQUENCE_DIM, 0, self.split.length) if self.split.padding else whole

        module.register_forward_pre_hook(on_hidden_states(gather), with_kwargs=True)
        return module


class ScatterSequence(ParallelStyle):
    """``RowwiseParallel`` whose partial sums (padded with zero rows to the split length) are reduce-scattered into
    sequence shards."""

    def __init__(self, split: SequenceSplit) -> None:
        super().__init__()
        self.split = split

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        parallelize_module(module, device_mesh, RowwiseParallel(output_layouts=Partial(), use_local_output=False))

        def scatter(module: nn.Module, args: Any, output: DTensor) -> Any:
            if self.split.padding:
                # Each rank's partial sums, padded: every rank's output gradient is the whole one (replicated).
                local = _pad_sequence(output.to_local(grad_placements=[Replicate()]), self.split.padding)
                output = DTensor.from_local(local, device_mesh, [Partial()], run_check=False)
            # A copy, not `to_local()`'s view: some models add to the output in place (Falcon's parallel attention),
            # which autograd refuses on a view a custom Function returned.
            return output.redistribute(device_mesh, [Shard(SEQUENCE_DIM)]).to_local().clone()

        module.register_forward_hook(scatter)
        return module


class GatherOutput(ParallelStyle):
    """The module's output (the final norm's, or a pipeline stage's last decoder layer's: the first element of a
    tuple), sequence shards, is gathered into the whole sequence (a plain tensor, its padding cut off): the model's
    ``last_hidden_state``, ``logits_to_keep`` and the head, or the next pipeline stage, then see every position."""

    def __init__(self, split: SequenceSplit) -> None:
        super().__init__()
        self.split = split

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        def gather(module: nn.Module, args: Any, output: Any) -> Any:
            if isinstance(output, tuple):
                return (gather(module, args, output[0]), *output[1:])
            whole = DTensor.from_local(output, device_mesh, [Shard(SEQUENCE_DIM)], run_check=False)
            local = whole.redistribute(device_mesh, [Replicate()]).to_local()
            return local.narrow(SEQUENCE_DIM, 0, self.split.length) if self.split.padding else local

        module.register_forward_hook(gather)
        return module


class ShardSequence(ParallelStyle):
    """The module's replicated ``hidden_states`` enter as this rank's sequence shard, padded with zero rows to a
    multiple of ``tp_size`` first (a local slice; its backward all-gathers the gradient). Decides
    :class:`SequenceSplit` for the whole forward, from this rank's own length."""

    def __init__(self, split: SequenceSplit) -> None:
        super().__init__()
        self.split = split

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        def shard(local: Any) -> Any:
            length = local.shape[SEQUENCE_DIM]
            self.split.length, self.split.padding = length, -length % device_mesh.size()
            if self.split.padding:
                local = _pad_sequence(local, self.split.padding)
            return (
                DTensor.from_local(local, device_mesh, [Replicate()], run_check=False)
                .redistribute(device_mesh, [Shard(SEQUENCE_DIM)])
                .to_local()
            )

        module.register_forward_pre_hook(on_hidden_states(shard), with_kwargs=True)
        return module


class FollowSplit(ParallelStyle):
    """A decoder layer after the first, under activation checkpointing: its call records the split its input was made
    with, and each of its children, called on that input again in a recomputation, restores it (see
    :class:`SequenceSplit`)."""

    def __init__(self, split: SequenceSplit) -> None:
        super().__init__()
        self.split = split

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        def on_input(act: Any) -> Any:
            def hook(_module: nn.Module, args: tuple, kwargs: dict) -> None:
                hidden = args[0] if args else kwargs.get("hidden_states")
                if isinstance(hidden, torch.Tensor):
                    act(hidden)

            return hook

        module.register_forward_pre_hook(on_input(self.split.record), with_kwargs=True)
        for child in module.children():
            child.register_forward_pre_hook(on_input(self.split.restore), with_kwargs=True)
        return module


class Several(ParallelStyle):
    """Several styles applied to one module, in order."""

    def __init__(self, *styles: ParallelStyle) -> None:
        super().__init__()
        self.styles = styles

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        for style in self.styles:
            module = parallelize_module(module, device_mesh, style)
        return module


def _pad_sequence(hidden: torch.Tensor, rows: int) -> torch.Tensor:
    """``hidden`` ([batch, sequence, ...]) with ``rows`` zero rows added at the end of its sequence."""
    return torch.cat([hidden, hidden.new_zeros(hidden.shape[0], rows, *hidden.shape[2:])], dim=SEQUENCE_DIM)


def sequence_parallel_plan(
    model: nn.Module,
    plan: ResolvedPlan,
    *,
    blocks: set[type],
    recomputed: bool = False,
    stages: Sequence[range] = (),
) -> ResolvedPlan:
    """``plan`` rewritten for sequence parallelism (see the module docstring) with this module's styles, all sharing
    one :class:`SequenceSplit` (:func:`lightning_tp.plans.rewrite.rewrite_for_sequence_parallel`). ``blocks``: the
    classes of the decoder layers. Refuses, naming the module and style, what sequence parallelism cannot rewrite.
    Any sequence length splits (see :class:`SequenceSplit`). ``recomputed``: the layers are recomputed in the backward
    (activation checkpointing), so each later layer follows the split its input was made with. ``stages``: the
    decoder layers of each pipeline stage: the activations between stages are whole (each stage's last layer gathers
    its output, the next stage's first layer cuts it again), so every stage computes its masks and positions from the
    whole sequence, as the first does."""
    split = SequenceSplit()

    def layer(*, first: bool, last: bool) -> ParallelStyle | None:
        styles: list[ParallelStyle] = []
        if first:
            styles.append(ShardSequence(split))
        elif recomputed:
            styles.append(FollowSplit(split))
        if last:
            styles.append(GatherOutput(split))
        return None if not styles else styles[0] if len(styles) == 1 else Several(*styles)

    return rewrite_for_sequence_parallel(
        model,
        plan,
        blocks=blocks,
        rowwise=lambda: ScatterSequence(split),
        region=lambda: GatherSequence(split),
        layer=layer,
        final_norm=lambda: GatherOutput(split),
        stages=stages,
    )
