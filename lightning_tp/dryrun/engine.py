"""One rank of a layout, simulated in this process: the model built on the meta device, the real
:func:`lightning_tp.parallelize` on a fake process group of the real world size, then one training step (forward,
backward, clipping, the optimizer) on fake tensors, recording what the rank holds and every collective it issues."""

from __future__ import annotations

import gc
import math
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field, replace
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from lightning_tp.compat import (
    DATA_DEPENDENT_ERRORS,
    clear_dtensor_sharding_cache,
    distributed_is_initialized,
    fake_tensor_mode,
    fake_world_store,
)
from lightning_tp.dryrun.record import Call, CollectiveRecorder, LiveBytes
from lightning_tp.layout import EXPERT_MESH_AXES, ParallelLayout
from lightning_tp.parallel.grad import clip_grad_norm_
from lightning_tp.parallel_options import PRECISION_DTYPES, ParallelOptions
from lightning_tp.parallelize import parallelize
from lightning_tp.patches import undo_owned
from lightning_tp.state import parallel_state

#: Why a pipelined layout's step is not traced: torch's schedules read a tensor's value in their warm-up (the
#: stages' vote on the inference mode, ``result.item()``), which a fake tensor does not have.
PIPELINE_NOT_TRACED = (
    "the step of a pipelined layout is not traced: torch's pipeline schedule reads a tensor's value in its warm-up, "
    "which a fake tensor has not; parameters, gradients and optimizer states are exact, activations and the "
    "schedule's collectives are not counted"
)

#: Why a context-parallel layout's step is not traced: the split reads its batch on the host (the first forward's
#: check that the ranks of a group hold the same rows, the positions of packed documents), values a fake tensor has
#: not.
CONTEXT_PARALLEL_NOT_TRACED = (
    "the step of a context-parallel layout is not traced: the split reads its batch on the host (the check that the "
    "ranks of a group hold the same rows, packed documents' positions), which a fake tensor has not; parameters, "
    "gradients and optimizer states are exact, activations and the step's collectives are not counted"
)

#: Why a step that reads a tensor's value is not traced (a mixture of experts' routing, say).
DATA_DEPENDENT_NOT_TRACED = (
    "the step is not traced: the forward reads a tensor's value (a mixture of experts routes tokens by its router's "
    "output), which a fake tensor has not; parameters, gradients and optimizer states are exact, activations and the "
    "step's collectives are not counted"
)


class _NotTraceable(Exception):
    """The step's shapes depend on values a fake tensor has not (:data:`DATA_DEPENDENT_NOT_TRACED`)."""


#: The optimizers a dry run steps, by the name the command takes.
#: torch's defaults on the (fake) CPU tensors: one tensor at a time. On GPUs torch defaults to ``foreach``, whose
#: temporaries (up to the size of the parameters' shards) the optimizer's step adds to the peak where it is the
#: peak; traced with ``foreach=True`` on fake tensors, the step counted about twice what the same step holds on real
#: ones (the 2-rank check), so it is left at the default and the gap said in docs/dry-run.md.
OPTIMIZERS: dict[str, Callable[..., torch.optim.Optimizer]] = {
    "adamw": lambda params: torch.optim.AdamW(params, lr=1e-5),
    "adam": lambda params: torch.optim.Adam(params, lr=1e-5),
    "sgd": lambda params: torch.optim.SGD(params, lr=1e-5),
    "sgd-momentum": lambda params: torch.optim.SGD(params, lr=1e-5, momentum=0.9),
}


@dataclass(frozen=True)
class Workload:
    """What one training step is given: ``batch_size`` rows of ``seq_len`` tokens on each data-parallel rank (the
    ranks of a CP or pipeline group share their rows), the ``optimizer`` (:data:`OPTIMIZERS`) and the gradient norm
    clipped to (``None``: no clipping).

    Args:
        batch_size, seq_len, optimizer, clip: as above.

    Raises:
        ValueError: a size below 1 or an unknown optimizer (named, with the known ones).
    """

    batch_size: int = 1
    seq_len: int = 2048
    optimizer: str = "adamw"
    clip: float | None = 1.0

    def __post_init__(self) -> None:
        if self.batch_size < 1 or self.seq_len < 1:
            raise ValueError(f"batch_size and seq_len must be positive, got {self.batch_size} and {self.seq_len}.")
        if self.optimizer not in OPTIMIZERS:
            raise ValueError(f"Unknown optimizer {self.optimizer!r}; the dry run knows {sorted(OPTIMIZERS)}.")


