"""Parameters whose dim 0 packs blocks (a mixer's ``[q | k | v]``), split so that each rank computes its heads.

Storage is a plain ``Shard(0)`` DTensor of the whole tensor, the layout every other part of the package knows
(checkpoints reshard, export gathers, FSDP2 shards it further, random initialisation draws it whole). A block layout
(each rank holding its slice of every block) would avoid the exchange below, but DTensor has no placement for blocks
of different sizes, and a permuted storage would leak into every checkpoint (and differ with the TP size).

A one-block parameter may hold its heads on another dim (Kimi-Linear's ``A_log`` [1, 1, heads, 1]): it is a plain
``Shard`` of that dim (``ResolvedPlan.block_dims``), read as its local tensor.

During the forward the module reads its rank's rows: its slice of each block. With one block that is the local
shard (no communication); with several, the ranks exchange rows with one all-to-all over the TP group: each rank
sends the rows of its shard that another rank computes and receives the rows it computes that another rank holds
(:class:`TakeRows`); the backward sends their gradients back the same way. A rank receives the rows it computes and
does not hold: where no block is taken whole, at most its shard's size (``1/tp`` of the weight), where gathering the
whole weight would receive ``(tp - 1)/tp`` of it, hold it whole for the forward and reduce-scatter a whole-size
gradient; a block every rank takes whole (a multi-query attention's K/V) goes to every rank, as in a gather.
Against Transformers' ``colwise_gather_output`` (an activation-sized all-gather of the projection's output, then the
whole recurrence on every rank) the cost is weight-sized, whatever the batch.
"""

from __future__ import annotations

import types
from collections.abc import Callable
from dataclasses import dataclass
from functools import cache
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from lightning_tp.compat import buffer_dict, parameter_dict
from lightning_tp.parallel.collectives import SumGradients, SumOverGroupBothWays, chunk_sizes
from lightning_tp.parallel.hooks import run_on_parameter_views
from lightning_tp.patches import install
from lightning_tp.plans.resolved import ResolvedPlan

COLUMN_STYLE = "colwise_blocks"
LOCAL_STYLE = "local_blocks"


@cache
def _rows(blocks: tuple[int, ...], whole: tuple[int, ...], tp_size: int, rank: int) -> tuple[int, ...]:
    rows: list[int] = []
    offset = 0
    for index, size in enumerate(blocks):
        if index in whole:
            rows += range(offset, offset + size)
        else:
            share = size // tp_size
            rows += range(offset + rank * share, offset + (rank + 1) * share)
        offset += size
    return tuple(rows)


def rank_rows(blocks: tuple[int, ...], *, tp_size: int, rank: int, whole: tuple[int, ...] = ()) -> torch.Tensor:
    """The rows of the whole tensor that ``rank`` computes: its slice of every block, all of the blocks in
    ``whole`` (indices)."""
    assert all(size % tp_size == 0 for i, size in enumerate(blocks) if i not in whole), (blocks, tp_size)
    return torch.tensor(_rows(blocks, tuple(whole), tp_size, rank), dtype=torch.long)


@dataclass(frozen=True, eq=False)
class RowExchange:
    """What one rank sends and receives so that it holds its rows of every block (:func:`rank_rows`) from a plain
    ``Shard(0)`` storage of the whole tensor: a static plan, derived alike on every rank from the blocks and the TP
    size.

    ``send[d]``: how many rows of its shard it sends to rank ``d`` (itself included: a local copy); ``send_rows``:
    which (local indices, grouped by destination); ``recv[s]``: how many it receives from rank ``s``. Its rows of
    every block are in ascending order and each shard is a contiguous range, so what it receives, in the ranks'
    order, is its rows in order."""

    rank: int
    send: tuple[int, ...]
    recv: tuple[int, ...]
    send_rows: torch.Tensor
    local_rows: int

    @property
    def received(self) -> int:
        """The rows this rank receives from the other ranks (its own are copied, not sent)."""
        return sum(self.recv) - self.recv[self.rank]


def row_exchange(blocks: tuple[int, ...], *, tp_size: int, rank: int, whole: tuple[int, ...] = ()) -> RowExchange:
    """The :class:`RowExchange` of ``rank`` for a tensor packing ``blocks`` on dim 0, stored as a ``Shard(0)`` over
    ``tp_size`` ranks (the shard sizes of :func:`lightning_tp.parallel.collectives.chunk_sizes`)."""
    sizes = chunk_sizes(sum(blocks), tp_size)
    starts = [sum(sizes[:s]) for s in range(tp_size)]
    needed = [rank_rows(blocks, tp_size=tp_size, rank=r, whole=whole) for r in range(tp_size)]
    start, stop = starts[rank], starts[rank] + sizes[rank]
    send_rows = [rows[(rows >= start) & (rows < stop)] - start for rows in needed]
    mine = needed[rank]
    recv = [int(((mine >= starts[s]) & (mine < starts[s] + sizes[s])).sum()) for s in range(tp_size)]
    return RowExchange(
        rank=rank,
        send=tuple(len(rows) for rows in send_rows),
        recv=tuple(recv),
        send_rows=torch.cat(send_rows),
        local_rows=sizes[rank],
    )


