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
  is sliced along a dimension that one placement splits evenly: the same rows of every rank's shard, gathered
  together and put back in place. Only a tensor with neither (uneven or doubly split on every dimension) is gathered
  whole, one tensor at a time.
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
    if whole_bytes > chunk_bytes and free:
        dim = max(free, key=lambda d: tensor.shape[d])
        return _gather_slices(sharded, dim=dim, blocks=1, keep=keep, chunk_bytes=chunk_bytes, device=device)
    split_once = _evenly_split_once(tensor)
    if whole_bytes > chunk_bytes and split_once is not None:
        dim, blocks = split_once
        return _gather_slices(sharded, dim=dim, blocks=blocks, keep=keep, chunk_bytes=chunk_bytes, device=device)
    whole = sharded.full_tensor()
    return whole.to(device) if keep else None


def _evenly_split_once(tensor: DTensor) -> tuple[int, int] | None:
    """A dimension of ``tensor`` split by one placement only, a plain ``Shard`` dividing it evenly in blocks of more
    than one element, and that placement's mesh axis size (the blocks); ``None`` where there is none."""
    mesh = tensor.device_mesh
    for dim in sorted(range(tensor.ndim), key=lambda d: -tensor.shape[d]):
        splits = [
            axis
            for axis, p in enumerate(tensor.placements)
            if (isinstance(p, Shard) or is_strided_shard(p)) and p.dim == dim
        ]
        if len(splits) != 1 or is_strided_shard(tensor.placements[splits[0]]):
            continue
        blocks = mesh.size(splits[0])
        if tensor.shape[dim] % blocks == 0 and tensor.shape[dim] // blocks > 1:
            return dim, blocks
    return None


def _gather_slices(
    sharded: DTensor, *, dim: int, blocks: int, keep: bool, chunk_bytes: int, device: torch.device | str
) -> torch.Tensor | None:
    """The whole of ``sharded`` gathered in slices along ``dim``, each at most ``chunk_bytes`` whole.

    ``blocks == 1``: ``dim`` is split by no placement, so each rank's shard of a slice is that slice of its own shard
    (uneven and strided shards included). ``blocks > 1``: ``dim`` is split evenly into ``blocks`` by one plain
    ``Shard``; rows ``[start, start + length)`` of every rank's shard are, together, rows ``start + b * block`` of
    each block ``b``: gathered as one tensor of ``blocks * length`` rows split the same way, then put back in place."""
    shape, local = list(sharded.shape), sharded.to_local()
    block = shape[dim] // blocks  # the rows of one rank's shard along `dim`
    whole_bytes = sharded.numel() * sharded.element_size()
    step = max(1, shape[dim] * chunk_bytes // whole_bytes // blocks)
    out = torch.empty(sharded.shape, dtype=sharded.dtype, device=device) if keep else None
    for start in range(0, block, step):
        length = min(step, block - start)
        piece_shape = list(shape)
        piece_shape[dim] = length * blocks
        piece = DTensor.from_local(
            local.narrow(dim, start, length).contiguous(),
            sharded.device_mesh,
            sharded.placements,
            shape=torch.Size(piece_shape),
            stride=_contiguous_stride(piece_shape),
        )
        gathered = piece.full_tensor()
        if out is not None:
            for b in range(blocks):
                out.narrow(dim, b * block + start, length).copy_(gathered.narrow(dim, b * length, length))
        del piece, gathered
    return out


def _contiguous_stride(shape: list[int]) -> tuple[int, ...]:
    stride, step = [], 1
    for size in reversed(shape):
        stride.append(step)
        step *= max(size, 1)
    return tuple(reversed(stride))
