"""KV-head replication: tensor parallelism at any TP size that divides the query heads, also when it does not divide
the key/value heads (grouped-query attention with few KV heads: 1, 2, 3, 4...).

Each rank computes a contiguous block of ``query_heads / tp_size`` query heads, and for them the KV heads those
query heads read (query head ``i`` reads KV head ``i // (query_heads / kv_heads)``): with fewer KV heads than ranks,
or a count the TP size does not divide, some KV heads are computed by several ranks.

Storage stays the plain column-wise layout: the K and V projections' weights (and biases) are ``Shard(0)`` DTensors
over the TP ranks, exactly as ``colwise`` stores them, so checkpoints, export, resharding, clipping, optimizers and
FSDP2 see an ordinary sharded parameter, and each rank stores ``1 / tp_size`` of the KV weights (Megatron-Core and
vLLM store every head a rank needs, up to the whole projection). In the forward each projection gathers its weight
(an all-gather of ``kv_heads * head_dim * hidden`` values per projection and layer) and multiplies by the rows of
the rank's KV heads only; in the backward the weight's gradient rows, non-zero for the heads a rank used, are
reduce-scattered back to the shards: a KV head's gradient is the sum over exactly the ranks that used it, and its
shards stay equal to one process's.

The attention module is told its rank's grouping (``num_key_value_groups``; the head counts of ``local_heads``
modules): when every KV head a rank computes serves the same number of its query heads, the KV heads are kept as
they are and grouped as usual; otherwise (3 KV heads, 6 query heads, TP 2: rank 0 reads KV heads 0, 0, 1) the
projection's output is expanded to one KV head per query head and the grouping is 1.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import ParallelStyle

from lightning_tp.compat import parameter_dict
from lightning_tp.parallel.collectives import SumGradients, SumsInputGradients
from lightning_tp.parallel.hooks import on_hidden_states, run_on_parameter_views
from lightning_tp.plans.styles import KV_GROUPS_ATTRIBUTE


@dataclass(frozen=True)
class KVHeadLayout:
    """The KV heads one rank computes for its query heads.

    ``first``, ``count``: the contiguous KV heads the rank computes. ``expand``: for each of the rank's query heads, the
    index (among the ``count`` computed) of the KV head it reads, when the grouping is uneven; ``None`` when every
    computed KV head serves ``groups`` consecutive query heads. ``groups``: the attention's per-rank grouping.
    """

    query_heads: int
    kv_heads: int
    tp_size: int
    rank: int
    first: int
    count: int
    groups: int
    expand: tuple[int, ...] | None

    @property
    def local_query_heads(self) -> int:
        return self.query_heads // self.tp_size

    @property
    def local_kv_heads(self) -> int:
        """The KV heads the attention sees on this rank (after the expansion, if any)."""
        return self.count if self.expand is None else len(self.expand)

    @property
    def query_range(self) -> range:
        local = self.local_query_heads
        return range(self.rank * local, (self.rank + 1) * local)


def kv_head_layout(query_heads: int, kv_heads: int, *, tp_size: int, rank: int) -> KVHeadLayout:
    """The KV heads rank ``rank`` of ``tp_size`` computes. ``tp_size`` must divide ``query_heads`` and ``kv_heads``
    must divide ``query_heads`` (checked with the plan; asserted here)."""
    assert query_heads % tp_size == 0 and query_heads % kv_heads == 0, (query_heads, kv_heads, tp_size)
    local, group = query_heads // tp_size, query_heads // kv_heads
    reads = [(rank * local + i) // group for i in range(local)]
    first, count = reads[0], reads[-1] - reads[0] + 1
    uses = [reads.count(first + j) for j in range(count)]
    if len(set(uses)) == 1:
        return KVHeadLayout(query_heads, kv_heads, tp_size, rank, first, count, uses[0], None)
    return KVHeadLayout(query_heads, kv_heads, tp_size, rank, first, count, 1, tuple(r - first for r in reads))


def describe_layouts(query_heads: int, kv_heads: int, *, tp_size: int) -> list[str]:
    """One line per rank: its query heads and the KV heads it computes (for the inspector and errors)."""
    lines = []
    for rank in range(tp_size):
        layout = kv_head_layout(query_heads, kv_heads, tp_size=tp_size, rank=rank)
        queries = layout.query_range
        kv = range(layout.first, layout.first + layout.count)
        lines.append(
            f"rank {rank}: query heads {_span(queries)} read KV heads {_span(kv)}"
            + (" (expanded to one per query head)" if layout.expand is not None else "")
        )
    return lines


def _span(heads: range) -> str:
    return str(heads.start) if len(heads) == 1 else f"{heads.start}-{heads[-1]}"


class ColwiseKVHeads(SumsInputGradients, ParallelStyle):
    """A K or V projection (``nn.Linear``, weight [kv_heads * head_dim, in]) stored column-wise (``Shard(0)``) that
    computes the KV heads of its rank's query heads (see the module docstring). Hooks only: the weight and bias are
    swapped for the rank's rows during each call, the input enters as a replicated tensor whose gradient is summed
    over the TP group (as a column-wise layer's is), and an uneven grouping expands the output."""

    def __init__(self, counts: tuple[int, int]):
        """``counts``: the attention's (query heads, KV heads) in the whole model."""
        super().__init__()
        self.query_heads, self.kv_heads = counts

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        layout = kv_head_layout(
            self.query_heads, self.kv_heads, tp_size=device_mesh.size(), rank=device_mesh.get_local_rank()
        )
        params = parameter_dict(module)
        for name in ("weight", "bias"):
            param = params.get(name)
            if param is not None and not isinstance(param, DTensor):
                params[name] = nn.Parameter(
                    distribute_tensor(param, device_mesh, [Shard(0)], src_data_rank=None),
                    requires_grad=param.requires_grad,
                )
        rows_per_head = module.weight.shape[0] // self.kv_heads
        rows = slice(layout.first * rows_per_head, (layout.first + layout.count) * rows_per_head)

        def rank_rows(param: torch.Tensor) -> torch.Tensor:
            # All-gather the shards; the gradient of the gathered weight is this rank's part of a sum (non-zero rows
            # for the heads it used), reduce-scattered back to the shards in the backward.
            whole = param.redistribute(device_mesh, [Replicate()]).to_local(grad_placements=[Partial()])
            return whole[rows]

        group, reduce_dtype = device_mesh.get_group(), self.grad_reduce_dtype

        def replicated_input(x: Any) -> Any:
            # Each rank's input gradient covers its own heads: summed over the TP group (a region's DTensor input is
            # summed where the region begins).
            if isinstance(x, DTensor):
                return x.to_local(grad_placements=[Partial()])
            return SumGradients.apply(x, group, reduce_dtype)

        run_on_parameter_views(module, {name: rank_rows for name in ("weight", "bias") if params.get(name) is not None})
        module.register_forward_pre_hook(on_hidden_states(replicated_input), with_kwargs=True)
        if layout.expand is not None:
            indices: dict[torch.device, torch.Tensor] = {}  # one copy per device, made once (no copy per step)

            def expand(_module: nn.Module, _args: Any, output: torch.Tensor) -> torch.Tensor:
                if output.device not in indices:
                    indices[output.device] = torch.tensor(layout.expand, device=output.device)
                heads = output.unflatten(-1, (layout.count, -1))
                return heads.index_select(-2, indices[output.device]).flatten(-2)

            module.register_forward_hook(expand)
        return module


def localize_kv_groups(attention: nn.Module, layout: KVHeadLayout, *, count_attributes: tuple[str, ...] = ()) -> None:
    """Give ``attention`` its rank's grouping: ``num_key_value_groups`` where it keeps one, and the KV head counts
    named in ``count_attributes`` (a ``local_heads`` module's) where it keeps them."""
    if isinstance(getattr(attention, KV_GROUPS_ATTRIBUTE, None), int):
        setattr(attention, KV_GROUPS_ATTRIBUTE, layout.groups)
    for attribute in count_attributes:
        if isinstance(getattr(attention, attribute, None), int):
            setattr(attention, attribute, layout.local_kv_heads)
