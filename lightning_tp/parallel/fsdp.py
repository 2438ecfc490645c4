"""FSDP2 (``fully_shard``) on the data-parallel axes, after tensor parallelism.

Each transformer block is sharded on its own, then the root, so that one block's full parameters exist at a time.
On a ``(dp_replicate, dp_shard)`` mesh this is HSDP: shard inside a group, replicate across groups.

A LightningModule that is itself the model (a plain ``nn.Module`` tree given a plan) is not one FSDP2 unit: its
``training_step`` calls submodules (``self.net(x)``), never its own ``forward``, so a unit on it would never gather
its parameters. Each child holding parameters becomes its own unit instead (see :func:`apply_fsdp_per_child`).
"""

from __future__ import annotations

from collections.abc import Generator, Iterable
from contextlib import contextmanager
from dataclasses import replace
from typing import Any, Literal

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, OffloadPolicy, fully_shard
from torch.distributed.tensor import DTensor

from lightning_tp.parallel.pipeline import modules_and_stages
from lightning_tp.plans.structure import block_classes

#: Values of ``TensorParallelStrategy(fsdp_param_dtype=...)`` that ask FSDP2 to all-gather parameters in bf16 (the
#: default, ``"auto"``, does under ``bf16-mixed``).
BF16_NAMES = ("bf16", "bfloat16", torch.bfloat16)


def fsdp_mixed_precision(precision: str, *, param_dtype: str | torch.dtype | None = "auto") -> MixedPrecisionPolicy:
    """FSDP2's policy for a Lightning precision.

    ``bf16-mixed`` with ``param_dtype`` ``"auto"`` (the default) or ``"bf16"`` is torchtitan's recipe: FSDP2 all-gathers
    bf16 copies of the fp32 parameters (half the bytes of fp32 gathers) and reduces gradients in fp32; every layer then
    computes on bf16 weights, norms and residual stream included, so the numerics are a bf16 model's rather than one
    device's autocast over fp32 weights. ``param_dtype=None`` casts nothing: FSDP2 gathers fp32 parameters and reduces
    fp32 gradients, and ``bf16-mixed`` means what it means on one device (autocast over fp32 weights), for twice the
    all-gather bytes. ``*-true`` precisions converted the parameters already.

    ``bf16-true`` and ``16-true`` reduce gradients in fp32 (``reduce_dtype``; the reduced shard is cast back): one
    process sums a whole batch's gradient in a matmul's fp32 accumulator and rounds once, where a 16-bit
    reduce-scatter would round at every hop of the ring, more ranks more roundings (and fp16 could overflow). Twice
    the reduce-scatter bytes, as torchtitan's ``mixed_precision_reduce`` and Megatron's ``grad_reduce_in_fp32``.
    """
    if precision == "bf16-mixed" and (param_dtype == "auto" or param_dtype in BF16_NAMES):
        return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    if precision in ("bf16-true", "16-true"):
        return MixedPrecisionPolicy(reduce_dtype=torch.float32)
    return MixedPrecisionPolicy()


#: What FSDP2 does with the gradients of a micro-batch that does not end an optimizer step (``accumulate_grads``).
#: ``"sharded"``: it reduce-scatters them as usual, each rank adding its shard up over the micro-batches (the memory
#: of one step without accumulation); under HSDP only the all-reduce across the replicas waits for the last
#: micro-batch (FSDP2 keeps the shard's partial sum, in the reduce dtype, on the device). ``"unsharded"``: no
#: reduction at all until the last micro-batch, one reduce-scatter per optimizer step, but each rank keeps every
#: parameter's whole gradient (of its TP shard) meanwhile: ``4 P / tp`` bytes in fp32 for a model of ``P``
#: parameters, about 35 GB per GPU for 70B at TP 8.
ACCUMULATE_GRADS = ("sharded", "unsharded")


@contextmanager
def micro_batch_grads(module: nn.Module, *, accumulate_grads: Literal["sharded", "unsharded"]) -> Generator:
    """Inside the block, the backward of a micro-batch that does not end an optimizer step: FSDP2's units of
    ``module`` hold their gradients as ``accumulate_grads`` says (see :data:`ACCUMULATE_GRADS`)."""
    assert accumulate_grads in ACCUMULATE_GRADS, accumulate_grads  # checked when the strategy is built
    units = [m for m in modules_and_stages(module) if isinstance(m, FSDPModule)]  # a pipeline's stage roots too

    def switch(on: bool) -> None:
        for unit in units:
            if accumulate_grads == "unsharded":
                unit.set_requires_gradient_sync(on, recurse=False)
            else:
                unit.set_requires_all_reduce(on, recurse=False)

    switch(False)
    try:
        yield
    finally:
        switch(True)


