"""FSDP2 (``fully_shard``) on the data-parallel axes, after tensor parallelism.

Each transformer block is sharded on its own, then the root, so that one block's full parameters exist at a time.
On a ``(dp_replicate, dp_shard)`` mesh this is HSDP: shard inside a group, replicate across groups.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard


def block_classes(module: nn.Module, names: Iterable[str] | None = None) -> set[type[nn.Module]]:
    """The classes of the blocks to shard one by one: ``names``, or each Transformers model's ``_no_split_modules``
    (its decoder layer)."""
    wanted = set(names or ())
    if not wanted:
        for submodule in module.modules():
            wanted.update(getattr(submodule, "_no_split_modules", None) or ())
    return {type(m) for m in module.modules() if type(m).__name__ in wanted}


def fsdp_mixed_precision(precision: str) -> MixedPrecisionPolicy:
    """FSDP2's policy for a Lightning precision: ``bf16-mixed`` computes with bf16 copies of the fp32 parameters and
    reduces gradients in fp32; ``*-true`` precisions already converted the parameters, so nothing is cast."""
    if precision == "bf16-mixed":
        return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    return MixedPrecisionPolicy()


def apply_fsdp(
    module: nn.Module,
    dp_mesh: DeviceMesh,
    *,
    blocks: set[type[nn.Module]],
    reshard_after_forward: bool = True,
    mp_policy: MixedPrecisionPolicy | None = None,
    cpu_offload: bool = False,
) -> nn.Module:
    """Shard each block of a class in ``blocks``, then ``module`` itself, over ``dp_mesh`` (1-D: FSDP; 2-D
    ``(replicate, shard)``: HSDP)."""
    kwargs = {
        "mesh": dp_mesh,
        "reshard_after_forward": reshard_after_forward,
        "mp_policy": mp_policy or MixedPrecisionPolicy(),
        "offload_policy": CPUOffloadPolicy() if cpu_offload else OffloadPolicy(),
    }
    for submodule in module.modules():
        if submodule is not module and type(submodule) in blocks:
            fully_shard(submodule, **kwargs)
    fully_shard(module, **kwargs)
    return module
