"""Sequence parallelism and loss parallelism: rewriting a resolved Transformers plan.

With plain TP every rank holds the whole ``(batch, seq, hidden)`` activation between the TP regions (norms, residual
adds), and each region ends in an all-reduce. With sequence parallelism (Megatron-SP, as in torchtitan) the activations
between regions are split on the sequence dim: each region starts with an all-gather (sequence shards to the whole
sequence) and ends with a reduce-scatter (partial sums to sequence shards), the same bytes as the all-reduce it
replaces, and the norms, residuals and their saved activations take 1/tp of the memory. Transformers' own
``sequence_parallel`` style is not wired up (5.24), so the plan is rewritten here with torch's styles:

- each decoder layer's column-wise projections become ``ColwiseParallel`` and its row-wise ones
  ``RowwiseParallel(output_layouts=Shard(1))`` (the reduce-scatter);
- the parent of each row-wise projection (``self_attn``, ``mlp``) gathers its input once (:class:`GatherSequence`),
  and keeps it a DTensor so that the backward of that gather is a reduce-scatter of the partial gradients;
- the first decoder layer cuts its (replicated) input into sequence shards (:class:`ShardSequence`, no communication):
  the embedding stays replicated so that Transformers computes the attention mask and positions from the whole
  sequence;
- the norms between the regions see one sequence shard each: their gradients are summed over the TP group;
- the final norm gathers its output, so the model's hidden states, ``logits_to_keep`` and ``lm_head`` see the whole
  sequence.

With loss parallelism ``lm_head`` keeps its output sharded on the vocabulary and the cross-entropy runs on the shards
(:mod:`lightning_tp.parallel.loss_parallel`).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import ParallelStyle, RowwiseParallel, parallelize_module

from lightning_tp.parallel.tensor_parallel import (
    decoder_layers,
    layer_entries,
    on_hidden_states,
    region_problem,
    rewrite_layer_styles,
    text_decoder_layers,
)
from lightning_tp.plans.resolve import ResolvedPlan

SEQUENCE_DIM = 1


class SequenceSplit:
    """Whether the model's current forward runs on sequence shards: decided by :class:`ShardSequence` at the first
    decoder layer, read by the other hooks of the same model. A forward whose length ``tp_size`` does not divide
    (a decoding step of ``generate``, say) runs unsplit outside training, on whole sequences: correct, without the
    memory saving. In training such a length is an error.

    ``agree_group``: the data-parallel group, when there is one. Data-parallel ranks see different batches, so a
    length one of them cannot split must stop them all (the others would wait in FSDP2's collectives until the
    timeout): in training the ranks exchange their lengths (one all-reduce of ``dp_size`` integers per forward) and
    all raise the same error."""

    def __init__(self, agree_group: dist.ProcessGroup | None = None) -> None:
        self.active = True
        self.agree_group = agree_group


class GatherSequence(ParallelStyle):
    """The module's ``hidden_states`` (first positional argument or keyword) arrive as sequence shards and enter as
    the whole sequence, a replicated DTensor (all-gather; its backward reduce-scatters the partial gradients)."""

    def __init__(self, split: SequenceSplit) -> None:
        super().__init__()
        self.split = split

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        def gather(local: Any) -> Any:
            if not self.split.active:
                return DTensor.from_local(local, device_mesh, [Replicate()], run_check=False)
            return DTensor.from_local(local, device_mesh, [Shard(SEQUENCE_DIM)], run_check=False).redistribute(
                device_mesh, [Replicate()]
            )

        module.register_forward_pre_hook(on_hidden_states(gather), with_kwargs=True)
        return module


class ScatterSequence(ParallelStyle):
    """``RowwiseParallel`` whose partial sums are reduce-scattered into sequence shards (all-reduced in an unsplit
    forward)."""

    def __init__(self, split: SequenceSplit) -> None:
        super().__init__()
        self.split = split

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        parallelize_module(
            module, device_mesh, RowwiseParallel(output_layouts=Shard(SEQUENCE_DIM), use_local_output=False)
        )

        def to_local(module: nn.Module, args: Any, output: DTensor) -> Any:
            # A copy, not `to_local()`'s view: some models add to the output in place (Falcon's parallel attention),
            # which autograd refuses on a view a custom Function returned.
            if self.split.active:
                return output.to_local().clone()
            return output.redistribute(device_mesh, [Replicate()]).to_local().clone()

        module.register_forward_hook(to_local)
        return module


class GatherOutput(ParallelStyle):
    """The final norm's output, sequence shards, is gathered into the whole sequence (a plain tensor): the model's
    ``last_hidden_state``, ``logits_to_keep`` and the head then see every position."""

    def __init__(self, split: SequenceSplit) -> None:
        super().__init__()
        self.split = split

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        def gather(module: nn.Module, args: Any, output: Any) -> Any:
            if not self.split.active:
                return output
            whole = DTensor.from_local(output, device_mesh, [Shard(SEQUENCE_DIM)], run_check=False)
            return whole.redistribute(device_mesh, [Replicate()]).to_local()

        module.register_forward_hook(gather)
        return module


class ShardSequence(ParallelStyle):
    """The module's replicated ``hidden_states`` enter as this rank's sequence shard (a local slice; its backward
    all-gathers the gradient). Decides :class:`SequenceSplit` for the whole forward."""

    def __init__(self, split: SequenceSplit) -> None:
        super().__init__()
        self.split = split

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        def shard(local: Any) -> Any:
            length, tp_size = local.shape[SEQUENCE_DIM], device_mesh.size()
            self.split.active = length % tp_size == 0
            if module.training and torch.is_grad_enabled():
                _raise_on_every_rank_if_undivisible(length, tp_size, group=self.split.agree_group, device=local.device)
            if not self.split.active:
                return local
            return (
                DTensor.from_local(local, device_mesh, [Replicate()], run_check=False)
                .redistribute(device_mesh, [Shard(SEQUENCE_DIM)])
                .to_local()
            )

        module.register_forward_pre_hook(on_hidden_states(shard), with_kwargs=True)
        return module


def _raise_on_every_rank_if_undivisible(
    length: int, tp_size: int, *, group: dist.ProcessGroup | None, device: torch.device
) -> None:
    """Raise the same ValueError on every rank of ``group`` (and, since the ranks of a TP group hold the same batch,
    on every rank) when any of them has a sequence length ``tp_size`` does not divide. Without a group (no data
    parallelism) the length is this rank's and its TP group's alone."""
    bad = {0: length} if length % tp_size else {}
    if group is not None:
        # One tiny all-reduce (dp_size integers) at the same point of every rank's forward: all ranks have run the
        # same collectives so far, so all of them reach it and all take the same decision.
        lengths = torch.zeros(dist.get_world_size(group), dtype=torch.int64, device=device)
        if length % tp_size:
            lengths[dist.get_rank(group)] = length
        dist.all_reduce(lengths, op=dist.ReduceOp.MAX, group=group)
        bad = {rank: int(n) for rank, n in enumerate(lengths.tolist()) if n}
    if not bad:
        return
    where = ""
    if group is not None and len(bad) == 1:
        where = f" (data-parallel rank {next(iter(bad))})"
    elif group is not None:
        where = " (data-parallel ranks " + ", ".join(f"{rank}: {n}" for rank, n in bad.items()) + ")"
    raise ValueError(
        f"sequence_parallel=True splits the sequence over the TP ranks, but the sequence length "
        f"{next(iter(bad.values()))}{where} is not divisible by tp_size={tp_size}. Pad every batch to a multiple of "
        f"{tp_size}: `pad_to_multiple_of={tp_size}` in the tokenizer or collator (e.g. "
        f"`DataCollatorWithPadding(tokenizer, pad_to_multiple_of={tp_size})`). Every rank raises this error."
    )


def sequence_parallel_plan(
    model: nn.Module,
    plan: ResolvedPlan,
    *,
    blocks: set[type],
    agree_group: dist.ProcessGroup | None = None,
) -> ResolvedPlan:
    """``plan`` rewritten for sequence parallelism (see the module docstring). ``blocks``: the classes of the decoder
    layers. Refuses, naming the module and style, what sequence parallelism cannot rewrite. ``agree_group``: the
    data-parallel group over which training forwards agree on whether the sequence splits (see
    :class:`SequenceSplit`)."""
    styles: dict[str, Any] = dict(plan.styles)
    grad_allreduce = list(plan.grad_allreduce)
    split = SequenceSplit(agree_group)
    # The language model's stack only: a vision tower planned too runs on its patches with plain TP.
    layers = text_decoder_layers(model, decoder_layers(model, styles, blocks))
    if not layers:
        classes = sorted(b.__name__ for b in blocks)
        raise ValueError(
            f"sequence_parallel=True needs the decoder layers of {type(model).__name__} (classes {classes}), and "
            "found none. Pass `fsdp_blocks=[<decoder layer class>]`, or drop `sequence_parallel`."
        )
    problems = [problem for layer in layers if (problem := region_problem(styles, layer))]
    if not problems:
        problems = [problem for layer in layers if (problem := _outside_regions(model, styles, layer))]
    if problems:
        raise ValueError(f"sequence_parallel=True rewrites column-wise/row-wise pairs, but {problems[0]}.")
    for index, layer in enumerate(layers):
        regions = rewrite_layer_styles(
            styles, layer, rowwise=lambda: ScatterSequence(split), region=lambda: GatherSequence(split)
        )
        if index == 0:
            styles[layer] = ShardSequence(split)
        # Replicated parameters outside the regions (the norms) see one sequence shard each.
        inside = layer_entries(plan.styles, layer)
        for name, module in model.get_submodule(layer).named_modules(prefix=layer):
            if any(name == r or name.startswith(f"{r}.") for r in regions) or name in inside:
                continue
            if any(True for _ in module.parameters(recurse=False)):
                grad_allreduce.append(name)
    norms = _norms_after_layers(model, layers, styles)
    if len(norms) != 1:
        raise ValueError(
            f"sequence_parallel=True gathers the sequence after the final norm, but found {norms or 'none'} "
            f"after the decoder layers of {type(model).__name__}."
        )
    grad_allreduce += norms
    styles[norms[0]] = GatherOutput(split)
    return replace(plan, styles=styles, grad_allreduce=grad_allreduce)


def _outside_regions(model: nn.Module, styles: dict[str, Any], layer: str) -> str | None:
    """A module of the layer with parameters that would run on sequence shards and is not a norm (an attention the
    plan leaves whole, say), or ``None``."""
    regions = {key.rsplit(".", 1)[0] for key, style in layer_entries(styles, layer).items() if style == "rowwise"}
    for name, child in model.get_submodule(layer).named_children():
        path = f"{layer}.{name}"
        if path in regions or "norm" in type(child).__name__.lower() or not any(True for _ in child.parameters()):
            continue
        inside = [r for r in regions if r.startswith(f"{path}.")]
        if inside and all(any(p.startswith(f"{r}.") for r in inside) for p, _ in child.named_parameters(prefix=path)):
            continue  # a wrapper around a region (GPT-Neo's `attn` around `attn.attention`), nothing else in it
        return f"{path!r} ({type(child).__name__}) would run on sequence shards; only norms can"
    return None


def _norms_after_layers(model: nn.Module, layers: list[str], styles: dict[str, Any]) -> list[str]:
    """Modules with parameters that run on the last layer's output shards: the final norm, among the modules
    registered after the list of layers (Bloom's embedding norm, registered before it, runs before the layers)."""
    base, list_name, _ = layers[-1].rsplit(".", 2)  # "model.layers.N" -> "model", "layers"
    found = []
    children = list(model.get_submodule(base).named_children())
    after = [i for i, (name, _) in enumerate(children) if name == list_name][0] + 1
    for name, module in children[after:]:
        path = f"{base}.{name}"
        if path in styles or isinstance(module, nn.ModuleList) or isinstance(module, nn.Embedding):
            continue
        if any(True for _ in module.parameters()):
            found.append(path)
    return found
