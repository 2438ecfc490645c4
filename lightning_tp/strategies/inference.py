"""Evaluation, prediction and ``generate`` whatever each data-parallel rank is given.

Under FSDP2 every forward all-gathers parameters over the data-parallel ranks, so the ranks must run the same forwards
in the same order. Lightning's loops do not promise that: its predict sampler does not pad (3 prompts on 2 ranks: 2
and 1), a user's own split of evaluation data can be uneven, and ``generate`` runs as many forwards as the longest
generation of the rank's batch. A rank that runs out first leaves the others waiting in an all-gather ("Connection
closed by peer" on gloo, a hang until the timeout on NCCL), and ranks generating different lengths pair up unrelated
all-gathers.

- **During validate, test and predict**, by default (``eval_weights="sharded"``) the weights stay as in training:
  each FSDP2 layer is gathered for its forward and freed after it, and what FSDP2 keeps whole after a forward for
  the backward that training runs next (every layer with ``reshard_after_forward=False``) is freed after each step,
  so a rank holds its share of the model, as in a training step. The ranks must then run as many forwards:
  Lightning's samplers pad validation and test, and :func:`check_even_batches` refuses a loader that gives the
  data-parallel ranks different numbers of batches (or has no length), on every rank, before the loop starts.
  ``generate`` keeps the ranks in step itself (below).
- ``eval_weights="gathered"``: each FSDP2 module's parameters are gathered once, up front (one all-gather per
  module, every rank in the same order), and kept whole until the loop ends: forwards then run no FSDP2 collective
  and each rank runs as many as its data needs (Lightning's predict sampler does not pad: 3 prompts on 2 ranks give
  2 and 1). Memory: every rank holds its tensor-parallel shard of the whole model (not 1/dp of it). Tensor-parallel
  collectives stay, but the ranks of a TP group share their data and run in step.
- **Wherever the weights are sharded** (those loops by default; ``generate`` inside ``training_step``) ``generate``
  keeps the ranks in step with ``synced_gpus`` (a rank that finished runs dummy forwards until all have):
  Transformers turns it on by itself only for models carrying its FSDP2 marker, which :func:`mark_synced_generate`
  sets.
"""

from __future__ import annotations

from typing import Literal

import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule

from lightning_tp.compat import FSDP_MANAGED_ATTR, distributed_is_initialized
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


EVAL_WEIGHTS = ("sharded", "gathered")


def check_eval_weights(eval_weights: str) -> Literal["sharded", "gathered"]:
    """``eval_weights`` as given, checked when the strategy is built.

    Raises:
        ValueError: not one of :data:`EVAL_WEIGHTS`.
    """
    if eval_weights not in EVAL_WEIGHTS:
        raise ValueError(f"`eval_weights` must be one of {EVAL_WEIGHTS}, got {eval_weights!r}.")
    return eval_weights  # type: ignore[return-value]


def batches_run(length: int | None, limit: int | float | None) -> int | None:
    """How many batches Lightning's loop runs of a loader of ``length`` batches (``None``: no length) under its
    ``limit_*_batches`` (an int: at most that many; a float: that share, 1.0 all) or ``num_sanity_val_steps``
    (``None``: no limit); ``None`` where that is unknown (no length, no int limit)."""
    if isinstance(limit, int) and not isinstance(limit, bool) and limit >= 0:
        return limit if length is None else min(length, limit)
    if length is None:
        return None
    return length if limit is None else int(length * float(limit))


def check_even_batches(
    model: nn.Module, dataloader: object, *, loop: str, limit: int | float | None = None, cap: int | None = None
) -> None:
    """Refuse, on every rank alike, an evaluation loader that gives the ranks different numbers of batches while the
    weights stay sharded: a rank that runs out would leave the others in a layer's all-gather. Every rank calls it
    for each loader of the loop (Lightning processes every loader on every rank, also where a rank then skips the
    loop for having no batch), so the one all-gather of the counts is reached by all. The counts are what the loop
    runs under ``limit`` (:func:`batches_run`: ``limit_val_batches=8`` runs 8 of an unsized loader, or of loaders of
    11 and 12) and at most ``cap`` (sanity checking's ``num_sanity_val_steps``). Nothing to check (and no
    collective) for a model without FSDP2, whose forwards gather nothing over the data-parallel ranks.

    Raises:
        ValueError: the ranks' counts differ, or a loader has no length, naming each rank's count and the fixes.
    """
    if not fsdp_modules(model) or not distributed_is_initialized() or dist.get_world_size() == 1:
        return
    try:
        length: int | None = len(dataloader)  # type: ignore[arg-type]
    except TypeError:  # an iterable without a length
        length = None
    count = batches_run(length, limit)
    if cap is not None:
        count = cap if count is None else min(count, cap)
    counts: list[int | None] = [None] * dist.get_world_size()
    dist.all_gather_object(counts, count)
    if None not in counts and len(set(counts)) == 1:
        return
    raise ValueError(
        f"The {loop} loader gives the ranks {counts} batches (rank by rank, as the loop runs them; None: no length "
        "and no int limit). With "
        '`eval_weights="sharded"` (the default) every forward gathers each layer\'s weights over the data-parallel '
        "ranks, so each must run as many batches, or the ranks left would wait for the others in a collective. "
        "Give every rank as many batches (Lightning's own sampler pads validation and test: keep "
        "`use_distributed_sampler=True`; with a sampler of your own, pad it or drop the last rows), or pass "
        '`TensorParallelStrategy(eval_weights="gathered")`, which holds the whole model (its TP shard) on every rank '
        "during the loop so that the ranks' forwards need not match."
    )


def release_gathered(model: nn.Module) -> None:
    """Free what FSDP2 keeps gathered after a forward for the backward that evaluation never runs: every module's
    weights with ``reshard_after_forward=False`` (until the next training backward), the roots' wherever torch keeps
    them. Local, no collective; after each evaluation step, so that a rank holds its share between steps."""
    for module in fsdp_modules(model):
        module.reshard()
