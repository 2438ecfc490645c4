"""What one simulated rank does in a step, recorded as it runs: every collective it issues (:class:`CollectiveRecorder`)
and the bytes its tensors hold at each moment (:class:`LiveBytes`). Both are ``TorchDispatchMode``s, so they see the
real code's operations whatever issued them (DTensor's redistributions, FSDP2's all-gathers, this package's own
collectives), on fake tensors in the dry run and on real ones when a test measures a real run the same way."""

from __future__ import annotations

import math
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from lightning_tp.compat import TorchDispatchMode, group_by_name, process_group_of, tree_leaves
from lightning_tp.patches import install

#: The operator namespaces that hold torch's collectives: the in-place ``c10d`` ops ``torch.distributed``'s functions
#: issue (FSDP2, this package's autograd functions) and the functional ones DTensor issues.
COLLECTIVE_NAMESPACES = ("c10d", "_c10d_functional", "c10d_functional")

#: Each collective operator's kind, by its name without the namespace and overload. A name not here is recorded under
#: its own name (so a new torch's operator is still compared across ranks); ``wait_tensor`` is not a collective.
KINDS = {
    "allreduce_": "all_reduce",
    "allreduce_coalesced_": "all_reduce",
    "all_reduce": "all_reduce",
    "all_reduce_": "all_reduce",
    "all_reduce_coalesced": "all_reduce",
    "all_reduce_coalesced_": "all_reduce",
    "_allgather_base_": "all_gather",
    "allgather_": "all_gather",
    "allgather_coalesced_": "all_gather",
    "allgather_into_tensor_coalesced_": "all_gather",
    "all_gather_into_tensor": "all_gather",
    "all_gather_into_tensor_out": "all_gather",
    "all_gather_into_tensor_coalesced": "all_gather",
    "_reduce_scatter_base_": "reduce_scatter",
    "reduce_scatter_": "reduce_scatter",
    "reduce_scatter_tensor_coalesced_": "reduce_scatter",
    "reduce_scatter_tensor": "reduce_scatter",
    "reduce_scatter_tensor_coalesced": "reduce_scatter",
    "alltoall_base_": "all_to_all",
    "alltoall_": "all_to_all",
    "all_to_all_single": "all_to_all",
    "broadcast_": "broadcast",
    "broadcast": "broadcast",
    "send": "send",
    "recv_": "recv",
    "recv_any_source_": "recv",
    "barrier": "barrier",
    "reduce_": "reduce",
    "gather_": "gather",
    "scatter_": "scatter",
}
#: Operators of the collective namespaces that move nothing (a wait; the wrapper that lets autograd wait on a
#: functional collective's result, issued on real tensors only).
NOT_COLLECTIVES = frozenset({"wait_tensor", "_wrap_tensor_autograd", "monitored_barrier_"})


@dataclass(frozen=True)
class Call:
    """One collective a rank issued: its ``kind`` (``all_reduce``, ``all_gather``, ...), the ``group`` of ranks it
    spans and that group's ``axis`` (a mesh axis's name, ``world``, or ``ranks ...``), the ``shapes`` and ``dtype`` of
    its tensors, ``nbytes`` (its largest tensor: an all-gather's output, a reduce-scatter's input), the ``peer`` of a
    send or receive, and where the rank was: ``phase`` (setup, forward, backward, optimizer) and the module running
    (``where``).

    Args:
        kind, group, axis, shapes, dtype, nbytes, peer, phase, where: as above; recorded, not built by users.

    Raises:
        Nothing: a record.
    """

    kind: str
    group: tuple[int, ...]
    axis: str
    shapes: tuple[tuple[int, ...], ...]
    dtype: str
    nbytes: int
    peer: int | None
    phase: str
    where: str

    @property
    def signature(self) -> tuple:
        """What every rank of the group must issue alike, in the same order, or the group hangs. A collective of
        pickled objects (``all_gather_object``, ``broadcast_object_list``: bytes, padded to the longest rank's) is
        compared by kind alone: the fake group does not exchange the lengths that decide its shapes."""
        if self.dtype == "uint8":
            return (self.kind, self.dtype)
        return (self.kind, self.shapes, self.dtype)

    def describe(self) -> str:
        shapes = ", ".join("x".join(map(str, shape)) or "scalar" for shape in self.shapes)
        peer = f" with rank {self.peer}" if self.peer is not None else ""
        return f"{self.kind}({self.dtype}[{shapes}]){peer} on {self.axis} in {self.phase} at {self.where}"

    def traffic(self) -> float:
        """Bytes this rank sends for the call with the bandwidth-optimal algorithm (a ring): ``2(n-1)/n`` of the
        buffer for an all-reduce, ``(n-1)/n`` of the whole for an all-gather, reduce-scatter or all-to-all, the
        buffer for a broadcast or a send. The one cost model the layouts are ranked by."""
        n = len(self.group)
        if n <= 1 or self.kind in ("recv", "barrier"):
            return 0.0
        share = (n - 1) / n
        factor = {"all_reduce": 2 * share, "all_gather": share, "reduce_scatter": share, "all_to_all": share}
        return self.nbytes * factor.get(self.kind, 1.0)


