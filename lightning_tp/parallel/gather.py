"""Whole tensors from shards, for the writers that need them whole (``save_pretrained``, the adapter save,
``save_merged``) while the sharded model keeps training.

Two things torch's ``DTensor.full_tensor()`` does not do for them:

- **The mesh's device.** FSDP2's CPU offload keeps the shards on the CPU; an NCCL group rejects CPU tensors ("No
  backend type associated with device type cpu"). The shard goes to the mesh's device for the gather (as torch's own
  state-dict gather does) and the whole tensor to the CPU of the ranks that keep it.
- **Bounded memory.** ``full_tensor()`` materialises the whole tensor on every GPU at once: mid-run, next to the
  model, its gradients and optimizer states, a large vocabulary's embedding (128k x 8192 in bf16: 2 GiB) can run a
  GPU out of memory. Here the tensor is gathered in slices along a dimension that no placement splits, each slice at
  most :data:`CHUNK_BYTES` whole, copied to the CPU before the next: each GPU holds one slice of one tensor at a
  time. (Gathering to rank 0 only would not lower the peak where it binds: rank 0 holds the same share of the model
  as every other rank, plus the whole tensor.) A tensor split along every dimension (a row-wise weight under FSDP2)
  is gathered whole, one tensor at a time.
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor, Shard

from lightning_tp.compat import is_strided_shard

#: The most bytes of a whole tensor gathered at once (one slice), where a dimension no placement splits allows it.
CHUNK_BYTES = 256 * 2**20


def on_mesh_device(tensor: DTensor) -> DTensor:
    """``tensor`` with its shard on its mesh's device (a copy where FSDP2's CPU offload kept it on the CPU)."""
    mesh = tensor.device_mesh
    local = tensor.to_local()
    if local.device.type == mesh.device_type:
        return tensor
    return DTensor.from_local(
        local.to(mesh.device_type), mesh, tensor.placements, shape=tensor.shape, stride=tensor.stride()
    )


def split_dims(tensor: DTensor) -> set[int]:
    """The tensor dimensions that a placement of ``tensor`` splits (``Shard`` and FSDP2's ``_StridedShard``)."""
    return {p.dim for p in tensor.placements if isinstance(p, Shard) or is_strided_shard(p)}


def whole_tensor(
    tensor: torch.Tensor, *, keep: bool, chunk_bytes: int | None = None, device: torch.device | str = "cpu"
) -> torch.Tensor | None:
    """The whole of ``tensor`` (a DTensor, or a plain tensor) on ``device`` (the CPU by default) where ``keep``, else
    ``None``. A collective for a DTensor: every rank of its mesh calls it, each with its own ``keep``. See the
    module's docstring. The result may share storage with ``tensor`` (a plain tensor, or a replicated one, already
    on ``device``): copy it before changing it."""
    if not isinstance(tensor, DTensor):
        return tensor.detach().to(device) if keep else None
    chunk_bytes = CHUNK_BYTES if chunk_bytes is None else chunk_bytes
    sharded = on_mesh_device(tensor.detach())
    whole_bytes = tensor.numel() * tensor.element_size()
    free = [dim for dim in range(tensor.ndim) if dim not in split_dims(tensor) and tensor.shape[dim] > 1]
    if whole_bytes <= chunk_bytes or not free:
        whole = sharded.full_tensor()
        return whole.to(device) if keep else None
    dim = max(free, key=lambda d: tensor.shape[d])
    size = tensor.shape[dim]
    step = max(1, size * chunk_bytes // whole_bytes)
    out = torch.empty(tensor.shape, dtype=tensor.dtype, device=device) if keep else None
    local = sharded.to_local()
    for start in range(0, size, step):
        length = min(step, size - start)
        shape = list(tensor.shape)
        shape[dim] = length
        # A slice along an unsplit dimension has the same placements: each rank's shard of it is that slice of its
        # own shard (uneven and strided shards included).
        piece = DTensor.from_local(
            local.narrow(dim, start, length).contiguous(),
            sharded.device_mesh,
            sharded.placements,
            shape=torch.Size(shape),
            stride=_contiguous_stride(shape),
        )
        gathered = piece.full_tensor()
        if out is not None:
            out.narrow(dim, start, length).copy_(gathered)
    return out


def _contiguous_stride(shape: list[int]) -> tuple[int, ...]:
    stride, step = [], 1
    for size in reversed(shape):
        stride.append(step)
        step *= max(size, 1)
    return tuple(reversed(stride))
