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


#: Values of ``TensorParallelStrategy(fsdp_param_dtype=...)`` that ask FSDP2 to all-gather parameters in bf16.
BF16_NAMES = ("bf16", "bfloat16", torch.bfloat16)


def fsdp_mixed_precision(precision: str, *, param_dtype: str | torch.dtype | None = None) -> MixedPrecisionPolicy:
    """FSDP2's policy for a Lightning precision.

    By default nothing is cast: ``bf16-mixed`` means what it means on one device (Lightning's precision plugin
    autocasts the forward over fp32 parameters; FSDP2 gathers fp32 parameters and reduces fp32 gradients), and
    ``*-true`` precisions converted the parameters already. ``param_dtype="bf16"`` with ``bf16-mixed`` is torchtitan's
    recipe: FSDP2 all-gathers bf16 copies of the parameters (half the bytes) and reduces gradients in fp32; every layer
    then computes on bf16 weights, norms and residual stream included, which is less accurate than autocast.
    """
    if precision == "bf16-mixed" and param_dtype in BF16_NAMES:
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
