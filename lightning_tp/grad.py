"""Gradient-norm clipping over a model whose gradients are DTensors on one or more meshes, and plain tensors.

``torch.nn.utils.clip_grad_norm_`` (torch 2.13) fails on such a mix ("_foreach_norm got mixed torch.Tensor and
DTensor", or "All operands in aten.stack.default must have the same mesh" in 2-D). Here gradients are grouped by
(mesh, placements); each group's norm is one reduction, and the groups' norms combine into the global norm, the one a
single process computes.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
from torch.distributed.tensor import DTensor


def _group_key(grad: torch.Tensor) -> object:
    if isinstance(grad, DTensor):
        return ("dtensor", id(grad.device_mesh), tuple(grad.placements), grad.device, grad.dtype)
    return ("tensor", grad.device, grad.dtype)


@torch.no_grad()
def grad_norm(parameters: Iterable[torch.Tensor] | torch.Tensor, norm_type: float = 2.0) -> torch.Tensor:
    """The global ``norm_type``-norm of the parameters' gradients, as a plain (replicated) 0-dim tensor."""
    if isinstance(parameters, torch.Tensor):
        parameters = [parameters]
    groups: dict[object, list[torch.Tensor]] = {}
    for p in parameters:
        if p.grad is not None:
            groups.setdefault(_group_key(p.grad), []).append(p.grad)
    norm_type = float(norm_type)
    norms = []
    for grads in groups.values():
        local = torch.linalg.vector_norm(torch.stack(torch._foreach_norm(grads, norm_type)), norm_type)
        if isinstance(local, DTensor):
            local = local.full_tensor()  # one reduction over the shards of this group
        norms.append(local.float())
    if not norms:
        return torch.tensor(0.0)
    device = norms[0].device
    return torch.linalg.vector_norm(torch.stack([n.to(device) for n in norms]), norm_type)


@torch.no_grad()
def clip_grad_norm_(
    parameters: Iterable[torch.Tensor] | torch.Tensor,
    max_norm: float,
    norm_type: float = 2.0,
    *,
    error_if_nonfinite: bool = False,
) -> torch.Tensor:
    """Drop-in for ``torch.nn.utils.clip_grad_norm_`` that works on tensor-parallel and 2-D models.

    Returns the total norm before clipping, like torch.
    """
    if isinstance(parameters, torch.Tensor):
        parameters = [parameters]
    parameters = [p for p in parameters if p.grad is not None]
    total = grad_norm(parameters, norm_type)
    if error_if_nonfinite and not math.isfinite(total.item()):
        raise RuntimeError(f"The total norm of order {norm_type} of the gradients is non-finite, so it cannot be clipped.")
    coef = torch.clamp(float(max_norm) / (total + 1e-6), max=1.0)
    # Scale the local shards in place: the coefficient is the same on every rank, so no DTensor dispatch is needed.
    locals_by_device: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
    for p in parameters:
        local = p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad
        locals_by_device.setdefault((local.device, local.dtype), []).append(local)
    for (device, dtype), grads in locals_by_device.items():
        torch._foreach_mul_(grads, coef.to(device=device, dtype=dtype))
    return total
