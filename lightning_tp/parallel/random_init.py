"""Random initialisation of parameters that are already sharded (a model built on the meta device).

Initialising a DTensor draws each rank's shard from that rank's generator: with the same state on every rank (the
usual case), every shard gets the same numbers, so the two halves of a TP weight are identical (duplicated heads), and
on CUDA the result depends on DTensor's RNG tracker. Here each random initialisation runs on whole-size plain tensors
(the parameters one module's ``_init_weights`` can reach, swapped in while it runs), drawn from the same generator
state on every rank, and each rank keeps its slice: the shards are the slices of the tensors a single process draws,
in the same order, so a sharded run initialises exactly like one process that initialised the same meta model. Cost:
each rank draws every random number of the model (not 1/N of them) and holds at most one block's parameters whole at
a time (at the root: the embedding and ``lm_head``).
"""

from __future__ import annotations

from collections.abc import Callable, Generator, Iterable
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor

from lightning_tp.compat import (
    distributed_is_initialized,
    is_hf_initialized,
    parameter_dict,
    wrapped_initialize_weights,
)

#: The attribute a module whose size attributes TP changed keeps them in: {path: (whole value, rank's value)}.
WHOLE_SIZES = "_lightning_tp_whole_sizes"


def record_local_size(module: nn.Module, path: str, whole: int, local: int) -> None:
    """Record that the size attribute at ``path`` (``"norm.n_groups"``: a child's) of ``module`` went from ``whole``
    to the rank's ``local`` (see :func:`whole_parameters`)."""
    module.__dict__.setdefault(WHOLE_SIZES, {})[path] = (whole, local)


def _set_attribute(module: nn.Module, path: str, value: int) -> None:
    owner, _, name = path.rpartition(".")
    setattr(module.get_submodule(owner) if owner else module, name, value)


@contextmanager
def whole_parameters(modules: Iterable[nn.Module]) -> Generator[None, None, None]:
    """Inside the block, each sharded parameter held directly by one of ``modules`` is a whole-size plain tensor (NaN
    until written); on exit each rank copies its slice of what was written into its shard, and the sharded parameter
    is back in place. Parameters marked ``_is_hf_initialized`` (loaded from a checkpoint) are left as they are."""
    swapped: list[tuple[nn.Module, str, DTensor, torch.Tensor]] = []
    modules = list(dict.fromkeys(modules))
    # Modules whose head counts TP made the rank's (`local_heads`) get their whole counts back while the
    # initialisation runs: it sizes what it writes by them (`A_log = log(arange(1, num_heads + 1))`).
    local_sizes = [(m, getattr(m, WHOLE_SIZES)) for m in modules if getattr(m, WHOLE_SIZES, None)]
    for module, whole_sizes in local_sizes:
        for path, (whole_value, _) in whole_sizes.items():
            _set_attribute(module, path, whole_value)
    for module in modules:  # once each, in order
        for name, param in parameter_dict(module).items():
            if not isinstance(param, DTensor) or is_hf_initialized(param):
                continue
            if not param.is_floating_point():  # NaN marks what was not written; no random init makes integers
                continue
            local = param.to_local()
            whole = nn.Parameter(
                torch.full(param.shape, float("nan"), dtype=param.dtype, device=local.device),
                requires_grad=param.requires_grad,
            )
            parameter_dict(module)[name] = whole
            swapped.append((module, name, param, whole))
    try:
        yield
    finally:
        for module, whole_sizes in local_sizes:
            for path, (_, local_value) in whole_sizes.items():
                _set_attribute(module, path, local_value)
        with torch.no_grad():
            for module, name, param, whole in swapped:
                parameter_dict(module)[name] = param
                # No communication (src_data_rank=None): every rank holds the same whole tensor and keeps its slice,
                # whatever the placements (TP's Shard, FSDP2's Shard/_StridedShard on the 2-D mesh, Replicate).
                # `distribute_tensor` slices on the mesh's device; with FSDP2's CPU offload the shard lives on the CPU.
                mine = distribute_tensor(whole.detach(), param.device_mesh, param.placements, src_data_rank=None)
                local = param.to_local()
                mine = mine.to_local().to(local.device)
                written = ~torch.isnan(mine)  # what the initialisation left alone keeps its value
                local.copy_(torch.where(written, mine, local))


def _generator_state(device: torch.device) -> tuple[Callable[[], torch.Tensor], Callable[[torch.Tensor], None]]:
    if device.type == "cpu":
        return torch.get_rng_state, torch.set_rng_state
    backend = torch.get_device_module(device.type)
    index = device.index if device.index is not None else backend.current_device()
    return (lambda: backend.get_rng_state(index)), (lambda state: backend.set_rng_state(state, index))


@contextmanager
def random_state_of_rank_zero(device: torch.device) -> Generator[None, None, None]:
    """Draw inside the block from rank 0's state of ``device``'s default generator (one broadcast, every rank must
    enter), so that every rank draws the same whole tensors. A rank whose state was rank 0's keeps the advanced state,
    as one process would; a rank whose state differed gets its own back afterwards (its later draws, e.g. dropout
    masks on another data-parallel rank, stay its own)."""
    if not distributed_is_initialized() or dist.get_world_size() == 1:
        yield
        return
    get_state, set_state = _generator_state(device)
    own = get_state()
    shared: list[Any] = [own]
    dist.broadcast_object_list(shared, src=0)
    same = torch.equal(own, shared[0])
    set_state(shared[0])
    try:
        yield
    finally:
        if not same:
            set_state(own)


def initialize_transformers_weights(model: nn.Module) -> None:
    """Transformers' own ``initialize_weights`` (same modules, same order, same draws), with each module's sharded
    parameters whole while its ``_init_weights`` runs. Call it inside :func:`random_state_of_rank_zero`."""
    from transformers import PreTrainedModel

    # `initialize_weights` visits modules depth-first and calls the `_initialize_weights` of the nearest Transformers
    # model on each; wrapping that method on every sub-model instance catches each module when it is initialised.
    def wrap(original: Callable[..., None]) -> Callable[..., None]:
        def initialize(module: nn.Module, *args: Any, **kwargs: Any) -> None:
            with whole_parameters(_reachable_from_init(module)):
                original(module, *args, **kwargs)

        return initialize

    with wrapped_initialize_weights([sub for sub in model.modules() if isinstance(sub, PreTrainedModel)], wrap):
        model.initialize_weights()


def _reachable_from_init(module: nn.Module) -> list[nn.Module]:
    """The modules whose parameters ``_init_weights(module)`` may write: many models initialise their children's
    weights from the parent (``init.normal_(module.q_proj.weight)`` on an attention module). A block and everything
    in it (one block whole at a time); for a Transformers model (the root, the base model), itself and its leaf
    children only (the embedding, ``lm_head``, the final norm), not the whole model."""
    from transformers import PreTrainedModel

    if not isinstance(module, PreTrainedModel):
        return list(module.modules())
    return [module, *(child for child in module.children() if next(child.children(), None) is None)]