@dataclass(frozen=True)
class Memory:
    """Bytes one rank holds: its ``parameters``, ``gradients`` and ``optimizer`` states (exact, from the sharded
    tensors), the ``activations`` the forward keeps for the backward, and the ``peak`` of everything alive at once in
    a step once the optimizer's states exist (``None`` where the step is not traced). ``transient`` is the peak less
    those four, as if all were alive at its moment (at least 0): FSDP2's all-gathered layers, communication buffers,
    the backward's temporaries.

    Args:
        parameters, gradients, optimizer, activations, peak: as above, in bytes.

    Raises:
        Nothing: a record.
    """

    parameters: int
    gradients: int
    optimizer: int
    activations: int | None = None
    peak: int | None = None

    @property
    def transient(self) -> int | None:
        if self.peak is None or self.activations is None:
            return None
        return max(0, self.peak - self.parameters - self.gradients - self.optimizer - self.activations)

    @property
    def total(self) -> int:
        """The peak where traced, else what is held for certain (parameters, gradients, optimizer states)."""
        return self.peak if self.peak is not None else self.parameters + self.gradients + self.optimizer


@dataclass(frozen=True)
class RankRun:
    """One simulated rank: its ``rank``, its ``coordinates`` on the mesh, its :class:`Memory`, every collective it
    issued (``calls``, setup and step), and ``not_traced``, why the step was not run (``None`` when it was).

    Args:
        rank, coordinates, memory, calls, not_traced: as above; built by :func:`simulate_rank`.

    Raises:
        Nothing: a record.
    """

    rank: int
    coordinates: dict[str, int]
    memory: Memory
    calls: tuple[Call, ...] = field(repr=False)
    not_traced: str | None = None


@contextmanager
def simulated_world(rank: int, world_size: int) -> Iterator[None]:
    """This process as ``rank`` of ``world_size`` on torch's fake process group (collectives return at once).

    Args:
        rank: the rank to be.
        world_size: the number of ranks.

    Raises:
        ValueError: a process group is already initialised (the dry run needs its own world; run it apart from
            training).
    """
    if distributed_is_initialized():
        raise ValueError(
            "A dry run simulates its own world of ranks, but a process group is already initialised: run it in a "
            "process of its own (`python -m lightning_tp.plan`), not inside a launched job."
        )
    # DTensor caches sharding by a mesh's value, which the same layout in the next world shares: forgotten on entry
    # and exit, so that no rank gets another world's mesh back (and a later real job none of the dry run's).
    clear_dtensor_sharding_cache()
    dist.init_process_group("fake", rank=rank, world_size=world_size, store=fake_world_store())
    try:
        yield
    finally:
        dist.destroy_process_group()
        clear_dtensor_sharding_cache()


def local_bytes(tensors: Any) -> int:
    """Bytes of this rank's part of each tensor (a DTensor's local shard), each tensor object once (a weight tied
    to another is one parameter).

    Args:
        tensors: tensors, DTensors or ``None`` (skipped).

    Raises:
        Nothing.
    """
    seen: set[int] = set()
    total = 0
    for tensor in tensors:
        if tensor is None or id(tensor) in seen:
            continue
        seen.add(id(tensor))
        local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
        total += math.prod(local.shape) * local.element_size()
    return total


