"""Autograd functions around collectives that more than one technique needs."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Replicate

from lightning_tp.compat import is_view

#: ``tp_grad_reduce_dtype``'s values: the dtype TP sums activation gradients in (``None``: the gradient's own).
TP_GRAD_REDUCE_DTYPES: dict[str | None, torch.dtype | None] = {None: None, "fp32": torch.float32}


class SumsInputGradients:
    """Mixed into the package's TP styles whose backward sums their input's gradient over the TP group (a
    column-wise layer's input, a dense region's, an experts module's): ``grad_reduce_dtype`` is the dtype of that sum
    (``None``: the gradient's own, the compute dtype; set from ``tp_grad_reduce_dtype`` when the style is built)."""

    grad_reduce_dtype: torch.dtype | None = None


def collective_device(group: Any | None) -> torch.device:
    """Where a collective over ``group`` (``None``: the world) runs its tensors: the current CUDA device where NCCL is
    the group's backend or one of them (``"cpu:gloo,cuda:nccl"``: device tensors go to NCCL), else the CPU."""
    if torch.cuda.is_available() and "nccl" in str(dist.get_backend(group)):
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _sum_dtype(grad: torch.Tensor, reduce_dtype: torch.dtype | None) -> torch.dtype:
    """The dtype to sum ``grad`` in: its own, or ``reduce_dtype`` where that is wider (never narrower)."""
    return grad.dtype if reduce_dtype is None else torch.promote_types(grad.dtype, reduce_dtype)


class SumOverGroup(torch.autograd.Function):
    """The sum over ``group`` of each rank's part, on every rank; the backward scales by ``size`` (the group's): every
    rank's loss is then the same sum, and FSDP2's average of the ranks' gradients sums their parts. Context
    parallelism sums the CP ranks' partial losses with it, the router loss its per-expert statistics over the
    data-parallel ranks."""

    @staticmethod
    def forward(ctx, value, group, size):  # type: ignore[override]
        ctx.size = size
        total = value.detach().clone()
        dist.all_reduce(total, group=group)
        return total

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        return grad * ctx.size, None, None


class SumOverGroupBothWays(torch.autograd.Function):
    """The sum over ``group`` of each rank's part, on every rank, where what follows runs on each rank's own slice
    (a norm over features split over the TP group): each rank's gradient of the sum is then its slice's part, so
    the backward sums the gradients over the group as well."""

    @staticmethod
    def forward(ctx, value, group):  # type: ignore[override]
        ctx.group = group
        total = value.detach().clone()
        dist.all_reduce(total, group=group)
        return total

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        total = grad.contiguous().clone()
        dist.all_reduce(total, group=ctx.group)
        return total, None


class SumGradients(torch.autograd.Function):
    """Identity forward; backward sums the gradient over ``group``. For a replicated tensor used on sharded work
    (a column-wise layer's input; Qwen3's per-head q/k norms; norms under sequence parallelism): each rank's gradient
    covers its own heads or tokens only.

    ``reduce_dtype``: ``None`` sums in the gradient's own dtype (an activation's: the compute dtype, as DTensor's
    reductions do, and Megatron's); a dtype sums a narrower gradient in that one (``torch.float32``: a 16-bit gradient
    is summed in fp32 and rounded once, as one process sums those heads' or tokens' contributions in a matmul's fp32
    accumulator, for twice the bytes). Parameters' gradients are summed in fp32 (as FSDP2's ``reduce_dtype``)."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx, x: torch.Tensor, group: dist.ProcessGroup, reduce_dtype: torch.dtype | None = None
    ) -> torch.Tensor:
        ctx.group, ctx.reduce_dtype = group, reduce_dtype
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        # A new tensor (autograd may share the incoming gradient).
        total = grad.to(_sum_dtype(grad, ctx.reduce_dtype), memory_format=torch.contiguous_format, copy=True)
        dist.all_reduce(total, group=ctx.group)
        return total.to(grad.dtype), None, None


class ReplicatedFromLocal(torch.autograd.Function):
    """``DTensor.from_local(local, mesh, [Replicate()])`` (a dense region's input, shared by the column-wise
    projections inside) whose backward sums the projections' partial gradients over the mesh's group in
    ``reduce_dtype`` (widening only): DTensor's own backward sums in the gradient's dtype."""

    @staticmethod
    def forward(ctx, local: torch.Tensor, mesh: Any, reduce_dtype: torch.dtype) -> DTensor:  # type: ignore[override]
        ctx.mesh, ctx.reduce_dtype = mesh, reduce_dtype
        return DTensor.from_local(local, mesh, [Replicate()], run_check=False)

    @staticmethod
    def backward(ctx, grad: Any):  # type: ignore[override]
        if not isinstance(grad, DTensor):
            return grad, None, None
        if not any(placement.is_partial() for placement in grad.placements):
            return grad.redistribute(ctx.mesh, [Replicate()]).to_local(), None, None
        assert all(getattr(p, "reduce_op", "sum") == "sum" for p in grad.placements if p.is_partial()), grad.placements
        local = grad.to_local()
        total = local.to(_sum_dtype(local, ctx.reduce_dtype), memory_format=torch.contiguous_format, copy=True)
        dist.all_reduce(total, group=ctx.mesh.get_group())
        return total.to(local.dtype), None, None


class SumPartialOutputs(torch.autograd.Function):
    """The sum over ``group`` of each rank's partial output (a row-wise layer's, a vocabulary-parallel lookup's), a
    tensor of its own, not a view, so the model may change it in place (Llama 4's ``out.add_(shared_expert(x))``).
    ``in_place``: the partial output is the layer's own fresh tensor, which nothing saved for its backward and which is
    no view (a bias-free ``F.linear``'s, a ``masked_fill``'s): the sum is written into it; otherwise (a third-party
    forward's output, a view) into a copy. Backward: identity, every rank's output gradient is the whole one already."""

    @staticmethod
    def forward(ctx, partial: torch.Tensor, group: dist.ProcessGroup, in_place: bool) -> torch.Tensor:  # type: ignore[override]
        if in_place and partial.is_contiguous() and not is_view(partial):
            ctx.mark_dirty(partial)
        else:
            partial = partial.clone(memory_format=torch.contiguous_format)
        dist.all_reduce(partial, group=group)
        return partial

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        return grad, None, None


def chunk_sizes(total: int, parts: int) -> list[int]:
    """The sizes of ``total`` split into ``parts`` as DTensor's ``Shard`` splits a dim (``torch.chunk``: the first
    ranks hold ``ceil(total / parts)`` each, the last ones what is left, possibly nothing)."""
    chunk = -(-total // parts)
    return [max(0, min(chunk, total - i * chunk)) for i in range(parts)]


class GatherLastDim(torch.autograd.Function):
    """Each rank's slice of the last dim (sizes as :func:`chunk_sizes` gives them) gathered into the whole, a tensor
    of its own on every rank. Backward: each rank keeps its slice of the (replicated) gradient."""

    @staticmethod
    def forward(ctx, local: torch.Tensor, group: dist.ProcessGroup, total: int) -> torch.Tensor:  # type: ignore[override]
        size, rank = dist.get_world_size(group), dist.get_rank(group)
        sizes = chunk_sizes(total, size)
        assert local.shape[-1] == sizes[rank], (local.shape, sizes, rank)
        widest = sizes[0]
        padded = local if local.shape[-1] == widest else torch.nn.functional.pad(local, (0, widest - local.shape[-1]))
        # One buffer, one collective, one copy into the result (a list all-gather copies through a flat buffer).
        flat = padded.new_empty((size * padded.shape[0], *padded.shape[1:]))  # the concatenated form: gloo's too
        dist.all_gather_into_tensor(flat, padded.contiguous(), group=group)
        parts = flat.view(size, *padded.shape)
        ctx.start, ctx.width = sum(sizes[:rank]), sizes[rank]
        if all(width == widest for width in sizes):
            whole = parts.movedim(0, -2).reshape(*padded.shape[:-1], total)
            return whole.clone() if is_view(whole) else whole  # one rank: a view of the buffer, not a tensor of its own
        return torch.cat([parts[i, ..., :width] for i, width in enumerate(sizes)], dim=-1)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        return grad[..., ctx.start : ctx.start + ctx.width].contiguous(), None, None
