"""Ring attention: context parallelism's keys and values passed around the CP group point to point instead of
all-gathered (``cp_comm="ring"``), for lengths where one layer's gathered keys and values do not fit.

Each rank starts with its own keys and values (its two pieces of the load-balanced split). In ``cp`` steps it computes
its query tiles against the pieces it holds (the calls of :class:`lightning_tp.parallel.blockwise.RangeMask` that
fall in them: a packed row's skipped tiles are skipped here too) while sending them on to the next rank and receiving
the previous rank's, and merges the partial outputs by their log-sum-exp. The backward passes the keys and values
around again, with the gradients of their keys and values travelling beside them: after the last step each
gradient is one send from its owner, which receives it. A rank holds at most two ranks' keys and values at a time,
and the forward keeps only its own for the backward (the all-gather keeps the whole sequence's per layer).

The exchanges use ``torch.distributed``'s ``batch_isend_irecv`` on the CP group (gloo and NCCL), started before each
step's computation and waited for after it.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from lightning_tp.parallel.blockwise import (
    Call,
    Merged,
    RangeMask,
    Scores,
    accumulation_dtype,
    kernel_for,
    no_autocast,
    output_grad,
    sinks_grad,
)


def ring_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    mask: RangeMask,
    *,
    scores: Scores,
    sinks: torch.Tensor | None,
    group: Any,
    pieces: list[list[tuple[int, int]]],
) -> torch.Tensor:
    """Attention of this rank's queries against the whole sequence's keys and values, which travel around the
    ring; differentiable in this rank's queries, keys, values and the sinks.

    Args:
        query: ``(batch, heads, queries, head_dim)`` this rank's.
        key: ``(batch, kv_heads, local_len, head_dim)`` this rank's (its pieces, in local order).
        value: like ``key``.
        mask: the ranges and tiles of this rank's queries, keys in global positions.
        scores: the scale, softcapping and dropout.
        sinks: ``(heads,)`` or ``None``.
        group: the CP process group.
        pieces: for each rank of the group, its pieces as ``(global start, length)`` in local order.
    """
    return _RingAttention.apply(query, key, value, sinks, mask, scores, group, pieces)


def _owned_calls(mask: RangeMask, pieces: list[tuple[int, int]]):
    """The calls of each tile restricted to one rank's pieces, with where each part lies in that rank's buffer."""
    offsets = []
    local = 0
    for start, length in pieces:
        offsets.append((start, start + length, local))
        local += length
    for tile in mask.tiles:
        for call in tile.calls:
            for start, end, at in offsets:
                low, high = max(call.start, start), min(call.end, end)
                if low < high:
                    yield tile, Call(low, high, call.kind), slice(at + low - start, at + high - start)


class _Exchange:
    """One step's sends to the next rank and receives from the previous one, started now and waited for later."""

    def __init__(self, tensors: list[torch.Tensor], group: Any) -> None:
        rank, size = dist.get_rank(group), dist.get_world_size(group)
        after = dist.get_global_rank(group, (rank + 1) % size)
        before = dist.get_global_rank(group, (rank - 1) % size)
        self.sent = [t.contiguous() for t in tensors]  # kept alive until the sends complete
        self.received = [torch.empty_like(t, memory_format=torch.contiguous_format) for t in self.sent]
        ops = [dist.P2POp(dist.isend, t, after, group) for t in self.sent]
        ops += [dist.P2POp(dist.irecv, r, before, group) for r in self.received]
        self.works = dist.batch_isend_irecv(ops)

    def wait(self) -> list[torch.Tensor]:
        for work in self.works:
            work.wait()
        return self.received


class _RingAttention(torch.autograd.Function):
    @staticmethod
    @no_autocast
    def forward(ctx, query, key, value, sinks, mask, scores, group, pieces):  # type: ignore[override]
        size, rank = dist.get_world_size(group), dist.get_rank(group)
        kernel = kernel_for(query, value, scores)
        merged = Merged.empty(query, value)
        held = [key, value]
        for step in range(size):
            owner = (rank - step) % size
            exchange = _Exchange(held, group) if step < size - 1 else None
            for tile, call, at in _owned_calls(mask, pieces[owner]):
                k, v = held[0][:, :, at], held[1][:, :, at]
                merged.add(tile, *kernel.forward(query[:, :, tile.rows], k, v, mask, tile, call, scores))
            if exchange is not None:
                held = exchange.wait()
        out, lse = merged.finish(mask, sinks)
        ctx.save_for_backward(query, key, value, sinks, out, lse)
        ctx.mask, ctx.scores, ctx.kernel, ctx.group, ctx.pieces = mask, scores, kernel, group, pieces
        return out

    @staticmethod
    @no_autocast
    def backward(ctx, grad):  # type: ignore[override]
        query, key, value, sinks, out, lse = ctx.saved_tensors
        mask, scores, kernel, group, pieces = ctx.mask, ctx.scores, ctx.kernel, ctx.group, ctx.pieces
        size, rank = dist.get_world_size(group), dist.get_rank(group)
        grad = output_grad(grad, mask)
        acc = accumulation_dtype(query.dtype)
        grad_query = torch.zeros_like(query, dtype=acc)
        held = [key, value]
        travelling: list[torch.Tensor] | None = None  # the gradients of the keys held, from the ranks before
        for step in range(size):
            owner = (rank - step) % size
            exchange = _Exchange(held, group) if step < size - 1 else None
            grads = [torch.zeros_like(held[0], dtype=acc), torch.zeros_like(held[1], dtype=acc)]
            for tile, call, at in _owned_calls(mask, pieces[owner]):
                rows = tile.rows
                dq, dk, dv = kernel.backward(
                    grad[:, :, rows],
                    query[:, :, rows],
                    held[0][:, :, at],
                    held[1][:, :, at],
                    out[:, :, rows],
                    lse[:, :, rows],
                    mask,
                    tile,
                    call,
                    scores,
                )
                grad_query[:, :, rows] += dq
                grads[0][:, :, at] += dk
                grads[1][:, :, at] += dv
            if travelling is not None:
                grads = [g + t for g, t in zip(grads, travelling, strict=True)]
            # The gradients go on with the keys they belong to: to the next rank, which holds those keys next (after
            # the last step, the next rank is their owner).
            travelling = _Exchange(grads, group).wait()
            if exchange is not None:
                held = exchange.wait()
        return (
            grad_query.to(query.dtype),
            travelling[0].to(key.dtype),
            travelling[1].to(value.dtype),
            sinks_grad(sinks, lse, grad, out) if ctx.needs_input_grad[3] else None,
            None,
            None,
            None,
            None,
        )


__all__ = ["ring_attention"]
