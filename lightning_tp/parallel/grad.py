"""Gradient-norm clipping over a model whose gradients are DTensors on one or more meshes, and plain tensors.

``torch.nn.utils.clip_grad_norm_`` (torch 2.13) fails on such a mix ("_foreach_norm got mixed torch.Tensor and
DTensor", or "All operands in aten.stack.default must have the same mesh" in 2-D). Here gradients are grouped by
(mesh, placements); each group's norm is one reduction per sharded mesh dimension, and the groups' norms combine into
the global norm, the one a single process computes.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from lightning_tp.compat import foreach_mul_, foreach_norm
from lightning_tp.parallel.collectives import collective_device
from lightning_tp.parallel.pipeline_tied import counted_on_another_stage
from lightning_tp.state import ParallelState, parallel_state


def _group_key(param: torch.Tensor) -> object:
    """A parameter's group: the reductions its gradient's norm needs (its mesh and placements) and where it lives.
    Read from the parameter, never from its gradient: every rank holds the same parameters, but a gradient can be
    missing on one rank only (an expert that saw none of the rank's tokens, outside FSDP2)."""
    if isinstance(param, DTensor):
        return ("dtensor", param.device_mesh, tuple(param.placements), param.device)
    return ("tensor", param.device)


def _parameters_and_pipeline(
    parameters: nn.Module | Iterable[torch.Tensor] | torch.Tensor, pp_group: Any | None, state: ParallelState | None
) -> tuple[list[torch.Tensor], Any | None, ParallelState | None]:
    """The parameters to take the norm of, the pipeline's group and the parallel state: a module's own unless
    ``state`` or ``pp_group`` is given; the group is the state's unless given."""
    if isinstance(parameters, nn.Module):
        state = state if state is not None else parallel_state(parameters)
        parameters = list(parameters.parameters())
    elif isinstance(parameters, torch.Tensor):
        parameters = [parameters]
    else:
        parameters = list(parameters)
    if pp_group is None and state is not None:
        pp_group = state.pp_group
    return parameters, pp_group, state


@torch.no_grad()
def grad_norm(
    parameters: nn.Module | Iterable[torch.Tensor] | torch.Tensor,
    norm_type: float = 2.0,
    *,
    pp_group: Any | None = None,
    state: ParallelState | None = None,
) -> torch.Tensor:
    """The global ``norm_type``-norm of the parameters' gradients, as a plain (replicated) 0-dim tensor.

    Each group's norm is taken on the local shards and reduced over the mesh dimensions the group is sharded on
    (sum of p-th powers, or max for inf), on the mesh's device: with FSDP2's CPU offload the local gradients live on
    the CPU while NCCL reduces only device tensors. Which reductions run is decided from the parameters that require
    a gradient, the same on every rank: a gradient missing on one rank counts as zeros there.

    Args:
        parameters: a parallelised model (its parameters, and under pipeline parallelism every stage's: the model
            knows its pipeline), or parameters or one tensor as torch's ``clip_grad_norm_`` takes them.
        norm_type: the norm's order (``inf`` for the largest magnitude).
        pp_group: the ranks of this rank's pipeline, each holding other parameters (their stages'): the norm then
            covers every stage's. Every rank of it must call this. A model given, or ``state``, brings its own.
        state: the parallel state of the model the parameters belong to (:func:`lightning_tp.parallel_state`), for
            parameters given without their model (an optimizer's): under pipeline parallelism the norm then covers
            every stage's, an embedding tied to the head across stages counted once (with ``pp_group`` alone it
            would be counted twice). A model given is its own.

    Raises:
        Nothing of its own: a gradient missing on one rank counts as zeros there, so every rank runs the same
        reductions (a collective's failure, or the process group's timeout, raises as torch raises it).
    """
    parameters, pp_group, state = _parameters_and_pipeline(parameters, pp_group, state)
    # The last stage's copies of an embedding tied to the head: the first stage's count them.
    elsewhere = counted_on_another_stage(state)
    groups: dict[object, list[torch.Tensor | None]] = {}
    for p in parameters:
        if not p.requires_grad or (pp_group is not None and id(p) in elsewhere):
            continue  # (the last stage's copy of an embedding tied to the head: the first stage's counts it)
        groups.setdefault(_group_key(p), []).append(p.grad)
    norm_type = float(norm_type)
    is_inf = math.isinf(norm_type)
    total: torch.Tensor | None = None
    for key, grads in groups.items():
        device = key[-1]
        by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
        for g in grads:
            if g is not None:
                assert not isinstance(g, DTensor) or tuple(g.placements) == key[2], f"{g.placements} != {key[2]}"
                local = g.to_local() if isinstance(g, DTensor) else g
                by_dtype.setdefault(local.dtype, []).append(local)
        # fp32 norms of bf16 gradients: their squares would lose precision in bf16.
        norms = [n for locals_ in by_dtype.values() for n in foreach_norm(locals_, norm_type, dtype=torch.float32)]
        local_norm = (
            torch.linalg.vector_norm(torch.stack([n.to(device) for n in norms]), norm_type)
            if norms
            else torch.zeros((), dtype=torch.float32, device=device)
        )
        value = local_norm if is_inf else local_norm.pow(norm_type)
        if key[0] == "dtensor":
            mesh, placements = key[1], key[2]
            value = value.to(mesh.device_type)
            for dim, placement in enumerate(placements):
                if placement.is_replicate():
                    continue
                # Shard, or FSDP2's _StridedShard (sharding a dim TP shards too): each rank holds a disjoint part.
                assert not placement.is_partial(), f"unexpected partial parameter on mesh dim {dim}"
                op = dist.ReduceOp.MAX if is_inf else dist.ReduceOp.SUM
                dist.all_reduce(value, op=op, group=mesh.get_group(dim))
        if total is None:
            total = value
        else:
            value = value.to(total.device)
            total = torch.maximum(total, value) if is_inf else total + value
    if pp_group is not None:
        # Every rank of the pipeline takes part, also one whose stages have no gradient.
        device = collective_device(pp_group)
        total = torch.zeros((), device=device) if total is None else total.to(device)
        dist.all_reduce(total, op=dist.ReduceOp.MAX if is_inf else dist.ReduceOp.SUM, group=pp_group)
    if total is None:
        return torch.tensor(0.0)
    return total if is_inf else total.pow(1.0 / norm_type)


@torch.no_grad()
def clip_grad_norm_(
    parameters: nn.Module | Iterable[torch.Tensor] | torch.Tensor,
    max_norm: float,
    norm_type: float = 2.0,
    *,
    error_if_nonfinite: bool = False,
    pp_group: Any | None = None,
    state: ParallelState | None = None,
) -> torch.Tensor:
    """Drop-in for ``torch.nn.utils.clip_grad_norm_`` that works on tensor-parallel, 2-D and pipelined models (the
    norm over every stage): :func:`grad_norm`, then every gradient scaled by the same factor.

    Args:
        parameters, norm_type, pp_group, state: as :func:`grad_norm`'s.
        max_norm: the largest norm the gradients keep.
        error_if_nonfinite: raise when the norm is ``nan`` or ``inf``, as torch does.

    Returns:
        The total norm before clipping, like torch.

    Raises:
        RuntimeError: with ``error_if_nonfinite``, when the norm is not finite (torch's error).
    """
    parameters, pp_group, state = _parameters_and_pipeline(parameters, pp_group, state)
    total = grad_norm(
        parameters, norm_type, pp_group=pp_group, state=state
    )  # every rank's reductions, gradients or not
    if error_if_nonfinite and not math.isfinite(total.item()):
        raise RuntimeError(
            f"The total norm of order {norm_type} of the gradients is non-finite, so it cannot be clipped."
        )
    coef = torch.clamp(float(max_norm) / (total + 1e-6), max=1.0)
    # Scale the local shards in place: the coefficient is the same on every rank, so no DTensor dispatch is needed.
    locals_by_device: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
    for p in parameters:
        if p.grad is None:
            continue
        local = p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad
        locals_by_device.setdefault((local.device, local.dtype), []).append(local)
    for (device, dtype), grads in locals_by_device.items():
        foreach_mul_(grads, coef.to(device=device, dtype=dtype))
    return total