def _group_ranks(arg: Any) -> tuple[int, ...] | None:
    group = process_group_of(arg)
    return None if group is None else tuple(dist.get_process_group_ranks(group))


def _nbytes(kind: str, args: tuple, group_size: int, functional: bool) -> int:
    """The whole buffer a collective moves: each argument's tensors summed (a list of chunks is the whole), the
    largest argument taken (an all-gather's output, a reduce-scatter's input); a functional all-gather is handed its
    input alone, a ``group_size``-th of its output."""
    sizes = [
        sum(math.prod(t.shape) * t.element_size() for t in tree_leaves(arg) if isinstance(t, torch.Tensor))
        for arg in args
    ]
    whole = max(sizes, default=0)
    return whole * group_size if functional and kind == "all_gather" else whole


class CollectiveRecorder(TorchDispatchMode):
    """Records every collective issued while active, as :class:`Call`s in order. ``axes`` names the groups
    (ranks -> axis name); ``phase`` and the running module are set by :meth:`phase` and :meth:`watch`.

    DTensor's operations are let through first (``NotImplemented``, as torch's ``CommDebugMode`` does): a dispatch
    mode runs before a tensor subclass, so DTensor's redistributions would otherwise run below the mode, unseen.

    Args:
        axes: group ranks -> axis name (the calls can also be labelled afterwards).

    Raises:
        Nothing: a recorder; the operations run as they would.
    """

    def __init__(self, axes: dict[tuple[int, ...], str] | None = None) -> None:
        super().__init__()
        self.axes = dict(axes or {})
        self.calls: list[Call] = []
        self._phase = "setup"
        self._modules: list[str] = []

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        before, self._phase = self._phase, name
        try:
            yield
        finally:
            self._phase = before

    @contextmanager
    def watch(self, model: nn.Module) -> Iterator[None]:
        """Name the module running when a collective is issued in the forward (the innermost one)."""
        names = {id(module): name or type(model).__name__ for name, module in model.named_modules()}

        def enter(module: nn.Module, args: Any) -> None:
            self._modules.append(names.get(id(module), type(module).__name__))

        def leave(module: nn.Module, args: Any, output: Any) -> None:
            if self._modules:
                self._modules.pop()

        handles = [
            nn.modules.module.register_module_forward_pre_hook(enter),
            nn.modules.module.register_module_forward_hook(leave, always_call=True),
        ]
        try:
            yield
        finally:
            for handle in handles:
                handle.remove()
            self._modules.clear()

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        if any(issubclass(t, DTensor) for t in types):
            return NotImplemented
        kwargs = kwargs or {}
        if func.namespace in COLLECTIVE_NAMESPACES:
            name = func.overloadpacket.__name__
            if name not in NOT_COLLECTIVES:
                self.calls.append(self._call(name, args, kwargs, functional=func.namespace != "c10d"))
        return func(*args, **kwargs)

    def _call(self, name: str, args: tuple, kwargs: dict, *, functional: bool) -> Call:
        leaves = tree_leaves((args, kwargs))
        tensors = [leaf for leaf in leaves if isinstance(leaf, torch.Tensor)]
        group: tuple[int, ...] | None = None
        for leaf in leaves:
            group = _group_ranks(leaf)
            if group is None and isinstance(leaf, str):
                try:
                    group = tuple(dist.get_process_group_ranks(group_by_name(leaf)))
                except (ValueError, RuntimeError, KeyError):
                    group = None
            if group is not None:
                break
        group = group or tuple(range(dist.get_world_size()))
        kind = KINDS.get(name, name)
        peer = None
        if kind in ("send", "recv"):
            ints = [leaf for leaf in leaves if isinstance(leaf, int) and not isinstance(leaf, bool)]
            peer = group[ints[0]] if ints and 0 <= ints[0] < len(group) else None
        shapes = tuple(tuple(t.shape) for t in tensors)
        dtype = str(tensors[0].dtype).removeprefix("torch.") if tensors else "-"
        nbytes = _nbytes(kind, args, len(group), functional)
        axis = self.axes.get(group) or ("world" if len(group) == dist.get_world_size() else f"ranks {list(group)}")
        where = self._modules[-1] if self._modules and self._phase == "forward" else self._phase
        return Call(kind, group, axis, shapes, dtype, nbytes, peer, self._phase, where)