def optimizer_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes of the optimizer's states (AdamW's two moments and step counts, say), each rank's part.

    Args:
        optimizer: a torch optimizer after a step.

    Raises:
        Nothing.
    """
    return local_bytes(
        value for state in optimizer.state.values() for value in state.values() if torch.is_tensor(value)
    )


def mesh_axis_names(model: nn.Module) -> dict[tuple[int, ...], str]:
    """Each process group of the model's meshes this rank belongs to, by its ranks, with its axis's name (flattened
    axes included: ``dp``, ``dp_shard_cp``, the expert mesh's).

    Args:
        model: parallelised by :func:`lightning_tp.parallelize` (none else: ``{}``).

    Raises:
        Nothing.
    """
    state = parallel_state(model)
    if state is None:
        return {}
    names: dict[tuple[int, ...], str] = {}
    meshes = [(state.mesh, (*state.mesh.mesh_dim_names, "dp", "dp_shard_cp"))]
    if state.expert_mesh is not None:
        meshes.append((state.expert_mesh, EXPERT_MESH_AXES))
    for mesh, axes in meshes:
        for axis in axes:
            try:
                group = mesh[axis].get_group()
            except (KeyError, RuntimeError, ValueError):
                continue
            names.setdefault(tuple(dist.get_process_group_ranks(group)), axis)
    return names


def _forget_patches(model: nn.Module) -> None:
    """Undo what ``parallelize`` patched for ``model`` (its modules' and the process-wide patches they own), as a
    strategy's teardown does: the next simulated rank starts from an unpatched process."""
    for module in model.modules():
        undo_owned(module)


def simulate_rank(
    build_model: Callable[[], nn.Module],
    layout: ParallelLayout,
    rank: int,
    *,
    options: ParallelOptions | None = None,
    workload: Workload | None = None,
    trace: bool = True,
) -> RankRun:
    """Simulate ``rank`` of ``layout``: ``build_model()`` (on the meta device; the dry run calls it under
    ``torch.device("meta")``), the real :func:`lightning_tp.parallelize`, then, with ``trace``, one training step of
    ``workload`` on fake tensors.

    Args:
        build_model: returns the model, called once in the simulated world.
        layout: the sizes of every axis (its world size is the number of ranks simulated).
        rank: the rank to be.
        options: the strategy's other arguments (:class:`~lightning_tp.ParallelOptions`; ``precision`` decides the
            parameters' dtype and autocast).
        workload: the step's batch, sequence length, optimizer and clipping (default :class:`Workload`).
        trace: run the step (else only parallelise, and count the optimizer's states on fake gradients).

    Raises:
        ValueError: what the strategy would raise for this layout, options and model, with its message; a process
            group is already initialised.
    """
    options = options or ParallelOptions()
    workload = workload or Workload()
    recorder = CollectiveRecorder()
    with simulated_world(rank, layout.world_size):
        with torch.device("meta"):
            model = build_model()
        try:
            mesh, _ = layout.build_device_mesh("cpu")
            with recorder, recorder.phase("setup"):
                parallelize(model, mesh=mesh, ep_size=layout.ep_size, options=options, device="meta")
            axes = mesh_axis_names(model)
            not_traced = None
            if trace and layout.pp_size > 1:
                not_traced = PIPELINE_NOT_TRACED
            elif trace and layout.cp_size > 1:
                not_traced = CONTEXT_PARALLEL_NOT_TRACED
            try:
                memory = _step(model, recorder, options, workload, traced=trace and not_traced is None)
            except _NotTraceable as why:
                # The forward stopped halfway (FSDP2's layers left unsharded): a fresh model, parallelised the same
                # way, gives the exact parameters, gradients and optimizer states.
                not_traced = str(why)
                _forget_patches(model)
                with torch.device("meta"):
                    model = build_model()
                parallelize(model, mesh=mesh, ep_size=layout.ep_size, options=options, device="meta")
                memory = _step(model, CollectiveRecorder(), options, workload, traced=False)
            calls = tuple(_labelled(call, axes) for call in recorder.calls)
            coordinates = dict(zip(mesh.mesh_dim_names, mesh.get_coordinate(), strict=True))
            return RankRun(rank, coordinates, memory, calls, not_traced if trace else None)
        finally:
            _forget_patches(model)


def _labelled(call: Call, axes: dict[tuple[int, ...], str]) -> Call:
    return replace(call, axis=axes[call.group]) if call.group in axes else call


def _step(
    model: nn.Module, recorder: CollectiveRecorder, options: ParallelOptions, workload: Workload, *, traced: bool
) -> Memory:
    """Materialise ``model`` as fake tensors and run one step (:func:`measure_step`); untraced, only the optimizer's
    states are made (on fake gradients of the parameters' shapes)."""
    parameters = local_bytes(model.parameters())
    with fake_tensor_mode():
        model.to_empty(device="cpu")
        if traced:
            setup_calls = len(recorder.calls)
            try:
                return measure_step(model, options=options, workload=workload, recorder=recorder)
            except DATA_DEPENDENT_ERRORS as error:
                # The forward reads a tensor's value (a mixture of experts routes by its router's output): the
                # step's shapes depend on data a fake tensor has not. What it recorded so far is dropped.
                del recorder.calls[setup_calls:]
                raise _NotTraceable(f"{DATA_DEPENDENT_NOT_TRACED} ({error.func})") from None
        trainable = [p for p in model.parameters() if p.requires_grad]
        optimizer = OPTIMIZERS[workload.optimizer](trainable)
        for p in trainable:
            p.grad = torch.zeros_like(p)
        optimizer.step()
        return Memory(parameters, local_bytes(p.grad for p in trainable), optimizer_bytes(optimizer))


def measure_step(
    model: nn.Module,
    *,
    options: ParallelOptions,
    workload: Workload,
    recorder: CollectiveRecorder | None = None,
    device: torch.device | str = "cpu",
    free_cycles: bool = False,
) -> Memory:
    """One training step of a parallelised ``model`` as it is, on fake tensors (the dry run) or real ones (what a
    test measures the dry run against): forward with the labels, backward, clipping, the optimizer's step, counting
    the bytes of every live tensor (:class:`LiveBytes`) and recording the collectives (``recorder``).

    Args:
        model: parallelised by :func:`lightning_tp.parallelize`, materialised.
        options: its options (``precision="bf16-mixed"`` runs the forward under autocast, as Lightning does).
        workload: the batch, sequence length, optimizer and clipping.
        recorder: records the step's collectives, each with its phase; ``None``: not recorded.
        device: where the batch is made.
        free_cycles: collect Python's reference cycles before each reading. A real run's collective can leave its
            tensors in a cycle with its work object until the collector runs (seen on torch 2.15 with gloo), so the
            count would depend on the collector's timing; a full collection costs a good part of a second in a large
            process, so the dry run (whose fake collectives make no such cycle) leaves it off.

    Raises:
        ValueError: ``UntypedStorage.resize_`` is patched already (another count running in this process).
    """
    recorder = recorder or CollectiveRecorder()
    live = LiveBytes()
    trainable = [p for p in model.parameters() if p.requires_grad]
    parameters = local_bytes(model.parameters())
    optimizer = OPTIMIZERS[workload.optimizer](trainable)
    device = torch.device(device)
    ids = torch.zeros(workload.batch_size, workload.seq_len, dtype=torch.long, device=device)
    autocast = torch.autocast(device.type, dtype=torch.bfloat16) if options.precision == "bf16-mixed" else nullcontext()
    with live, live.resizes_seen(), recorder:
        for tensor in (*model.parameters(), *model.buffers()):
            live.track(tensor)
        if free_cycles:
            gc.collect()
        live.reset_peak()
        start = live.live
        with recorder.phase("forward"), recorder.watch(model), autocast:
            loss = model(input_ids=ids, labels=ids).loss
        if free_cycles:
            gc.collect()
        activations = live.live - start
        with recorder.phase("backward"):
            loss.backward()
        del loss
        backward_peak = live.peak
        gradients = local_bytes(p.grad for p in trainable)
        with recorder.phase("optimizer"):
            if workload.clip is not None:
                clip_grad_norm_(model, workload.clip, state=parallel_state(model))
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        states = optimizer_bytes(optimizer)
        # This step's forward and backward ran before the optimizer had states; every later step's run with them.
        peak = max(backward_peak + states, live.peak)
    return Memory(parameters, gradients, states, activations, peak)


def parameter_dtype(precision: str) -> torch.dtype:
    """The dtype a precision's parameters are built in: the ``-true`` precisions' (cast before sharding), else
    float32 (``bf16-mixed`` keeps float32 parameters and computes in bfloat16 under autocast).

    Args:
        precision: one of :data:`~lightning_tp.parallel_options.SUPPORTED_PRECISIONS`.

    Raises:
        Nothing: an unknown precision is float32 (``ParallelOptions`` refuses it first).
    """
    return PRECISION_DTYPES.get(precision) or torch.float32
