"""Every private name this package takes from torch, Lightning and Transformers, in one place: a new upstream release
breaks here, not all over. Each with why it is used and what public alternative is missing."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

# Lightning's full-file checkpoint load into modules and optimizers (with `optimizer_states_from_list`): the strategies'
# own `load_checkpoint` would broadcast rank 0's path, which for a downloaded URL is rank 0's temporary file.
from lightning.fabric.strategies.model_parallel import _load_checkpoint as load_full_checkpoint

# The sampler's epoch on a data loader (through Lightning's wrappers): no public setter for a loader.
from lightning.fabric.utilities.data import _set_sampler_epoch as set_sampler_epoch

# Lightning's group-aware all-gather and reduction, which return the input unchanged without a process group.
from lightning.fabric.utilities.distributed import _all_gather_ddp_if_available as all_gather_if_available
from lightning.fabric.utilities.distributed import _sync_ddp_if_available as sync_if_available

# Moving optimizer states to the device (Lightning's strategies do it after setup): no public helper.
from lightning.fabric.utilities.optimizer import _optimizers_to_device as optimizers_to_device

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh


def flatten_mesh(mesh: DeviceMesh, name: str, *, backend_override: Any = None) -> DeviceMesh:
    """``mesh`` flattened into one axis ``name`` (FSDP-style data-parallel groups over several axes): torch asks for
    ``DeviceMesh._flatten`` and has no public spelling in 2.13; it returns the mesh built already for the same name."""
    return mesh._flatten(name, backend_override=backend_override)


__all__ = [
    "flatten_mesh",
    "all_gather_if_available",
    "load_full_checkpoint",
    "optimizers_to_device",
    "set_sampler_epoch",
    "sync_if_available",
]
