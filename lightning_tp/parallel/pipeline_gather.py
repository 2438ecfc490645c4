"""Every pipeline stage's tensors on one rank, for a single-file save or an export: streamed point to point, one
tensor at a time.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn

from lightning_tp.parallel.pipeline import pipeline_runner

if TYPE_CHECKING:
    pass


def gather_stages(module: nn.Module, state: dict[str, Any]) -> dict[str, Any]:
    """Under pipeline parallelism, every stage's entries of ``state`` (each rank's whole tensors of its own stages),
    merged on the first rank of each pipeline (rank 0 among them), ``{}`` on the others; without it, ``state``. Every
    rank must call it.

    Streamed: the ranks first share what they hold (names, shapes, dtypes: plain values), then each tensor goes to the
    first rank point to point, one at a time, through the pipeline's device (NCCL sends device tensors), and lands on
    its CPU. A tensor held under several names (a tied weight) is sent once and kept as one object."""
    runner = pipeline_runner(module)
    if runner is None:
        return state
    # Ranks in the group's own numbering, in which the sends below address the first rank.
    group = runner.pp_mesh.get_group()
    mine, size = dist.get_rank(group), dist.get_world_size(group)
    names: dict[int, list[str]] = {}
    for name, value in state.items():
        assert isinstance(value, torch.Tensor), f"gather_stages of a non-tensor entry {name!r}"
        names.setdefault(id(value), []).append(name)
    listing = [
        (keys, tuple(state[keys[0]].shape), str(state[keys[0]].dtype).removeprefix("torch.")) for keys in names.values()
    ]
    listings: list[Any] = [None] * size
    dist.all_gather_object(listings, listing, group=group)
    merged = dict(state) if mine == 0 else {}
    first = dist.get_global_rank(group, 0)
    for rank in range(1, size):
        if mine not in (0, rank):
            continue
        for keys, shape, dtype in listings[rank]:
            if mine == rank:
                dist.send(state[keys[0]].detach().to(runner.device).contiguous(), dst=first, group=group)
                continue
            received = torch.empty(shape, dtype=getattr(torch, dtype), device=runner.device)
            dist.recv(received, src=dist.get_global_rank(group, rank), group=group)
            received = received.cpu()
            for key in keys:
                merged[key] = received
    return merged


__all__ = [
    "gather_stages",
]