def apply_fsdp(
    module: nn.Module,
    dp_mesh: DeviceMesh,
    *,
    blocks: set[type[nn.Module]],
    reshard_after_forward: bool = True,
    mp_policy: MixedPrecisionPolicy | None = None,
    cpu_offload: bool = False,
    cast_root_inputs: bool = True,
) -> nn.Module:
    """Shard each block of a class in ``blocks``, then ``module`` itself, over ``dp_mesh`` (1-D: FSDP; 2-D
    ``(replicate, shard)``: HSDP). ``cast_root_inputs=False``: ``module``'s own forward inputs keep their dtype (the
    blocks still cast theirs to the policy's ``param_dtype``)."""
    kwargs = {
        "mesh": dp_mesh,
        "reshard_after_forward": reshard_after_forward,
        "mp_policy": mp_policy or MixedPrecisionPolicy(),
        "offload_policy": CPUOffloadPolicy() if cpu_offload else OffloadPolicy(),
    }
    # Innermost first (``fsdp_blocks`` may name a class inside another, an MLP in a decoder layer): FSDP2 shards each
    # parameter once, in the first unit that holds it.
    for submodule in reversed(list(module.modules())):
        if submodule is not module and type(submodule) in blocks:
            fully_shard(submodule, **kwargs)
            give_every_parameter_a_gradient(submodule)
    if not cast_root_inputs:
        kwargs["mp_policy"] = replace(kwargs["mp_policy"], cast_forward_inputs=False)
    fully_shard(module, **kwargs)
    return module


class _GradientForEveryParameter(torch.autograd.Function):
    """The identity on an FSDP2 unit's inputs. Its backward runs once the unit's own backward is done, just before
    FSDP2's (which sits on the same inputs, one step further): it gives each trainable parameter of the unit that got
    no gradient a zero one. FSDP2 reduce-scatters only the parameters that have a gradient, so a mixture-of-experts
    layer whose router sent none of a rank's tokens to some expert (data parallelism and context parallelism give every
    rank other tokens) would make that rank's reduce-scatter smaller than its peers': gloo aborts ("Received data size
    doesn't match expected size"), NCCL may hang or mix up the buffers."""

    @staticmethod
    def forward(ctx, holders, *tensors):  # type: ignore[override]
        ctx.holders = holders
        return tuple(tensor.view_as(tensor) for tensor in tensors)

    @staticmethod
    def backward(ctx, *grads):  # type: ignore[override]
        for holder in ctx.holders:
            for param in holder.parameters(recurse=False):  # unsharded: FSDP2 has not resharded them yet
                if param.requires_grad and param.grad is None:
                    param.grad = torch.zeros_like(param, dtype=gradient_dtype(param))
        return (None, *grads)


def gradient_dtype(param: torch.Tensor) -> torch.dtype:
    """The dtype a gradient of ``param`` must have: its ``grad_dtype`` where torch has one (2.15 and later; FSDP2's
    bfloat16 copies of float32 parameters under ``bf16-mixed`` take float32 gradients), else its own dtype."""
    return getattr(param, "grad_dtype", None) or param.dtype