class TakeRows(torch.autograd.Function):
    """A rank's rows of every block, from its ``Shard(0)`` shard of the whole tensor, by one all-to-all over the TP
    group (:class:`RowExchange`); backward: their gradients sent back to the ranks that hold them, summed where
    several ranks read a row (a block every rank takes whole)."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx, local: torch.Tensor, send_rows: torch.Tensor, exchange: RowExchange, group: dist.ProcessGroup
    ) -> torch.Tensor:
        """``send_rows``: ``exchange.send_rows`` on ``local``'s device."""
        assert local.shape[0] == exchange.local_rows, (local.shape, exchange.local_rows)
        ctx.exchange, ctx.group = exchange, group
        ctx.save_for_backward(send_rows)
        send = local.index_select(0, send_rows)
        out = local.new_empty((sum(exchange.recv), *local.shape[1:]))
        dist.all_to_all_single(out, send, list(exchange.recv), list(exchange.send), group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        exchange: RowExchange = ctx.exchange
        (send_rows,) = ctx.saved_tensors
        back = grad.new_empty((sum(exchange.send), *grad.shape[1:]))
        dist.all_to_all_single(back, grad.contiguous(), list(exchange.send), list(exchange.recv), group=ctx.group)
        local = grad.new_zeros((exchange.local_rows, *grad.shape[1:]))
        return local.index_add_(0, send_rows, back), None, None, None


def block_view(
    blocks: tuple[int, ...] | None, mesh: DeviceMesh, *, whole: tuple[int, ...] = ()
) -> Callable[[torch.Tensor], torch.Tensor]:
    """The view of a ``Shard(0)`` parameter that holds the rank's slice of each block (``None``: one block), and
    all of the blocks in ``whole``."""
    rank, tp_size, group = mesh.get_local_rank(), mesh.size(), mesh.get_group()
    exchange = None if blocks is None else row_exchange(blocks, tp_size=tp_size, rank=rank, whole=whole)
    on_device: dict[torch.device, torch.Tensor] = {}  # the index copied to each device once, not at every forward

    def view(param: torch.Tensor) -> torch.Tensor:
        if not isinstance(param, DTensor) or param.device_mesh.ndim != 1 or not param.placements[0].is_shard():
            return param  # already a view (an outer module's call), or held sharded by FSDP2 at this moment
        if exchange is None:
            return param.to_local()
        assert param.placements == (Shard(0),), param.placements
        local = param.to_local()
        send_rows = on_device.setdefault(local.device, exchange.send_rows.to(local.device))
        return TakeRows.apply(local, send_rows, exchange, group)

    return view


def _run_on_buffer_view(module: nn.Module, name: str, *, dim: int, rows: torch.Tensor) -> None:
    """During each call of ``module``, its buffer ``name`` is the ``rows`` of its ``dim``."""
    pending: list[torch.Tensor] = []
    on_device: dict[torch.device, torch.Tensor] = {}

    def swap(_module: nn.Module, _args: Any) -> None:
        whole = buffer_dict(module)[name]
        index = on_device.setdefault(whole.device, rows.to(whole.device))
        pending.append(whole)
        buffer_dict(module)[name] = whole.index_select(dim, index)

    def restore(_module: nn.Module, _args: Any, _output: Any) -> None:
        if pending:
            buffer_dict(module)[name] = pending.pop()

    module.register_forward_pre_hook(swap)
    module.register_forward_hook(restore, prepend=True, always_call=True)


def norm_across_ranks(norm: nn.Module, mesh: DeviceMesh, *, width: int) -> None:
    """A gated RMS norm over one group of ``width`` features that the TP ranks hold slices of (Mamba2's with one
    group of B/C): the mean square is summed over the TP group. It replaces the norm's forward (an instance attribute
    installed by :func:`lightning_tp.patches.install`, owned by the norm), since the sum sits inside it, where no
    hook reaches; the two conventions of Transformers' Mamba2 norms are kept: the gate applied first and the weight in
    the input's dtype (``group_size``: Bamba, Granite 4, Zamba2), or the gate applied after when
    ``norm_before_gate`` and the weight in float32 (Falcon-H1's, which keeps ``n_groups``)."""
    group = mesh.get_group()
    falcon_style = hasattr(norm, "norm_before_gate")

    # Bound to the norm (not a closure over it), so that a deep copy of the model runs on the copy's weight.
    def forward(norm: nn.Module, hidden_states: torch.Tensor, gate: torch.Tensor | None = None) -> torch.Tensor:
        dtype = hidden_states.dtype
        before_gate = falcon_style and norm.norm_before_gate
        states = hidden_states.to(torch.float32)
        if gate is not None and not before_gate:
            states = states * F.silu(gate.to(torch.float32))
        square = SumOverGroupBothWays.apply(states.pow(2).sum(-1, keepdim=True), group)
        states = states * torch.rsqrt(square / width + norm.variance_epsilon)
        if not falcon_style:
            return norm.weight * states.to(dtype)
        states = norm.weight * states
        if gate is not None and before_gate:
            states = states * F.silu(gate.to(torch.float32))
        return states.to(dtype)

    install(norm, "forward", types.MethodType(forward, norm), owner=norm)


def _replicated_input_grad_summed(mesh: DeviceMesh, reduce_dtype: torch.dtype | None) -> Callable[..., Any]:
    """A forward pre-hook: the input is replicated, and each rank's gradient of it covers its own rows only, so the
    gradient is summed over the TP group in backward (as a column-wise layer does, in ``reduce_dtype``)."""
    group = mesh.get_group()

    def hook(_module: nn.Module, args: tuple) -> tuple:
        x, *rest = args
        return (SumGradients.apply(x, group, reduce_dtype), *rest)

    return hook


def _blocks_of(plan: ResolvedPlan, name: str) -> tuple[tuple[int, ...] | None, tuple[int, ...]]:
    """The blocks of the parameter at ``name`` and those taken whole; a LoRA wrapper's base layer and ``lora_B``
    share its blocks."""
    if name in plan.blocks:
        return plan.blocks[name], plan.whole_blocks.get(name, ())
    module, _, leaf = name.rpartition(".")
    for key, blocks in plan.blocks.items():
        owner, _, key_leaf = key.rpartition(".")
        if key_leaf == leaf and module.startswith(f"{owner}."):
            return blocks, plan.whole_blocks.get(key, ())
    return None, ()


def _owner(plan: ResolvedPlan, name: str) -> str:
    """The mixer that reads the parameter or module at ``name`` (its nearest mixer ancestor)."""
    owners = [m for m in plan.mixers if name == m or name.startswith(f"{m}.")]
    return max(owners, key=len) if owners else name.rpartition(".")[0]


def apply_blocks(
    module: nn.Module, mesh: DeviceMesh, plan: ResolvedPlan, *, grad_reduce_dtype: torch.dtype | None = None
) -> None:
    """Split the plan's ``colwise_blocks`` and ``local_blocks`` entries (modules or parameters) on dim 0 and make
    their readers see the rank's rows; slice the mixers' packed buffers (not saved) to the rank's blocks.
    ``grad_reduce_dtype``: the dtype a column-wise block's input gradient is summed in (``None``: its own)."""
    modules = dict(module.named_modules())
    rank, tp_size = mesh.get_local_rank(), mesh.size()
    for name, width in plan.norms_across_ranks.items():
        norm_across_ranks(modules[name], mesh, width=width)
    for name, (dim, blocks, whole_blocks) in plan.buffer_blocks.items():
        holder_name, _, leaf = name.rpartition(".")
        rows = rank_rows(blocks, tp_size=tp_size, rank=rank, whole=whole_blocks)
        # A view during the call, the buffer kept whole: Transformers' initialisation writes the whole vector into it
        # (Falcon-H1's `mup_vector`, not saved, so also after loading a checkpoint).
        _run_on_buffer_view(modules[holder_name], leaf, dim=dim, rows=rows)
    done: set[str] = set()
    for name, style in plan.styles.items():
        if style not in (COLUMN_STYLE, LOCAL_STYLE) or name not in modules and style == COLUMN_STYLE:
            continue
        if name in modules:
            holder, holder_name = modules[name], name
            params = [p for p, value in parameter_dict(holder).items() if value is not None]
        else:
            holder_name, _, leaf = name.rpartition(".")
            holder, params = modules[holder_name], [leaf]
        params = [p for p in params if f"{holder_name}.{p}" not in done]
        done.update(f"{holder_name}.{p}" for p in params)
        if not params:
            continue
        views = {}
        for leaf in params:
            param = parameter_dict(holder)[leaf]
            if not isinstance(param, DTensor):
                dim = plan.block_dims.get(f"{holder_name}.{leaf}", 0)
                sharded = distribute_tensor(param.data, mesh, [Shard(dim)], src_data_rank=None)
                parameter_dict(holder)[leaf] = nn.Parameter(sharded, requires_grad=param.requires_grad)
            blocks, whole = _blocks_of(plan, f"{holder_name}.{leaf}")
            views[leaf] = block_view(blocks, mesh, whole=whole)
        if style == COLUMN_STYLE:
            run_on_parameter_views(holder, views)
            holder.register_forward_pre_hook(_replicated_input_grad_summed(mesh, grad_reduce_dtype))
        else:
            # The mixer reads them itself (``self.conv1d.weight`` passed to a convolution function).
            owner = _owner(plan, holder_name)
            run_on_parameter_views(modules[owner], views, holder=holder)
            if holder is not modules[owner]:
                run_on_parameter_views(holder, views)