class LiveBytes(TorchDispatchMode):
    """The bytes of the storages the operations run while active have made and not yet freed: ``live`` now and its
    ``peak``. A storage is counted once (views share it), when an operation first returns it, and uncounted when torch
    frees it; a storage resized in place (FSDP2 frees and re-allocates its unsharded parameters so) is counted at its
    new size, through a patch of ``UntypedStorage.resize_`` held while the mode is (:meth:`resizes_seen`).

    Args:
        None.

    Raises:
        Nothing: a counter; the operations run as they would.
    """

    def __init__(self) -> None:
        super().__init__()
        self.live = 0
        self.peak = 0
        self._sizes: dict[int, int] = {}
        self._refs: dict[int, weakref.ref] = {}

    def reset_peak(self) -> None:
        self.peak = self.live

    def track(self, tensor: torch.Tensor) -> None:
        """Count ``tensor``'s storage from now (made before the mode was active, or by a path it does not see)."""
        if isinstance(tensor, DTensor):
            tensor = tensor.to_local()
        storage = tensor.untyped_storage()
        key = id(storage)
        if key in self._sizes:
            return
        self._sizes[key] = storage.nbytes()
        self._refs[key] = weakref.ref(storage, self._forget(key))
        self._grow(self._sizes[key])

    def _forget(self, key: int) -> Callable[[Any], None]:
        def forget(_: Any) -> None:
            size = self._sizes.pop(key, 0)
            self._refs.pop(key, None)
            self.live -= size

        return forget

    def _grow(self, size: int) -> None:
        self.live += size
        self.peak = max(self.peak, self.live)

    def resized(self, storage: Any, size: int) -> None:
        key = id(storage)
        if key not in self._sizes:
            self._sizes[key] = 0
            self._refs[key] = weakref.ref(storage, self._forget(key))
        before, self._sizes[key] = self._sizes[key], size
        self._grow(size - before)

    @contextmanager
    def resizes_seen(self) -> Iterator[None]:
        """While active, ``UntypedStorage.resize_`` tells this tracker each storage's new size.

        Raises:
            ValueError: ``resize_`` is patched already (:func:`lightning_tp.patches.install`'s check).
        """
        original = torch.UntypedStorage.resize_
        tracker = self

        def resize_(storage: Any, size: int) -> Any:
            result = original(storage, size)
            tracker.resized(storage, storage.nbytes())
            return result

        patch = install(torch.UntypedStorage, "resize_", resize_, owner=self)
        try:
            yield
        finally:
            patch.undo()

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        if any(issubclass(t, DTensor) for t in types):
            return NotImplemented
        out = func(*args, **(kwargs or {}))
        for leaf in tree_leaves(out):
            if isinstance(leaf, torch.Tensor) and not isinstance(leaf, DTensor):
                self.track(leaf)
        return out
