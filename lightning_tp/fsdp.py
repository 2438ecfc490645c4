"""FSDP2 (``fully_shard``) on the data-parallel axes, after tensor parallelism.

Each transformer block is sharded on its own, then the root, so that one block's full parameters exist at a time.
On a ``(dp_replicate, dp_shard)`` mesh this is HSDP: shard inside a group, replicate across groups.
"""

from __future__ import annotations

from collections.abc import Iterable

from torch import nn
from torch.distributed.device_mesh import DeviceMesh


def block_classes(module: nn.Module, names: Iterable[str] | None = None) -> set[type[nn.Module]]:
    """The classes of the blocks to shard one by one: ``names``, or each Transformers model's ``_no_split_modules``
    (its decoder layer)."""
    wanted = set(names or ())
    if not wanted:
        for submodule in module.modules():
            wanted.update(getattr(submodule, "_no_split_modules", None) or ())
    return {type(m) for m in module.modules() if type(m).__name__ in wanted}


def apply_fsdp(
    module: nn.Module,
    dp_mesh: DeviceMesh,
    *,
    blocks: set[type[nn.Module]],
    reshard_after_forward: bool = True,
    mp_policy: object | None = None,
    offload_policy: object | None = None,
) -> nn.Module:
    """Shard each block of a class in ``blocks``, then ``module`` itself, over ``dp_mesh``."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, OffloadPolicy, fully_shard

    kwargs = {
        "mesh": dp_mesh,
        "reshard_after_forward": reshard_after_forward,
        "mp_policy": mp_policy or MixedPrecisionPolicy(),
        "offload_policy": offload_policy or OffloadPolicy(),
    }
    for submodule in module.modules():
        if submodule is not module and type(submodule) in blocks:
            fully_shard(submodule, **kwargs)
    fully_shard(module, **kwargs)
    return module
