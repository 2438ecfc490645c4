"""Evaluation, prediction and ``generate`` whatever each data-parallel rank is given.

Under FSDP2 every forward all-gathers parameters over the data-parallel ranks, so the ranks must run the same forwards
in the same order. Lightning's loops do not promise that: its predict sampler does not pad (3 prompts on 2 ranks: 2
and 1), a user's own split of evaluation data can be uneven, and ``generate`` runs as many forwards as the longest
generation of the rank's batch. A rank that runs out first leaves the others waiting in an all-gather ("Connection
closed by peer" on gloo, a hang until the timeout on NCCL), and ranks generating different lengths pair up unrelated
all-gathers.

- **During validate, test and predict**, each FSDP2 module's parameters are gathered once, up front (one all-gather
  per module, every rank in the same order), and kept whole until the loop ends: forwards then run no FSDP2
  collective and each rank runs as many as its data needs. Memory: every rank holds its tensor-parallel shard of the
  whole model (not 1/dp of it) while evaluating. Tensor-parallel collectives stay, but the ranks of a TP group share
  their data and run in step.
- **Outside those loops** (``generate`` inside ``training_step``, say) the weights stay sharded and ``generate`` keeps
  the ranks in step with ``synced_gpus`` (a rank that finished runs dummy forwards until all have): Transformers turns
  it on by itself only for models carrying its FSDP2 marker, which :func:`mark_synced_generate` sets.
"""

from __future__ import annotations

from torch import nn
from torch.distributed.fsdp import FSDPModule

from lightning_tp.compat import FSDP_MANAGED_ATTR
from lightning_tp.parallel.pipeline import modules_and_stages


def fsdp_modules(model: nn.Module) -> list[FSDPModule]:
    """The FSDP2 modules of ``model``, its pipeline stages' roots included."""
    return [m for m in modules_and_stages(model) if isinstance(m, FSDPModule)]


def mark_synced_generate(model: nn.Module, synced: bool) -> None:
    """Set (or clear) Transformers' FSDP2 marker on every FSDP2 module of ``model`` (``generate`` is called on the
    ``PreTrainedModel``, an FSDP2 root here; PEFT's ``generate`` reaches the same module)."""
    for module in fsdp_modules(model):
        setattr(module, FSDP_MANAGED_ATTR, synced)


def gather_for_inference(model: nn.Module) -> list[FSDPModule]:
    """All-gather every FSDP2 module's parameters and keep them whole through forwards; return the modules for
    :func:`release_after_inference`. Every data-parallel rank must call it (collectives, in module order)."""
    modules = fsdp_modules(model)
    for module in modules:
        module.set_reshard_after_forward(False, recurse=False)
        module.unshard()
    # No rank waits for another in a forward now; `synced_gpus` would make a rank with fewer batches wait in
    # `generate`'s per-token all-reduce instead.
    mark_synced_generate(model, False)
    return modules


def release_after_inference(model: nn.Module, modules: list[FSDPModule], *, reshard_after_forward: bool) -> None:
    """Free the gathered parameters (local, no collective) and restore resharding after forward: the configured value
    for inner modules, ``False`` for roots (torch's own choice for a root, whose parameters backward needs at once)."""
    inner = {id(child) for module in modules for child in module.modules() if child is not module}
    for module in modules:
        module.reshard()
        module.set_reshard_after_forward(reshard_after_forward and id(module) in inner, recurse=False)
    mark_synced_generate(model, True)
