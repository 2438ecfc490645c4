"""The parallel state of a model: what :func:`lightning_tp.parallelize` made of it, in one object reachable from the
model through one attribute.

It holds the layout and the meshes the model was sharded over, the options it was built with and the resolved plan
of each model inside it, so that what runs on the model later reads it from the model instead of being handed each
piece again: ``grad_norm(model)`` and ``clip_grad_norm_(model, ...)`` cover every pipeline stage with no extra
argument. Built once per :func:`parallelize` (or strategy setup) and never changed after it. Found from the module
given or one holding it, not from a submodule: under pipeline parallelism ``grad_norm(model.model.layers[0])`` is
that stage's norm.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from lightning_tp.layout import PP_AXIS, TP_AXIS, ParallelLayout

if TYPE_CHECKING:
    from torch import nn
    from torch.distributed.device_mesh import DeviceMesh

#: The one attribute of a parallelised module that holds its :class:`ParallelState` (on the module given to
#: :func:`lightning_tp.parallelize` and on each model found inside it).
STATE_ATTR = "lightning_tp_state"


@dataclass(frozen=True, eq=False)
class ParallelState:
    """What a model was parallelised into: its ``layout``, the ``mesh`` (and ``expert_mesh`` with ``ep_size > 1``)
    it is sharded over, the ``options`` it was built with (:class:`~lightning_tp.ParallelOptions`) and ``targets``,
    the resolved plan of each model inside it, and ``pipelines``, the runner of each pipelined model (its stages,
    and a weight tied across stages). Read it with :func:`parallel_state`.

    Args:
        layout, mesh, options, targets, expert_mesh, pipelines: as above; built by :func:`lightning_tp.parallelize`
            and the strategies, not by users.

    Raises:
        Nothing: a record, never changed after it is built.
    """

    layout: ParallelLayout
    mesh: DeviceMesh
    options: Any
    targets: Any
    expert_mesh: DeviceMesh | None = None
    pipelines: tuple[Any, ...] = ()

    @property
    def tp_mesh(self) -> DeviceMesh:
        """The tensor-parallel axis."""
        return self.mesh[TP_AXIS]

    @property
    def pp_group(self) -> Any | None:
        """The process group of this rank's pipeline, or ``None`` with ``pp_size=1``: what sums a gradient norm over
        every stage."""
        return pipeline_group(self.layout, self.mesh)

    def attach(self, modules: Iterable[nn.Module]) -> None:
        """Make this the state of each of ``modules`` that has none yet (a module parallelised by an earlier call,
        fit then validate, keeps its own)."""
        for module in modules:
            if module.__dict__.get(STATE_ATTR) is None:  # its own, not one a wrapper's `__getattr__` forwards
                setattr(module, STATE_ATTR, self)


def pipeline_group(layout: ParallelLayout, mesh: DeviceMesh) -> Any | None:
    """The process group of this rank's pipeline on ``mesh`` (``layout``'s), or ``None`` with ``pp_size=1``."""
    return mesh[PP_AXIS].get_group() if layout.pp_size > 1 else None


def parallel_state(module: nn.Module) -> ParallelState | None:
    """The :class:`ParallelState` of ``module``, or of the first parallelised module inside it; ``None`` when nothing
    in it was parallelised by this package.

    Args:
        module: the module given to :func:`lightning_tp.parallelize` or set up by a strategy, a model inside it, or a
            module holding one (a LightningModule, a ``PeftModel``).

    Raises:
        Nothing: a module nothing parallelised gives ``None``.
    """
    for inner in module.modules():
        state = inner.__dict__.get(STATE_ATTR)
        if state is not None:
            return state
    return None


__all__ = ["STATE_ATTR", "ParallelState", "parallel_state", "pipeline_group"]