def give_every_parameter_a_gradient(unit: nn.Module) -> None:
    """See :class:`_GradientForEveryParameter`, for the parameters of ``unit`` that no FSDP2 unit inside it holds
    (those are its own units' business). A forward pre-hook after FSDP2's own (which is prepended), so that its
    function is applied after FSDP2's."""
    inner = [m for m in unit.modules() if m is not unit and isinstance(m, FSDPModule)]
    inside = {id(m) for unit_inside in inner for m in unit_inside.modules()}
    holders = [m for m in unit.modules() if id(m) not in inside]

    def hook(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
        if not torch.is_grad_enabled():
            return None
        found = [(True, i) for i, a in enumerate(args) if isinstance(a, torch.Tensor) and a.requires_grad]
        found += [(False, k) for k, v in kwargs.items() if isinstance(v, torch.Tensor) and v.requires_grad]
        if not found:
            return None
        tensors = [args[i] if positional else kwargs[i] for positional, i in found]
        outputs = _GradientForEveryParameter.apply(holders, *tensors)
        args, kwargs = list(args), dict(kwargs)
        for (positional, i), out in zip(found, outputs, strict=True):
            if positional:
                args[i] = out
            else:
                kwargs[i] = out
        return tuple(args), kwargs

    unit.register_forward_pre_hook(hook, with_kwargs=True)


def fsdp_units(root: nn.Module) -> list[nn.Module]:
    """The children of ``root`` that hold parameters: one FSDP2 unit each. Raises when two of them share a parameter
    (FSDP2 cannot shard one parameter in two units; the same module reachable under two names is one unit)."""
    units: list[nn.Module] = []
    owner: dict[int, str] = {}
    for name, child in root.named_children():
        if any(child is unit for unit in units):
            continue
        params = list(child.parameters())
        if not params:
            continue
        for param_name, param in child.named_parameters():
            if id(param) in owner and owner[id(param)] != name:
                raise ValueError(
                    f"{type(root).__name__}.{name} and {type(root).__name__}.{owner[id(param)]} share the parameter "
                    f"{name}.{param_name}. With data parallelism each child of the LightningModule is sharded as its "
                    f"own FSDP2 unit; put the modules that share weights under one parent module "
                    f"(e.g. `self.model = nn.ModuleDict(...)`)."
                )
            owner[id(param)] = name
        units.append(child)
    return units


def apply_fsdp_per_child(
    root: nn.Module,
    dp_mesh: DeviceMesh,
    *,
    fsdp_blocks: Iterable[str] | None = None,
    **kwargs: Any,
) -> list[nn.Module]:
    """FSDP2 on each child of ``root`` that holds parameters (its blocks by ``fsdp_blocks`` first, see
    :func:`apply_fsdp`), not on ``root``: whichever child ``training_step`` calls gathers its parameters by its own
    hooks, and a call through ``root.forward`` reaches the same hooks. Each unit is its own FSDP2 root (modules called
    more than once per step all-gather again and accumulate their gradients; FSDP2 handles both). Parameters held by
    ``root`` itself stay whole. Returns the units."""
    units = fsdp_units(root)
    for unit in units:
        apply_fsdp(unit, dp_mesh, blocks=block_classes(unit, fsdp_blocks), **kwargs)
    _refuse_calls_outside_units(root, units)
    return units


#: Mesh axis names of FSDP2's sharded parameters (its unsharded ones live on the TP axis only, or are plain).
_DATA_PARALLEL_AXES = ("dp_shard", "dp_replicate", "dp_shard_cp")


def _refuse_calls_outside_units(root: nn.Module, units: list[nn.Module]) -> None:
    """A module inside a unit, called on its own (``self.model.norm(x)`` from ``training_step``), would run on its
    FSDP2 shards and fail deep in an operator ("inputs with different meshes", a shape mismatch). Raise a clear error
    instead, the same on every rank (every rank makes the same call)."""
    names = {id(m): name for name, m in root.named_modules()}
    for unit in units:
        for module in unit.modules():
            if isinstance(module, FSDPModule) or not any(True for _ in module.parameters(recurse=False)):
                continue
            owner = _owning_unit(unit, module)
            # First of the module's pre-hooks: it reads the parameters as FSDP2 left them, before TP's parameter
            # views (hooks.run_on_parameter_views, a pre-hook too) put local tensors in their place.
            module.register_forward_pre_hook(
                _refuse_sharded(names.get(id(module), "?"), names.get(id(owner), "?"), type(module).__name__),
                prepend=True,
            )


def _owning_unit(unit: nn.Module, module: nn.Module) -> nn.Module:
    """The innermost FSDP2 unit of ``unit`` (itself, or one of its blocks) that holds ``module``."""
    owner = unit
    for candidate in unit.modules():
        inside = any(m is module for m in candidate.modules())
        if isinstance(candidate, FSDPModule) and candidate is not unit and inside:
            owner = candidate
    return owner


def _refuse_sharded(name: str, owner: str, class_name: str) -> Any:
    def hook(module: nn.Module, args: Any) -> None:
        for param in module.parameters(recurse=False):
            names = param.device_mesh.mesh_dim_names if isinstance(param, DTensor) else None
            if names and any(axis in names for axis in _DATA_PARALLEL_AXES):
                raise ValueError(
                    f"`{name}` was called on its own, outside the forward of `{owner}`, the FSDP2 unit that holds "
                    f"its parameters sharded over the data-parallel ranks. Call `{owner}` (a child of the "
                    f"LightningModule gathers its parameters in its forward), or make `{name}` a unit of its own "
                    f"with `fsdp_blocks=[{class_name!r}, ...]`."
                )

    return hook
