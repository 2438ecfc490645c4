"""The private names of ``torch.distributed`` that lightning_tp uses, each with why: the default process group and
its store, device meshes and group options, DTensor's sharding (placements, local shapes, its random-number tracker,
the cut of a full checkpoint into shards), the pipelining schedules' action lists and DCP's fsspec storage."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

__all__ = [
    "distributed_is_initialized",
    "get_default_store",
    "flatten_mesh",
    "group_options",
    "compute_local_shape_and_global_offset",
    "strided_shard",
    "is_strided_shard",
    "strided_split_factor",
    "standalone_process_group",
    "cutting_strided_shards",
    "install_dtensor_rng_tracker",
    "forward_only_actions",
    "fsspec_writer_class",
    "fsspec_reader_class",
    "torch_get_layout",
    "fake_world_store",
    "group_by_name",
    "clear_dtensor_sharding_cache",
    "process_group_of",
]


def distributed_is_initialized() -> bool:
    """Whether a default process group exists (the one spelling of it in the package). ``is_initialized`` exists only
    where torch was built with distributed support, hence ``is_available`` first (Lightning's private helper does the
    same)."""
    return dist.is_available() and dist.is_initialized()


def get_default_store() -> dist.Store:
    """The c10d store every process of the job shares (a rank waits there longer than a collective's timeout allows);
    torch has no public accessor."""
    return dist.distributed_c10d._get_default_store()


def flatten_mesh(mesh: DeviceMesh, name: str, *, backend_override: Any = None) -> DeviceMesh:
    """One 1-D mesh over several axes of ``mesh``: ``DeviceMesh._flatten``, what torchtitan uses; no public API yet."""
    return mesh._flatten(name, backend_override=backend_override)


def group_options(backend: str, timeout: timedelta) -> Any:
    """Backend options that carry ``timeout`` into the groups ``init_device_mesh`` and :func:`flatten_mesh` create:
    torch reads it from the private ``options._timeout``. NCCL insists on its own (public) options class; for the
    others the base class has no public constructor (``torch._C._distributed_c10d.Backend.Options``)."""
    if "nccl" in backend and dist.is_nccl_available():
        options = dist.ProcessGroupNCCL.Options()
        options.is_high_priority_stream = False  # torch's default for the groups it builds itself
    else:
        from torch._C._distributed_c10d import Backend

        options = Backend.Options(backend, timeout)
    options._timeout = timeout
    return options


def compute_local_shape_and_global_offset(
    shape: torch.Size, mesh: DeviceMesh, placements: Any
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """This rank's shard shape and offset in a DTensor of ``shape`` (torch's own chunking rule, uneven sizes too);
    DTensor exposes no public equivalent (``torch.distributed.tensor._utils``). Computed outside any fake-tensor mode
    (the dry run's, :mod:`lightning_tp.dryrun`): it reads the mesh's rank map, a real tensor, whose values a fake
    tensor would not have; the result depends on the mesh alone."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset as compute

    with unset_fake_temporarily():
        return compute(shape, mesh, placements)


def strided_shard(dim: int, split_factor: int) -> Any:
    """The placement of a tensor packed from ``split_factor`` blocks on ``dim``, each rank holding its slice of every
    block (torch's ``_StridedShard``, private; Transformers' ``packed_colwise`` uses it too)."""
    from torch.distributed.tensor.placement_types import _StridedShard

    return _StridedShard(dim, split_factor=split_factor)


def is_strided_shard(placement: Any) -> bool:
    """Whether a placement is torch's private ``_StridedShard`` (see :func:`strided_shard`)."""
    from torch.distributed.tensor.placement_types import _StridedShard

    return isinstance(placement, _StridedShard)


def strided_split_factor(placement: Any) -> int:
    """How many blocks a ``_StridedShard`` placement cuts alike (its ``split_factor``: q|k|v, gate|up, or the TP
    shards that FSDP2 shards further); 1 for any other placement."""
    return int(placement.split_factor) if is_strided_shard(placement) else 1


def standalone_process_group(store: Any, *, rank: int, size: int, backend: str, timeout: Any) -> Any:
    """A process group of ``size`` ranks on ``store``, outside the default group and its job (a hand-off between two
    jobs): torch's backend classes built directly, as ``init_process_group`` builds them inside.

    Raises:
        ValueError: ``backend`` is neither ``"gloo"`` nor ``"nccl"``.
    """
    if backend == "gloo":
        return dist.ProcessGroupGloo(store, rank, size, timeout)
    if backend == "nccl":
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout  # torch's own field for it (no public setter)
        return dist.ProcessGroupNCCL(store, rank, size, options)
    raise ValueError(f"The weight hand-off's backend must be 'gloo' or 'nccl', got {backend!r}.")


@contextmanager
def cutting_strided_shards(misplaced: Callable[[Any], bool]) -> Iterator[None]:
    """Within the block, torch's ``_distribute_tensors`` (``set_model_state_dict``/``set_optimizer_state_dict`` with
    ``full_state_dict`` and ``broadcast_from_rank0``: Lightning's load of a full checkpoint file) cuts right what it
    cuts wrong. It cuts each rank's shard as the contiguous chunk at the offset
    ``compute_local_shape_and_global_offset`` gives, which for a DTensor where ``misplaced`` holds (a lone
    ``_StridedShard``; torch 2.13 to 2.15, whose function is the same) is neither that chunk nor the rank's blocks:
    rows of the whole are lost. Those are cut by ``distribute_tensor`` from the whole each rank holds (no
    communication); every other key as torch does. A patch of torch's module through
    :func:`lightning_tp.patches.patched`, undone on leaving the block; a nested block reuses the outer one's."""
    from torch.distributed import _state_dict_utils as utils
    from torch.distributed.tensor import distribute_tensor

    from lightning_tp import patches

    if patches.installed(utils, "_distribute_tensors") is not None:
        yield
        return
    original = utils._distribute_tensors

    def _distribute_tensors(local_state_dict: dict, keys: list, device: Any, pg: Any = None) -> None:
        rest = []
        for key in keys:
            entry = local_state_dict.get(key)
            if entry is None or torch.is_tensor(entry) or not misplaced(entry[0]):
                rest.append(key)
                continue
            local_state, whole = entry
            cut = distribute_tensor(whole, local_state.device_mesh, local_state.placements, src_data_rank=None)
            if local_state.is_meta:
                local_state_dict[key] = cut
            else:
                local_state.to_local().copy_(cut.to_local())
                local_state_dict[key] = local_state
        original(local_state_dict, rest, device, pg)

    with patches.patched(utils, "_distribute_tensors", _distribute_tensors):
        yield


def install_dtensor_rng_tracker(mesh: DeviceMesh) -> bool:
    """Create DTensor's random-number tracker for ``mesh`` now, without synchronising the generators (no collective),
    unless one exists or the device has none (CPU). Returns whether one exists afterwards. torch otherwise creates it
    at the first random DTensor op, with a broadcast of rank 0's CUDA state over the world group: that op then hangs
    if only some ranks run it, and it overwrites every rank's CUDA generator. The tracker is a private global."""
    from torch.distributed.tensor import _random

    if _random._rng_tracker is None and mesh.device_type != "cpu" and _random.is_rng_supported_mesh(mesh):
        _random._rng_tracker = _random.OffsetBasedRNGTracker(mesh, run_state_sync=False)
    return _random._rng_tracker is not None


def forward_only_actions(schedule: Any) -> None:
    """Keep only the forward actions (and their sends, receives and FSDP2 unshards/reshards) of each rank's list in
    a V-shaped schedule (``ZBVZeroBubble``, ``DualPipeV``). Why: its ``eval()`` still runs the backward actions (torch
    2.13 to 2.15): on 2.13 one of them, handing an input gradient to the adjacent stage on the same rank, asserts that
    the stage has a backward; on 2.15 the ranks block in a receive until the process group's timeout (measured without
    this rewrite: gloo, 120 s). Its action lists (``pipeline_order_with_comms``) and their kinds are private; no public
    forward-only mode of these schedules works.

    torch 2.15 retires each send by an explicit ``WAIT_SEND_F``/``WAIT_SEND_B`` action (placed after the backward
    that proves the peer received it) and fails a step that leaves one unwaited ("Pipeline sends have no matching
    wait"): the forward sends' waits are kept, where torch put them. torch 2.13 and 2.14 have no such kind (they wait
    on every send at the end of the step). Dropping actions from every rank's list never deadlocks a list that did not:
    each kept action waits only on kept actions of other ranks, in the same order as before."""
    from torch.distributed.pipelining.schedules import _ComputationType as Kind

    kept = {Kind.FORWARD, Kind.SEND_F, Kind.RECV_F, Kind.UNSHARD, Kind.RESHARD}
    if hasattr(Kind, "WAIT_SEND_F"):  # torch >= 2.15
        kept.add(Kind.WAIT_SEND_F)
    for rank, actions in schedule.pipeline_order_with_comms.items():
        schedule.pipeline_order_with_comms[rank] = [a for a in actions if a is not None and a.computation_type in kept]


def fsspec_writer_class() -> type:
    """DCP's fsspec writer: public from torch 2.15 (``torch.distributed.checkpoint.FsspecWriter``); torch 2.13 and 2.14
    have only the private ``_fsspec_filesystem`` module, which 2.15 deprecates with a warning at its import."""
    import torch.distributed.checkpoint as dcp

    if hasattr(dcp, "FsspecWriter"):  # torch >= 2.15
        return dcp.FsspecWriter
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter

    return FsspecWriter


def fsspec_reader_class() -> type:
    """DCP's fsspec reader, public or private as :func:`fsspec_writer_class` says."""
    import torch.distributed.checkpoint as dcp

    if hasattr(dcp, "FsspecReader"):  # torch >= 2.15
        return dcp.FsspecReader
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader

    return FsspecReader


def torch_get_layout() -> Callable[[str], Any]:
    """What a DCP index pickles to name a tensor layout (``torch.serialization._get_layout``): the safe unpickler
    must hand back this very function."""
    return torch.serialization._get_layout


def fake_world_store() -> dist.Store:
    """A store for torch's ``"fake"`` backend (importing its module registers the backend): a process group whose
    collectives return at once and leave their tensors as they are, so that one process can act as any rank of any
    world size (the dry run, :mod:`lightning_tp.dryrun`). torch keeps it under ``torch.testing._internal`` (torchtitan's
    memory estimation uses it the same way); its ``FakeStore`` has been there since torch 2.1."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    return FakeStore()


def group_by_name(name: str) -> Any:
    """The process group a functional collective names by string (``torch.ops._c10d_functional.*``'s
    ``group_name``): the dry run reads which ranks a recorded collective spans. ``_resolve_process_group`` is private
    in every torch this package supports."""
    from torch.distributed.distributed_c10d import _resolve_process_group

    return _resolve_process_group(name)


def clear_dtensor_sharding_cache() -> None:
    """Forget DTensor's cached sharding propagation. Its caches key on a mesh's value (layout and rank map), not on its
    process groups: a dry run that simulates one rank after another, each in a new world, would get the previous
    world's mesh (with group names that no longer resolve) back from them. ``_clear_sharding_prop_cache`` is torch's
    own helper, private in every version this package supports."""
    from torch.distributed.tensor.debug import _clear_sharding_prop_cache

    _clear_sharding_prop_cache()


def process_group_of(arg: Any) -> dist.ProcessGroup | None:
    """The process group ``arg`` is, as an operator of ``torch.ops.c10d`` receives it (a ``ScriptObject`` boxing it in
    torch 2.13 to 2.15, unboxed by ``ProcessGroup.unbox``, not documented), or ``None`` when it is none."""
    if isinstance(arg, torch.ScriptObject):
        unbox = getattr(dist.ProcessGroup, "unbox", None)
        if unbox is None:
            return None
        try:
            arg = unbox(arg)
        except RuntimeError:  # a ScriptObject of another class
            return None
    return arg if isinstance(arg, dist.ProcessGroup) else None
