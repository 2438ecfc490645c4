"""The parallel layout: how many ranks each mesh axis gets, validated once, and the named device mesh built from it.

Axes, outermost first: ``pp`` (pipeline parallel: each rank of a group holds some of the model's stages; only built
with ``pp_size > 1``; outermost because its point-to-point traffic tolerates the slowest links), ``dp_replicate``
(replicated data parallel, e.g. across nodes), ``dp_shard`` (FSDP2 data
parallel), ``cp`` (context parallel: the ranks of a group split each sequence and see the same rows) and ``tp``
(tensor parallel, innermost so a TP group stays on one node's fast links). The TP axis is named exactly ``tp``
because Transformers' and PEFT's TP code looks the axis up by that name.

FSDP2 shards the parameters over ``dp_shard`` x ``cp`` (the flattened ``dp_shard_cp`` axis, as torchtitan does): the
ranks of a CP group hold the same weights and reduce their gradients together, so they may as well shard them.

Expert parallelism (``ep_size > 1``) borrows its axis from the ranks below ``dp_replicate`` (``dp_shard`` x ``cp`` x
``tp``), as Transformers' ``DistributedConfig(ep_size)`` and torchtitan do: the same ranks laid out again as the
expert mesh (``dp_replicate``, ``efsdp``, ``ep``), ``ep`` innermost so that an EP group holds whole TP groups. Each
rank of an EP group holds ``1/ep`` of the experts, whole; FSDP2 shards them further over ``efsdp`` (the ranks holding
the same experts: ``dp_shard x cp x tp / ep``).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from datetime import timedelta
from typing import TYPE_CHECKING, Any

from lightning_tp.compat import flatten_mesh
from lightning_tp.compat import group_options as compat_group_options

if TYPE_CHECKING:
    from collections.abc import Callable

    from torch.distributed.device_mesh import DeviceMesh

#: Mesh axis names, outermost first.
PP_AXIS = "pp"
DP_REPLICATE_AXIS = "dp_replicate"
DP_SHARD_AXIS = "dp_shard"
CP_AXIS = "cp"
TP_AXIS = "tp"
#: Every axis of the mesh, outermost first (``pp`` only where ``pp_size > 1``: see :meth:`ParallelLayout.mesh_axes`).
MESH_AXES = (PP_AXIS, DP_REPLICATE_AXIS, DP_SHARD_AXIS, CP_AXIS, TP_AXIS)
#: The flattened data-parallel axis (``dp_replicate`` x ``dp_shard``): the sampler and metric reductions use it.
DP_AXIS = "dp"
#: The flattened ``dp_shard`` x ``cp`` axis that FSDP2 shards over (built only when ``cp_size > 1``).
DP_SHARD_CP_AXIS = "dp_shard_cp"
#: The expert mesh's axes (built only when ``ep_size > 1``): ``ep`` splits the experts, ``efsdp`` shards each rank's
#: experts with FSDP2 (the ranks holding the same ones), ``dp_replicate`` as on the dense mesh.
EP_AXIS = "ep"
EFSDP_AXIS = "efsdp"
EXPERT_MESH_AXES = (DP_REPLICATE_AXIS, EFSDP_AXIS, EP_AXIS)


@dataclass(frozen=True)
class ParallelLayout:
    """Sizes of the mesh axes. Build it with :meth:`resolve`, which fills in unset sizes and validates them.

    Args:
        tp_size, dp_shard_size, dp_replicate_size, cp_size, ep_size, pp_size: each mesh axis's size (positive).

    Raises:
        ValueError: a size is not a positive integer, or ``ep_size`` neither is a multiple of ``tp_size`` nor divides
            the ranks below it (the message lists the sizes that would).
    """

    tp_size: int
    dp_shard_size: int = 1
    dp_replicate_size: int = 1
    cp_size: int = 1
    ep_size: int = 1
    pp_size: int = 1

    def __post_init__(self) -> None:
        for name in ("tp_size", "dp_shard_size", "dp_replicate_size", "cp_size", "ep_size", "pp_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"`{name}` must be a positive integer, got {value!r}.")
        if self.ep_size > 1:
            below = self.dp_shard_size * self.cp_size * self.tp_size
            good = [n for n in range(self.tp_size, below + 1, self.tp_size) if below % n == 0]
            if self.ep_size % self.tp_size or below % self.ep_size:
                raise ValueError(
                    f"ep_size={self.ep_size} must be a multiple of tp_size={self.tp_size} (an EP group holds whole TP "
                    f"groups, whose ranks share one batch) and divide dp_shard_size * cp_size * tp_size = "
                    f"{self.dp_shard_size} * {self.cp_size} * {self.tp_size} = {below} (the ranks it borrows). "
                    f"Use ep_size in {good}."
                )

    @property
    def world_size(self) -> int:
        return self.pp_size * self.stage_size

    @property
    def stage_size(self) -> int:
        """Ranks that hold one pipeline stage together (every rank with ``pp_size=1``)."""
        return self.dp_replicate_size * self.dp_shard_size * self.cp_size * self.tp_size

    @property
    def mesh_axes(self) -> tuple[str, ...]:
        """The axes of this layout's mesh, outermost first: :data:`MESH_AXES`, without ``pp`` unless
        ``pp_size > 1``."""
        return MESH_AXES if self.pp_size > 1 else MESH_AXES[1:]

    @property
    def dp_size(self) -> int:
        """Number of data-parallel replicas of the model: each sees a different batch."""
        return self.dp_replicate_size * self.dp_shard_size

    @property
    def fsdp_size(self) -> int:
        """Ranks that FSDP2 reduces gradients over: the data-parallel replicas and the ranks of each CP group (which
        saw the same rows, each its own part of every sequence). FSDP2 is applied when this is above 1."""
        return self.dp_size * self.cp_size

    @property
    def shard_size(self) -> int:
        """Ranks that FSDP2 shards each parameter over (``dp_shard`` x ``cp``)."""
        return self.dp_shard_size * self.cp_size

    @property
    def efsdp_size(self) -> int:
        """Ranks that hold the same experts and FSDP2-shard them (``dp_shard x cp x tp / ep``)."""
        return self.dp_shard_size * self.cp_size * self.tp_size // self.ep_size

    @classmethod
    def resolve(
        cls,
        world_size: int,
        *,
        tp_size: int | None = None,
        dp_shard_size: int | None = None,
        dp_replicate_size: int = 1,
        cp_size: int = 1,
        ep_size: int = 1,
        pp_size: int = 1,
    ) -> ParallelLayout:
        """Fill in the sizes left as ``None`` from ``world_size`` and check that they multiply to it.

        ``tp_size=None`` takes every rank the data-parallel and CP axes leave (as Transformers' ``DistributedConfig``
        infers it from ``WORLD_SIZE``); ``dp_shard_size=None`` takes what ``tp_size``, ``cp_size`` and
        ``dp_replicate_size`` leave. ``pp_size`` ranks hold the stages of one model: the other sizes split what is
        left (``world_size / pp_size``).

        Args:
            world_size: the number of ranks.
            tp_size, dp_shard_size, dp_replicate_size, cp_size, ep_size, pp_size: as the strategy's arguments of those
                names; ``None`` is filled in as above.

        Raises:
            ValueError: the sizes do not multiply to ``world_size``, or one is not a positive integer (named, with the
                sizes that would).
        """
        if world_size < 1:
            raise ValueError(f"world_size must be positive, got {world_size}.")
        if not isinstance(pp_size, int) or isinstance(pp_size, bool) or pp_size < 1:
            raise ValueError(f"`pp_size` must be a positive integer, got {pp_size!r}.")
        if world_size % pp_size:
            raise ValueError(
                f"The world size ({world_size}) is not divisible by pp_size={pp_size}. Use a pp_size that divides it "
                f"({_divisors(world_size)}) or run on a multiple of {pp_size} devices."
            )
        if pp_size > 1:
            inner = cls.resolve(
                world_size // pp_size,
                tp_size=tp_size,
                dp_shard_size=dp_shard_size,
                dp_replicate_size=dp_replicate_size,
                cp_size=cp_size,
                ep_size=ep_size,
            )
            return replace(inner, pp_size=pp_size)
        for name, value in (("tp_size", tp_size), ("dp_shard_size", dp_shard_size)):
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
                raise ValueError(f"`{name}` must be a positive integer or None, got {value!r}.")
        for name, value in (("dp_replicate_size", dp_replicate_size), ("cp_size", cp_size), ("ep_size", ep_size)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"`{name}` must be a positive integer, got {value!r}.")
        if tp_size is None:
            other = dp_replicate_size * (dp_shard_size or 1) * cp_size
            if world_size % other:
                raise ValueError(
                    f"The world size ({world_size}) is not divisible by dp_replicate_size * dp_shard_size * cp_size "
                    f"({dp_replicate_size} * {dp_shard_size or 1} * {cp_size} = {other}), so `tp_size` cannot be "
                    "inferred. Change the data-parallel or CP sizes or the number of devices."
                )
            tp_size = world_size // other
        if world_size % (tp_size * cp_size):
            model_parallel = f"tp_size={tp_size}" if cp_size == 1 else f"tp_size * cp_size={tp_size * cp_size}"
            raise ValueError(
                f"The world size ({world_size}) is not divisible by {model_parallel}. Use sizes whose product divides "
                f"it ({_divisors(world_size)}) or run on a multiple of {tp_size * cp_size} devices."
            )
        if dp_shard_size is None:
            if (world_size // tp_size // cp_size) % dp_replicate_size:
                raise ValueError(
                    f"world size {world_size} / (tp_size {tp_size} * cp_size {cp_size}) = "
                    f"{world_size // tp_size // cp_size} ranks of data parallelism are not divisible by "
                    f"dp_replicate_size={dp_replicate_size}."
                )
            dp_shard_size = world_size // tp_size // cp_size // dp_replicate_size
        dense = cls(tp_size=tp_size, dp_shard_size=dp_shard_size, dp_replicate_size=dp_replicate_size, cp_size=cp_size)
        if dense.world_size != world_size:
            raise ValueError(
                f"dp_replicate_size * dp_shard_size * cp_size * tp_size = {dp_replicate_size} * {dp_shard_size} * "
                f"{cp_size} * {tp_size} = {dense.world_size}, but the world size is {world_size}. Make the sizes "
                "multiply to the number of processes, or leave `dp_shard_size=None` to infer it."
            )
        # The EP axis borrows ranks of the others: checked once their sizes are known.
        layout = replace(dense, ep_size=ep_size) if ep_size > 1 else dense
        return layout

    def build_device_mesh(self, device_type: str, *, timeout: timedelta | None = None) -> tuple[DeviceMesh, DeviceMesh]:
        """Build the mesh (``dp_replicate``, ``dp_shard``, ``cp``, ``tp``; ``pp`` before them with ``pp_size > 1``) and
        its flattened 1-D ``dp`` mesh (with ``cp_size > 1``, the flattened ``dp_shard_cp`` axis FSDP2 shards over is
        built too: ``mesh["dp_shard_cp"]``).

        Needs an initialised process group; every rank must call it. torch asks callers to keep the flattened mesh
        themselves rather than slice it from the root, hence the pair. ``timeout`` reaches every group the mesh
        creates: without it torch builds them with the backend's default (10 minutes on NCCL, 30 on gloo), not the
        world group's timeout, and a stuck peer would hold the job that long.

        Built once per world group: a later call with the same layout, device type and timeout returns the same
        meshes (see :func:`_once_per_world`).
        """
        # Keyed without `ep_size`: the dense mesh is the same with or without experts (theirs is another mesh).
        key = ("dense", replace(self, ep_size=1), device_type, timeout)
        return _once_per_world(key, lambda: self._build_device_mesh(device_type, timeout))

    def _build_device_mesh(self, device_type: str, timeout: timedelta | None) -> tuple[DeviceMesh, DeviceMesh]:
        from torch.distributed.device_mesh import init_device_mesh

        shape = (self.dp_replicate_size, self.dp_shard_size, self.cp_size, self.tp_size)
        if self.pp_size > 1:
            shape = (self.pp_size, *shape)
        names = self.mesh_axes
        options = group_options(timeout)
        # An axis over the whole world reuses the world group (which has the timeout already) only without override.
        override = (
            {name: options for name, size in zip(names, shape, strict=True) if size != self.world_size}
            if options
            else None
        )
        mesh = init_device_mesh(device_type, shape, mesh_dim_names=names, backend_override=override or None)
        # One group over every data-parallel rank, for the sampler and metric reductions.
        flat_override = options if options is not None and self.dp_size != self.world_size else None
        dp_mesh = flatten_mesh(mesh[(DP_REPLICATE_AXIS, DP_SHARD_AXIS)], DP_AXIS, backend_override=flat_override)
        if self.cp_size > 1:
            # FSDP2's shard axis; flattened here, where the timeout is known (later calls get this one back).
            shard_override = options if options is not None and self.shard_size != self.world_size else None
            flatten_mesh(mesh[(DP_SHARD_AXIS, CP_AXIS)], DP_SHARD_CP_AXIS, backend_override=shard_override)
        return mesh, dp_mesh

    def build_expert_mesh(self, device_type: str, *, timeout: timedelta | None = None) -> DeviceMesh:
        """The expert mesh (``dp_replicate``, ``efsdp``, ``ep``; ``pp`` outermost under pipeline parallelism, as in
        the dense mesh) over the same ranks as the dense one, for ``ep_size > 1``: the ranks below ``dp_replicate``
        laid out again, ``ep`` innermost (contiguous ranks, so that an EP group holds whole TP groups and, with
        ``ep_size == tp_size``, is the TP group; it never spans two pipeline stages). Every rank must call it;
        ``timeout`` and reuse as in :meth:`build_device_mesh`."""
        if self.ep_size == 1:
            raise ValueError("`build_expert_mesh` builds the mesh of expert parallelism: this layout has ep_size=1.")
        return _once_per_world(
            ("expert", self, device_type, timeout), lambda: self._build_expert_mesh(device_type, timeout)
        )

    def _build_expert_mesh(self, device_type: str, timeout: timedelta | None) -> DeviceMesh:
        from torch.distributed.device_mesh import init_device_mesh

        shape = (self.dp_replicate_size, self.efsdp_size, self.ep_size)
        names = EXPERT_MESH_AXES
        if self.pp_size > 1:
            shape, names = (self.pp_size, *shape), (PP_AXIS, *names)
        options = group_options(timeout)
        override = (
            {name: options for name, size in zip(names, shape, strict=True) if size != self.world_size}
            if options
            else None
        )
        return init_device_mesh(device_type, shape, mesh_dim_names=names, backend_override=override or None)

    def __str__(self) -> str:
        cp = f" x cp={self.cp_size}" if self.cp_size > 1 else ""
        ep = f", ep={self.ep_size} x efsdp={self.efsdp_size} for the experts" if self.ep_size > 1 else ""
        pp = f"pp={self.pp_size} x " if self.pp_size > 1 else ""
        return (
            f"{pp}dp_replicate={self.dp_replicate_size} x dp_shard={self.dp_shard_size}{cp} x tp={self.tp_size}{ep} "
            f"(world size {self.world_size})"
        )


#: The meshes built in this process: ``(world group, {key: meshes})``. See :func:`_once_per_world`.
_BUILT: list[Any] = [None, {}]


def _once_per_world(key: tuple, build: Callable[[], Any]) -> Any:
    """``build()`` once per ``key`` while the world group stays the same. torch never frees a process group before
    the world group is destroyed: each mesh built anew leaks its groups' threads and sockets (on gloo about 12 threads
    per 2 x 2 mesh, and with 80 such meshes alive a 2-rank all-reduce took 2.2 times as long) or, on NCCL, its
    communicators and their device buffers; a second ``Trainer`` (``fit`` then ``test``, a sweep, a notebook) would
    build them again. A new world group (after ``destroy_process_group``) starts afresh."""
    import torch.distributed as dist

    if _BUILT[0] is not dist.group.WORLD:
        _BUILT[:] = [dist.group.WORLD, {}]
    if key not in _BUILT[1]:
        meshes = build()
        if _BUILT[0] is not dist.group.WORLD:  # `init_device_mesh` made the world group itself
            _BUILT[:] = [dist.group.WORLD, {}]
        _BUILT[1][key] = meshes
    return _BUILT[1][key]


def group_options(timeout: timedelta | None) -> Any:
    """Backend options of the world's backend that carry ``timeout`` into the groups ``init_device_mesh`` and
    ``flatten_mesh`` create, or ``None`` for torch's default."""
    if timeout is None:
        return None
    import torch.distributed as dist

    return compat_group_options(str(dist.get_backend()), timeout)


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]
