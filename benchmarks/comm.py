"""Count the collectives a piece of code issues: kind, count and bytes, split by phase (forward, backward, ...).

    from benchmarks.comm import count_collectives
    counts = count_collectives(lambda: model(**batch).loss.backward())
    # {"all_reduce": {"count": 14, "bytes": 7340032}, ...}

Method: a ``TorchDispatchMode`` that sees every collective op on its way to the process group, the same interception
as torch's ``CommDebugMode`` (torch 2.13), plus the byte sizes CommDebugMode does not record:

* functional collectives (``torch.ops._c10d_functional.*``), which DTensor redistributes issue;
* the in-place c10d ops (``torch.ops.c10d.allreduce_`` ...) behind ``torch.distributed.all_reduce`` and friends,
  called directly (Transformers' row-wise inference path, the strategy's gradient sums, Lightning's ``reduce``).

Time (``seconds[phase]``): the wall time of each collective call, of each ``wait_tensor`` (where an async functional
collective is waited for), and of an in-place c10d op's work, waited for in the call (the caller's own wait is then
immediate), with the device synchronised around it on CUDA. It includes waiting for the slower rank to arrive, which
the step pays too; waiting in the call serialises what would overlap (FSDP2's prefetching all-gathers), so under
FSDP2 it is an upper bound of what the collectives cost the step.

The mode returns ``NotImplemented`` for DTensor arguments, so DTensor's dispatch runs first and the collectives it
decides on come back through the mode. Collectives issued in backward are seen too: on CPU the autograd engine runs in
the calling thread, and on CUDA the engine's worker threads inherit the dispatch mode stack.

Bytes follow the nccl-tests convention: the size of the whole tensor being reduced or gathered, per rank (all-reduce:
its input; all-gather: its gathered output; reduce-scatter: its unscattered input; broadcast: the tensor). A ring
moves ``2 (n-1)/n`` of that per rank for an all-reduce and ``(n-1)/n`` for the others.
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Callable
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

_funcol = torch.ops._c10d_functional
_funcol_autograd = torch.ops._c10d_functional_autograd
_c10d = torch.ops.c10d

#: op packet -> (kind, where the payload is: "in" first tensor argument(s), "out" the result, or an argument index)
_OPS: dict[Any, tuple[str, Any]] = {
    _funcol.all_reduce: ("all_reduce", "in"),
    _funcol.all_reduce_: ("all_reduce", "in"),
    _funcol.all_reduce_coalesced: ("all_reduce", "in"),
    _funcol.all_reduce_coalesced_: ("all_reduce", "in"),
    _funcol.all_gather_into_tensor: ("all_gather", "out"),
    _funcol.all_gather_into_tensor_out: ("all_gather", "out"),
    _funcol.all_gather_into_tensor_coalesced: ("all_gather", "out"),
    _funcol.reduce_scatter_tensor: ("reduce_scatter", "in"),
    _funcol.reduce_scatter_tensor_coalesced: ("reduce_scatter", "in"),
    _funcol.all_to_all_single: ("all_to_all", "in"),
    _funcol.broadcast: ("broadcast", "in"),
    _funcol.broadcast_: ("broadcast", "in"),
    _funcol_autograd.all_to_all_single: ("all_to_all", "in"),
    _c10d.allreduce_: ("all_reduce", 0),
    _c10d.allreduce_coalesced_: ("all_reduce", 0),
    _c10d._allgather_base_: ("all_gather", 0),
    _c10d.allgather_: ("all_gather", 0),
    _c10d.allgather_coalesced_: ("all_gather", 0),
    _c10d.allgather_into_tensor_coalesced_: ("all_gather", 0),
    _c10d._reduce_scatter_base_: ("reduce_scatter", 1),
    _c10d.reduce_scatter_: ("reduce_scatter", 1),
    _c10d.reduce_scatter_tensor_coalesced_: ("reduce_scatter", 1),
    _c10d.alltoall_: ("all_to_all", 1),
    _c10d.alltoall_base_: ("all_to_all", 1),
    _c10d.broadcast_: ("broadcast", 0),
    _c10d.reduce_: ("reduce", 0),
    _c10d.gather_: ("gather", 1),
    _c10d.scatter_: ("scatter", 1),
    _c10d.barrier: ("barrier", None),
}
_WAIT = _funcol.wait_tensor


def _nbytes(obj: Any) -> int:
    tensors, _ = tree_flatten(obj)
    return sum(t.numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor))


class CollectiveCounter(TorchDispatchMode):
    """Records every collective issued while active: ``counts[phase][kind] = {"count", "bytes"}``.

    ``phase`` is set by the caller (``counter.phase = "optimizer"``); collectives issued while autograd runs a
    backward pass are recorded under ``"backward"`` whatever the phase. ``events`` keeps ``(phase, kind, bytes,
    shape, dtype)`` of each, in order. ``dtensor_ops[phase]`` counts the ops dispatched on DTensors (each one goes
    through DTensor's sharding propagation on the host: the dispatch overhead).
    """

    def __init__(self) -> None:
        super().__init__()
        self.phase = "forward"
        self.counts: dict[str, dict[str, dict[str, int]]] = defaultdict(
            lambda: defaultdict(lambda: dict(count=0, bytes=0))
        )
        self.events: list[tuple[str, str, int, tuple[int, ...], str]] = []
        self.dtensor_ops: dict[str, int] = defaultdict(int)
        self.seconds: dict[str, float] = defaultdict(float)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if isinstance(func, torch._ops.HigherOrderOperator):
            return func(*args, **kwargs)
        from torch.distributed.tensor import DTensor

        if any(issubclass(t, DTensor) for t in types):
            self.dtensor_ops[self._phase()] += 1
            return NotImplemented  # let DTensor dispatch; its collectives come back through this mode
        entry = _OPS.get(func._overloadpacket)
        if entry is None and func._overloadpacket is not _WAIT:
            return func(*args, **kwargs)
        cuda = any(isinstance(t, torch.Tensor) and t.is_cuda for t in tree_flatten((args, kwargs))[0])
        if cuda:  # NCCL's waits only order streams: time the device's work, not the launch
            torch.cuda.synchronize()
        started = time.perf_counter()
        out = func(*args, **kwargs)
        for item in out if isinstance(out, tuple) else (out,):
            if isinstance(item, torch.ScriptObject) and hasattr(item, "wait"):
                item.wait()  # an in-place c10d op's work (alone, or beside its tensors)
        if cuda:
            torch.cuda.synchronize()
        self.seconds[self._phase()] += time.perf_counter() - started
        if entry is not None:
            kind, where = entry
            payload = None if where is None else out if where == "out" else args[0] if where == "in" else args[where]
            first = next((t for t in tree_flatten(payload)[0] if isinstance(t, torch.Tensor)), None)
            phase = self._phase()
            size = _nbytes(payload)
            record = self.counts[phase][kind]
            record["count"] += 1
            record["bytes"] += size
            shape = tuple(first.shape) if first is not None else ()
            dtype = str(first.dtype).removeprefix("torch.") if first is not None else ""
            self.events.append((phase, kind, size, shape, dtype))
        return out

    def _phase(self) -> str:
        return "backward" if torch._C._current_graph_task_id() != -1 else self.phase

    def totals(self) -> dict[str, dict[str, int]]:
        """Counts and bytes by kind, over every phase."""
        return merge(self.counts.values())

    def by_phase(self) -> dict[str, dict[str, dict[str, int]]]:
        return {phase: {kind: dict(v) for kind, v in kinds.items()} for phase, kinds in self.counts.items()}


def merge(groups) -> dict[str, dict[str, int]]:
    total: dict[str, dict[str, int]] = {}
    for kinds in groups:
        for kind, value in kinds.items():
            record = total.setdefault(kind, dict(count=0, bytes=0))
            record["count"] += value["count"]
            record["bytes"] += value["bytes"]
    return dict(sorted(total.items()))


def count_collectives(fn: Callable[[], Any]) -> dict[str, dict[str, int]]:
    """Run ``fn()`` and return the collectives it issued, by kind: ``{kind: {"count": n, "bytes": b}}``."""
    with CollectiveCounter() as counter:
        fn()
    return counter.totals()


__all__ = ["CollectiveCounter", "count_collectives", "merge"]
