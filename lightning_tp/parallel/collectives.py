"""Autograd functions around collectives that more than one technique needs."""

from __future__ import annotations

import torch
import torch.distributed as dist


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
