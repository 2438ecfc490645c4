"""A sharded model's weights streamed out whole, one tensor at a time, in Transformers' names: what an inference
engine loads after each training step (GRPO's rollouts), without writing a directory.

Each tensor is gathered over the ranks that hold it (the gather of ``save_pretrained``:
:func:`~lightning_tp.parallel.gather.whole_tensor`, in slices where the tensor is large), handed to the caller on the
target ranks, and dropped before the next: no rank holds more than one whole tensor beyond its shards, plus the
buffers of one slice's gather (a few times ``chunk_bytes``: measured on gloo, up to 4.25 of them on torch 2.13 and
5.5 on torch 2.15) and a LoRA layer's adapters, whole. The adapters are merged into the gathered base weight in
place, slice by slice (PEFT's own delta, in fp32, as :func:`~lightning_tp.save_merged` computes it).

Never a hang when a rank's own loop stops: before each tensor (and once after the last) the ranks agree, in one small
all-reduce over the whole job, that none has stopped (a rank whose loop raised, or broke off, closes its stream, which
tells the others), so every other rank raises instead of waiting in a gather that rank never joins. (A failure inside
a gather itself, a device out of memory, is the collective's own: the process group's timeout ends it.) Under
pipeline parallelism each stage's ranks stream their own stages' tensors, and the ranks take as many turns as the
stage with the most.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Literal

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Shard

from lightning_tp.checkpoint.publish import arrive_together, on_every_rank
from lightning_tp.compat import distributed_is_initialized, is_strided_shard, strided_split_factor
from lightning_tp.layout import CP_AXIS, DP_REPLICATE_AXIS, DP_SHARD_AXIS, TP_AXIS
from lightning_tp.parallel.collectives import collective_device
from lightning_tp.parallel.gather import CHUNK_BYTES, whole_tensor
from lightning_tp.parallel.lora import adapter_keys, check_mergeable, delta_weights, merged_weight
from lightning_tp.parallel.pipeline import pipeline_runner
from lightning_tp.parallel.pipeline_tied import counted_on_another_stage
from lightning_tp.plans.discovery import peft_models, transformers_models
from lightning_tp.state import parallel_state

_STOPPED_ELSEWHERE = (
    "`stream_weights` stopped on another rank before its end (its loop raised or broke off): every rank must iterate "
    "the stream to its end. See that rank's error."
)

#: Which ranks receive the tensors: every rank; the first rank of each data-parallel replica (tp and cp coordinate 0:
#: under pipeline parallelism, of each stage); or one rank per stage (also data-parallel coordinate 0).
TARGETS = ("all", "replicas", "first")


@dataclass(frozen=True)
class _Item:
    """One tensor of the stream: its Transformers name, the tensor (a shard or a plain tensor), and for a LoRA base
    weight its layer and adapters (keys of :func:`adapter_keys` to tensors)."""

    name: str
    tensor: torch.Tensor
    layer: nn.Module | None = None
    adapters: Mapping[str, torch.Tensor] | None = None


def stream_weights(
    model: nn.Module,
    *,
    targets: Literal["all", "replicas", "first"] = "all",
    merge_lora: bool = True,
    consumer_tp: tuple[int, int] | None = None,
    device: torch.device | str | None = None,
    chunk_bytes: int | None = None,
) -> Iterator[tuple[str, torch.Tensor]]:
    """The whole weights of a model sharded by this package (or of a plain one), one tensor at a time, as
    ``(name, tensor)`` pairs under the names of the model's own ``save_pretrained`` (a tied weight once, under its
    first name). Call it on every rank and iterate to the end on every rank (the non-target ranks get nothing but take
    part in each gather); see the module's docstring for memory and failures. A tensor already whole on the yielding
    device (a replicated one, or any tensor of a model on one process) may be the model's own storage: copy it
    before changing it.

    Args:
        model: the model (a Transformers model or a ``PeftModel``) set up by a strategy or
            :func:`lightning_tp.parallelize`, or a module holding one.
        targets: the ranks the tensors are yielded on (:data:`TARGETS`): ``"all"``; ``"replicas"``, the first rank of
            each data-parallel replica (each feeding an engine of its own); ``"first"``, one rank (one per pipeline
            stage).
        merge_lora: a ``PeftModel``'s active LoRA adapters merged into their base weights (what ``merge_and_unload``
            gives); ``False``: the base weights as they are (the reference of a LoRA policy), adapters left out.
        consumer_tp: ``(size, rank)`` of a consumer sharded with its own tensor parallelism: each tensor split by
            this package's plan is cut the same way (its split dim, its packed blocks each cut) into ``size`` parts and
            part ``rank`` yielded; a tensor the plan keeps whole is yielded whole.
        device: where the yielded tensors are (default: the device the model computes on).
        chunk_bytes: the largest slice gathered at once (default
            :data:`~lightning_tp.parallel.gather.CHUNK_BYTES`).

    Raises:
        ValueError: ``targets`` is unknown, ``consumer_tp`` is not ``(size, rank)`` with ``0 <= rank < size`` or a
            split dim does not divide by its size (naming the tensor), or an adapter cannot be merged; raised on every
            rank before the first collective.
        RuntimeError: not every rank called it, or another rank's stream stopped early (its loop raised or broke
            off): raised at the next tensor instead of waiting for that rank.
    """
    if targets not in TARGETS:
        raise ValueError(f"`targets` must be one of {TARGETS}, got {targets!r}.")
    if consumer_tp is not None:
        size, rank = consumer_tp
        if not (isinstance(size, int) and isinstance(rank, int) and size >= 1 and 0 <= rank < size):
            raise ValueError(f"`consumer_tp` must be (size, rank) with 0 <= rank < size, got {consumer_tp!r}.")
    distributed = distributed_is_initialized() and dist.get_world_size() > 1
    if distributed:
        arrive_together("`stream_weights`")
    items = _items(model, merge_lora=merge_lora)  # checks each stage's adapters on every rank alike
    on_every_rank(lambda: _check_consumer(items, consumer_tp), what="stream_weights")
    receive = _is_target(model, targets)
    device = torch.device(device) if device is not None else _compute_device(model)
    turns = len(items)
    if distributed and pipeline_runner(model) is not None:  # each stage its own count: as many turns as the most
        count = torch.tensor([turns], dtype=torch.int64, device=collective_device(None))
        dist.all_reduce(count, op=dist.ReduceOp.MAX)
        turns = int(count.item())
    return _stream(
        items,
        turns=turns,
        receive=receive,
        device=device,
        consumer_tp=consumer_tp,
        chunk=chunk_bytes,
        distributed=distributed,
    )


def _stream(
    items: list[_Item],
    *,
    turns: int,
    receive: bool,
    device: torch.device,
    consumer_tp: tuple[int, int] | None,
    chunk: int | None,
    distributed: bool,
) -> Iterator[tuple[str, torch.Tensor]]:
    finished = False  # or told that another rank stopped: either way this rank has nothing to announce
    try:
        for turn in range(turns):
            if distributed:
                finished = _another_stopped()
                if finished:
                    raise RuntimeError(_STOPPED_ELSEWHERE)
            if turn >= len(items):  # a pipeline stage with fewer tensors than another: a turn to stay in step
                continue
            item = items[turn]
            whole = _gathered(item, keep=receive, device=device, chunk=chunk)
            if whole is None:
                continue
            if consumer_tp is not None:
                whole = _consumer_part(item.tensor, whole=whole, size=consumer_tp[0], rank=consumer_tp[1])
            yield item.name, whole
            del whole  # the caller's reference is all that holds it now
        # One more round: a rank that stops after its last tensor (its loop raised on it) is heard here too.
        finished = True
        if distributed and _another_stopped():
            raise RuntimeError(_STOPPED_ELSEWHERE)
    finally:
        if distributed and not finished:
            # This rank's loop stopped before the end (it raised or broke off, and closed this generator): the others
            # learn it at their next turn instead of waiting for this rank in a gather.
            _another_stopped(stopped=True)


def _another_stopped(*, stopped: bool = False) -> bool:
    """One small all-reduce over the whole job: every rank says whether its stream stopped early (``stopped``: this
    rank's did); whether any did."""
    flag = torch.tensor([1 if stopped else 0], dtype=torch.int64, device=collective_device(None))
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return bool(flag.item())


def _compute_device(model: nn.Module) -> torch.device:
    state = parallel_state(model)
    if state is not None and state.mesh.device_type != "cpu":
        return torch.device(state.mesh.device_type, torch.cuda.current_device())
    first = next(iter(model.parameters()), None)
    return torch.device("cpu") if first is None else first.device


def _is_target(model: nn.Module, targets: str) -> bool:
    """Whether this rank receives the tensors (see :data:`TARGETS`): read from its coordinates on the model's mesh."""
    state = parallel_state(model)
    if targets == "all" or state is None:
        return True
    names = state.mesh.mesh_dim_names or ()
    within = [axis for axis in (CP_AXIS, TP_AXIS) if axis in names]
    if targets == "first":
        within += [axis for axis in (DP_REPLICATE_AXIS, DP_SHARD_AXIS) if axis in names]
    return all(state.mesh.get_local_rank(axis) == 0 for axis in within)


def _items(model: nn.Module, *, merge_lora: bool) -> list[_Item]:
    """The tensors to stream, in state-dict order, under Transformers' names: a tied weight once (under pipeline
    parallelism the last stage's copy of a weight tied across stages left out), a ``PeftModel``'s base model's names
    (``.base_layer.`` dropped, adapters left out or merged). Every rank calls it; under pipeline parallelism each
    stage's adapters are checked on every rank, and every rank raises the first problem found."""
    base = _base_model(model)
    layers: dict[str, nn.Module] = {}
    if base is not model and merge_lora:
        from peft.tuners.lora import LoraLayer

        layers = {n: m for n, m in base.named_modules() if isinstance(m, LoraLayer)}
        on_every_rank(lambda: check_mergeable(layers), what="stream_weights")
    skip = counted_on_another_stage(parallel_state(model))
    state = base.state_dict(keep_vars=True)  # `keep_vars`: one object under each tied name
    seen: set[int] = set()
    items = []
    for key, tensor in state.items():
        if ".lora_" in key or id(tensor) in seen or id(tensor) in skip:
            continue
        seen.add(id(tensor))
        name = key.replace(".base_layer.", ".")
        layer_name = key.rsplit(".base_layer.", 1)[0] if ".base_layer." in key else None
        layer = layers.get(layer_name) if layer_name is not None else None
        if layer is not None and key.endswith(".base_layer.weight"):
            adapters = {k: state[f"{layer_name}.{k}"] for k in adapter_keys(layer)}
            items.append(_Item(name, tensor, layer, adapters))
        else:
            items.append(_Item(name, tensor))
    return items


def _base_model(model: nn.Module) -> nn.Module:
    """The Transformers model whose names are streamed: a ``PeftModel``'s base model, the model itself, or the one
    Transformers (or PEFT) model inside a module holding one (a LightningModule).

    Raises:
        ValueError: the module holds several (a policy and its reference): pass the one to stream.
    """
    peft = peft_models(model)
    inside = {id(m) for outer in peft for m in outer.modules()}
    found = peft + [m for m in transformers_models(model) if id(m) not in inside]
    if len(found) > 1:
        names = {id(m): name for name, m in model.named_modules()}
        raise ValueError(
            f"`stream_weights` was given a module holding several models ({[names[id(m)] for m in found]}): pass the "
            "one to stream (the policy, say: `stream_weights(self.policy)`)."
        )
    if not found:
        return model
    return found[0].get_base_model() if found[0] in peft else found[0]


def _gathered(item: _Item, *, keep: bool, device: torch.device, chunk: int | None) -> torch.Tensor | None:
    """The item's whole tensor on ``device`` where ``keep`` (``None`` elsewhere), LoRA merged in place. Collectives:
    every rank holding a shard calls it."""
    adapters = None
    if item.adapters is not None:  # small (rank r): gathered whole first, on every rank that merges
        adapters = {k: whole_tensor(v, keep=keep, device=device) for k, v in item.adapters.items()}
    whole = whole_tensor(item.tensor, keep=keep, device=device, chunk_bytes=chunk)
    if whole is None or item.layer is None:
        return whole
    assert adapters is not None
    local = item.tensor.to_local() if isinstance(item.tensor, DTensor) else item.tensor
    if whole.untyped_storage().data_ptr() == local.untyped_storage().data_ptr():
        whole = whole.clone()  # the model's own storage (a plain or replicated weight): merged into a copy
    _merge_into(item.layer, whole=whole, adapters=adapters, chunk_bytes=CHUNK_BYTES if chunk is None else chunk)
    return whole


def _merge_into(
    layer: nn.Module, *, whole: torch.Tensor, adapters: Mapping[str, torch.Tensor], chunk_bytes: int
) -> None:
    """Merge ``layer``'s active adapters into its gathered base weight ``whole``, in place: the values
    :func:`~lightning_tp.parallel.lora.merged_weight` gives, computed for slices of ``lora_B``'s rows (each at most
    ``chunk_bytes`` of fp32 delta) so that no second whole tensor is made. A layer whose delta does not lay those
    rows along one dim of the weight (checked on the first slice) is merged whole."""
    b_keys = [k for k in adapters if k.split(".")[0] in ("lora_B", "lora_embedding_B")]
    rows = {adapters[k].shape[0] for k in b_keys}
    total = next(iter(rows)) if len(rows) == 1 else 0
    step = max(1, chunk_bytes // max(1, whole.numel() * 4 // max(total, 1)))  # rows of B per slice of fp32 delta
    if total == 0 or step >= total:
        whole.copy_(merged_weight(layer, base_weight=whole, adapters=adapters))
        return
    dim: int | None = None
    for start in range(0, total, step):
        length = min(step, total - start)
        deltas = delta_weights(
            layer, adapters={k: v.narrow(0, start, length) if k in b_keys else v for k, v in adapters.items()}
        )
        if dim is None:
            dim = _delta_dim(whole.shape, deltas[0].shape, length)
            if dim is None:  # not laid out along B's rows: the whole delta at once
                whole.copy_(merged_weight(layer, base_weight=whole, adapters=adapters))
                return
        piece = whole.narrow(dim, start, length)
        merged = piece.float()
        for delta in deltas:
            merged = merged + delta
        piece.copy_(merged.to(whole.dtype))


def _delta_dim(shape: torch.Size, delta: torch.Size, length: int) -> int | None:
    """The dim of a weight of ``shape`` that a delta of ``delta``'s shape, computed from ``length`` rows of B, covers
    a slice of (the others whole), or ``None``."""
    for dim in range(len(shape)):
        expected = list(shape)
        expected[dim] = length
        if list(delta) == expected:
            return dim
    return None


def _tp_split(tensor: torch.Tensor) -> tuple[int, int] | None:
    """The dim a tensor's tensor-parallel placement splits, and how many blocks it packs there (``_StridedShard``'s
    split factor: q|k|v, gate|up), or ``None`` for a tensor kept whole across the tp axis."""
    if not isinstance(tensor, DTensor):
        return None
    names = tensor.device_mesh.mesh_dim_names or ()
    if TP_AXIS not in names:
        return None
    placement = tensor.placements[names.index(TP_AXIS)]
    if is_strided_shard(placement):
        return placement.dim, strided_split_factor(placement)
    if isinstance(placement, Shard):
        return placement.dim, 1
    return None


def _check_consumer(items: list[_Item], consumer_tp: tuple[int, int] | None) -> None:
    """Refuse a consumer tp size that does not divide a split dim (each packed block of it), naming the tensor."""
    if consumer_tp is None:
        return
    size = consumer_tp[0]
    for item in items:
        split = _tp_split(item.tensor)
        if split is None:
            continue
        dim, blocks = split
        if item.tensor.shape[dim] % (blocks * size):
            raise ValueError(
                f"`consumer_tp` size {size} does not divide {item.name!r} (dim {dim} of {tuple(item.tensor.shape)}"
                f"{f', {blocks} packed blocks' if blocks > 1 else ''}): give the engine a tensor-parallel size that "
                "divides it, or stream whole tensors (consumer_tp=None) and let the engine cut them."
            )


def _consumer_part(tensor: torch.Tensor, *, whole: torch.Tensor, size: int, rank: int) -> torch.Tensor:
    """Part ``rank`` of ``size`` of ``whole`` (the gathered ``tensor``), cut as this package's plan cuts ``tensor`` on
    the tp axis: along its split dim, each packed block cut alike; whole where the plan keeps it whole."""
    split = _tp_split(tensor)
    if split is None or size == 1:
        return whole
    dim, blocks = split
    parts = [block.chunk(size, dim=dim)[rank] for block in whole.chunk(blocks, dim=dim)]
    return (parts[0] if blocks == 1 else torch.cat(parts, dim=dim)).contiguous()


__all__ = ["TARGETS", "stream_weights"]
