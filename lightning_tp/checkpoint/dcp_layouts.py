"""Layouts DCP (torch 2.13) writes and reads wrongly, and the plain layouts they are saved and loaded in instead: the
same mesh and global shape, so a checkpoint still loads on any layout."""

from __future__ import annotations

from typing import Any

from torch.distributed.tensor import DTensor, Shard

from lightning_tp.compat import is_strided_shard
from lightning_tp.parallel.gather import on_mesh_device


def _misread_strided_dims(tensor: DTensor) -> list[int]:
    """The mesh dims of ``tensor`` whose ``_StridedShard`` DCP (torch 2.13) misplaces: a packed weight split
    block-wise by TP (``packed_colwise``: each rank holds its slice of the gate and of the up block) is not one
    contiguous chunk of the whole, yet DCP writes and reads it as one (at a wrong offset: the save fails on
    overlapping chunks with DCP's own planner, the load fills the shard with other values). The ``_StridedShard``
    FSDP2 puts on a dim that a later mesh dim shards again (FSDP2 over TP) is one chunk, and DCP handles it."""
    placements = tensor.placements
    return [
        i
        for i, placement in enumerate(placements)
        if is_strided_shard(placement)
        and not any(p.is_shard(placement.dim) and not is_strided_shard(p) for p in placements[i + 1 :])
    ]


def dcp_layouts(tree: Any) -> Any:
    """``tree`` (a state dict, nested) with every DTensor DCP would misplace redistributed to plain ``Shard``s of the
    same dims (the same mesh and the same global shape: a checkpoint loads on any layout). A collective for those."""
    if isinstance(tree, DTensor):
        dims = _misread_strided_dims(tree)
        if not dims:
            return tree
        placements = [Shard(p.dim) if i in dims else p for i, p in enumerate(tree.placements)]
        return _redistribute(tree, placements)
    if isinstance(tree, dict):
        return {key: dcp_layouts(value) for key, value in tree.items()}
    if isinstance(tree, list):
        return [dcp_layouts(value) for value in tree]
    return tree


def restore_layouts(loaded: Any, template: Any) -> Any:
    """The inverse of :func:`dcp_layouts`: each DTensor of ``loaded`` back in the layout of ``template``'s."""
    if isinstance(loaded, DTensor) and isinstance(template, DTensor):
        if loaded.placements == template.placements:
            return loaded
        return _redistribute(loaded, template.placements, mesh=template.device_mesh)
    if isinstance(loaded, dict) and isinstance(template, dict):
        return {key: restore_layouts(value, template.get(key)) for key, value in loaded.items()}
    if isinstance(loaded, list) and isinstance(template, list):
        return [restore_layouts(value, other) for value, other in zip(loaded, template, strict=False)]
    return loaded


def _redistribute(tensor: DTensor, placements: Any, *, mesh: Any = None) -> DTensor:
    """``tensor.redistribute`` on its mesh's device (see :func:`lightning_tp.parallel.gather.on_mesh_device`); the
    result comes back where ``tensor`` was."""
    mesh = mesh if mesh is not None else tensor.device_mesh
    local = tensor.to_local()
    moved = on_mesh_device(tensor).redistribute(mesh, placements)
    if moved.to_local().device == local.device:
        return moved
    return DTensor.from_local(
        moved.to_local().to(local.device), mesh, moved.placements, shape=moved.shape, stride=moved.stride()
    )


def misplaced_by_dcp(tensor: Any) -> bool:
    """Whether DCP (and torch's full-state loader) would misplace ``tensor``'s shard."""
    return isinstance(tensor, DTensor) and bool(_misread_strided_dims(tensor))


def load_in_place(state: dict[str, Any], load: Any) -> None:
    """``load(tensors)`` (a DCP load) into ``state``'s tensors, those DCP misplaces through their plain layouts."""
    import torch

    safe = dcp_layouts(state)
    load(safe)
    with torch.no_grad():
        for name, tensor in state.items():
            if safe[name] is not tensor:
                tensor.to_local().copy_(restore_layouts(safe[name], tensor).to_local())
