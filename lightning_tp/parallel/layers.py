"""This package's TP layers: every style name of the table (:data:`lightning_tp.plans.styles.STYLES`) as a torch
``ParallelStyle``, written on DTensor and forward hooks.

A model's plan strings (``colwise``, ``rowwise``, ``embedding_rowwise``, ``moe_tp_experts``...) are data: what each
one splits is a fact of the table (:class:`lightning_tp.plans.styles.StyleFacts`), read here to lay out the
parameters (:func:`shard_parameter`); how the module then runs is the layer's. No layer of Transformers' is applied,
so the package does not follow their signatures, which change between releases.

Every layer runs its module on local tensors: the sharded parameters are swapped for their local shards during each
call (:func:`lightning_tp.parallel.hooks.run_on_parameter_views`), the inputs and outputs are plain tensors, and the
collectives are explicit (:mod:`lightning_tp.parallel.collectives`):

- column-wise: the (replicated) input's gradient is summed over the TP group; the output stays the rank's slice of the
  features, or is gathered (``colwise_gather_output``);
- row-wise: the input is the rank's slice of the features (or is cut from a replicated one); the partial outputs are
  summed into a tensor of their own, and the bias is added once, after the sum;
- vocabulary-parallel embedding: each rank looks up the ids its rows hold, zeroes the others, and the lookups are
  summed (Megatron's ``VocabParallelEmbedding``); hidden-dim-parallel: the slices are gathered;
- mixture-of-experts experts (``moe_tp_experts``): each rank runs its slice of every expert, the partial outputs are
  summed, and the gradients of the hidden states and routing weights it is given are summed over the TP group.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import ParallelStyle, RowwiseParallel, parallelize_module

from lightning_tp.compat import parameter_dict, strided_shard
from lightning_tp.parallel.collectives import (
    GatherLastDim,
    SumGradients,
    SumPartialOutputs,
    SumsInputGradients,
    chunk_sizes,
)
from lightning_tp.parallel.hooks import on_hidden_states, run_on_parameter_views
from lightning_tp.parallel.kv_heads import ColwiseKVHeads
from lightning_tp.parallel.random_init import record_local_size
from lightning_tp.patches import install_for_call, installed
from lightning_tp.plans.mixers import rotary_width
from lightning_tp.plans.resolved import ResolvedPlan
from lightning_tp.plans.styles import STYLES, StyleFacts, facts


def placement_of(fact: StyleFacts, ndim: int, *, is_bias: bool = False) -> Any:
    """The DTensor placement of a parameter of ``ndim`` dims laid out as ``fact`` says (:meth:`StyleFacts.layout`)."""
    dim = fact.split_dim(ndim, is_bias=is_bias)
    if dim is None:
        return Replicate()
    return strided_shard(dim, fact.blocks) if fact.strided else Shard(dim)


def shard_parameter(module: nn.Module, name: str, fact: StyleFacts, mesh: DeviceMesh) -> None:
    """Lay out ``module``'s parameter ``name`` on ``mesh`` as ``fact`` says. Each rank cuts its own copy (no
    communication: the weights must be the same on every rank beforehand); a meta parameter stays on the meta device.
    A parameter that is a DTensor already (its own plan entry placed it) or that the style keeps whole is left."""
    param = parameter_dict(module).get(name)
    if param is None or isinstance(param, DTensor):
        return
    where = placement_of(fact, param.ndim, is_bias=name == "bias")
    if where == Replicate():
        return  # made a replicated DTensor with the other whole parameters, after the plan is applied
    parameter_dict(module)[name] = nn.Parameter(
        distribute_tensor(param, mesh, [where], src_data_rank=None), requires_grad=param.requires_grad
    )


def _local(param: torch.Tensor) -> torch.Tensor:
    return param.to_local() if isinstance(param, DTensor) else param


def _no_bias(_param: torch.Tensor) -> None:
    """No bias in place of an ``nn.Linear``'s row-wise bias, which is added once after the sum (and the bias-free
    ``F.linear`` output is no view: the sum can be written into it)."""
    return None


def _zeros(param: torch.Tensor) -> torch.Tensor:
    """A bias of zeros in place of another module's row-wise bias, which is added once after the sum (the module may
    need a tensor: GPT-2's ``Conv1D`` passes its bias to ``addmm``)."""
    return torch.zeros(param.shape, dtype=param.dtype, device=param.device)


def _gather_last_dim(module: nn.Module, group: Any, total: int) -> None:
    """Each call's output, the rank's slice of the last dim, gathered whole (``total`` wide) on every rank."""

    def gather(_module: nn.Module, _args: Any, output: torch.Tensor) -> torch.Tensor:
        return GatherLastDim.apply(output, group, total)

    module.register_forward_hook(gather)


def run_on_local_shards(module: nn.Module, *, hide: tuple[str, ...] = ()) -> None:
    """During each call, the module's sharded parameters are their local shards, and those in ``hide`` are absent
    (a row-wise bias, added once after the sum: ``None`` for an ``nn.Linear``, zeros for another module). The
    parameters left whole are given their local views with the other whole parameters of the model, after the plan is
    applied."""
    params = parameter_dict(module)
    views: dict[str, Callable[[torch.Tensor], Any]] = {
        name: _local for name, param in params.items() if isinstance(param, DTensor)
    }
    hidden = _no_bias if isinstance(module, nn.Linear) else _zeros
    views.update({name: hidden for name in hide if params.get(name) is not None})
    if views:
        run_on_parameter_views(module, views)


def _replicated_input(group: Any, reduce_dtype: torch.dtype | None = None) -> Callable[[Any], Any]:
    """A column-wise layer's input: whole on every rank; its gradient, each rank's part, summed over the TP group (in
    ``reduce_dtype``, see :class:`SumGradients`; a region's DTensor input is summed where the region begins)."""

    def enter(x: Any) -> Any:
        if isinstance(x, DTensor):
            return x.redistribute(placements=[Replicate()] * x.device_mesh.ndim).to_local(grad_placements=[Partial()])
        if isinstance(x, torch.Tensor) and x.requires_grad and torch.is_grad_enabled():
            return SumGradients.apply(x, group, reduce_dtype)
        return x

    return enter


class _LinearLayer(ParallelStyle):
    """A layer whose ``weight`` and ``bias`` are laid out as its style's facts say."""

    def __init__(self, fact: StyleFacts):
        super().__init__()
        self.fact = fact

    def _shard(self, module: nn.Module, device_mesh: DeviceMesh) -> None:
        for name in ("weight", "bias"):
            shard_parameter(module, name, self.fact, device_mesh)


class ColumnParallel(SumsInputGradients, _LinearLayer):
    """``colwise`` and its kin: the output features split (the weight's split dim per the style's facts), the input
    replicated, the output the rank's slice (``output_sharded``) or gathered on every rank."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        self._shard(module, device_mesh)
        weight = parameter_dict(module).get("weight")
        assert isinstance(weight, DTensor), f"{type(module).__name__}: column-wise needs a weight it splits"
        run_on_local_shards(module)
        group = device_mesh.get_group()
        replicated = _replicated_input(group, self.grad_reduce_dtype)
        module.register_forward_pre_hook(on_hidden_states(replicated), with_kwargs=True)
        if not self.fact.output_sharded:
            _gather_last_dim(module, group, weight.shape[self.fact.split_dim(weight.ndim)])
        return module


class RowParallel(_LinearLayer):
    """``rowwise`` and its kin: the input features split, the partial outputs summed (a tensor of its own), the bias
    added once after the sum. ``input_sharded``: the input is the rank's slice already (a column-wise layer's output);
    else it is replicated and each rank cuts its slice (its gradient gathered back)."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        self._shard(module, device_mesh)
        run_on_local_shards(module, hide=("bias",))
        group, input_sharded = device_mesh.get_group(), self.fact.input_sharded

        def enter(x: Any) -> Any:
            if isinstance(x, DTensor):
                return x.redistribute(placements=[Shard(-1)] * x.device_mesh.ndim).to_local()
            if not input_sharded and isinstance(x, torch.Tensor):
                return (
                    DTensor.from_local(x, device_mesh, [Replicate()], run_check=False)
                    .redistribute(device_mesh, [Shard(-1)])
                    .to_local()
                )
            return x

        def leave(module: nn.Module, _args: Any, output: torch.Tensor) -> torch.Tensor:
            # An nn.Linear's bias-free output is its own fresh tensor: the sum goes into it (not under torch.compile,
            # whose graphs replay the in-place write in backward: a copy there, which inductor can fuse).
            in_place = isinstance(module, nn.Linear) and not torch.compiler.is_compiling()
            output = SumPartialOutputs.apply(output, group, in_place)
            bias = parameter_dict(module).get("bias")
            # In the output's dtype, as the module adds it (bf16 under autocast).
            return output if bias is None else output + _local(bias).to(output.dtype)

        module.register_forward_pre_hook(on_hidden_states(enter), with_kwargs=True)
        module.register_forward_hook(leave)
        return module


class EmbeddingParallel(ParallelStyle):
    """``embedding_rowwise`` (the vocabulary split: each rank looks up the ids its rows hold, the others' rows are
    zero, and the lookups are summed) and ``embedding_colwise`` (the hidden dim split: each rank looks up its slice
    of every vector, and the slices are gathered). The token ids are the same on every rank."""

    def __init__(self, fact: StyleFacts):
        super().__init__()
        self.fact = fact

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        shard_parameter(module, "weight", self.fact, device_mesh)
        weight = parameter_dict(module)["weight"]
        assert isinstance(weight, DTensor), f"{type(module).__name__}: an embedding style needs its weight split"
        run_on_local_shards(module)
        group, rank, size = device_mesh.get_group(), device_mesh.get_local_rank(), device_mesh.size()
        if self.fact.split_dim(weight.ndim) == 1:
            _gather_last_dim(module, group, weight.shape[1])
            return module
        rows = chunk_sizes(weight.shape[0], size)
        start, stop = sum(rows[:rank]), sum(rows[: rank + 1])
        # Per call: the local ids it was given, the mask of the ids other ranks hold and the module's own padding index
        # (found again by the ids, so that a call whose pre-hooks raised before this one's takes nothing). During the
        # call the padding row is the local row of the rank that holds it, and the others see none (their lookups of
        # it are zeroed anyway); outside it the module keeps its own index (code that compares ids with it).
        calls: list[tuple[torch.Tensor, torch.Tensor, Any]] = []

        def ids_of(args: tuple, kwargs: dict) -> tuple[torch.Tensor, str | None]:
            if args:
                return args[0], None
            key = "input" if "input" in kwargs else "input_ids"
            return kwargs[key], key

        def enter(_module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
            ids, key = ids_of(args, kwargs)
            mask = (ids < start) | (ids >= stop)
            local_ids = (ids - start).masked_fill(mask, 0)
            padding = getattr(module, "padding_idx", None)
            # The layer's own `padding_idx` stays global outside its forward (a model's position ids may read it);
            # its forward sees the local one, patched for the call and undone after it.
            local = (
                install_for_call(module, "padding_idx", padding - start if start <= padding < stop else None)
                if isinstance(padding, int) and installed(module, "padding_idx") is None
                else None
            )
            calls.append((local_ids, mask, local))
            return ((local_ids, *args[1:]), kwargs) if key is None else (args, {**kwargs, key: local_ids})

        def leave(_module: nn.Module, args: tuple, kwargs: dict, output: Any) -> Any:
            ids, _ = ids_of(args, kwargs)
            index = next((i for i in range(len(calls) - 1, -1, -1) if calls[i][0] is ids), None)
            if index is None:  # the forward raised before this layer's pre-hook ran (``always_call``)
                return None
            _, mask, local = calls.pop(index)
            if local is not None:
                local.undo()
            if output is None:  # the forward raised: nothing to sum, nothing left behind
                return None
            return SumPartialOutputs.apply(output.masked_fill(mask.unsqueeze(-1), 0), group, True)

        module.register_forward_pre_hook(enter, with_kwargs=True)
        module.register_forward_hook(leave, with_kwargs=True, always_call=True)
        return module


class _ShareOfWhole(torch.autograd.Function):
    """``1/size`` of a whole parameter forward, the gradient as it comes backward: each of ``size`` ranks adds its
    share to a partial output that is then summed, and each rank's gradient of its share is the whole parameter's
    (the summed output's gradient is whole on every rank), as one process computes it."""

    @staticmethod
    def forward(ctx, whole: torch.Tensor, size: int) -> torch.Tensor:  # type: ignore[override]
        return whole / size

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        return grad, None


class ExpertsParallel(SumsInputGradients, ParallelStyle):
    """``moe_tp_experts``: an experts module whose stacked weights are split by their own plan entries (each rank a
    slice of every expert's intermediate features). It runs on those slices; the partial outputs are summed, and the
    gradients of the hidden states and routing weights it is given (``experts(hidden, ids, weights)``) are summed
    over the TP group, each rank's covering its slice only. The routing itself (expert ids and weights) is computed
    before, whole on every rank. ``added_once``: its whole parameters that it adds to each partial output (a bias
    after the down-projection, ``partial_bias``): each rank's call sees ``1/tp`` of them."""

    def __init__(self, added_once: tuple[str, ...] = ()):
        super().__init__()
        self.added_once = added_once

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        run_on_local_shards(module)
        size = device_mesh.size()
        if self.added_once and size > 1:

            def share(param: torch.Tensor) -> torch.Tensor:
                return _ShareOfWhole.apply(_local(param), size)

            # Registered before the views of the whole parameters (replicate_unsharded_parameters), so it swaps
            # first: their view then meets a plain tensor and leaves it.
            run_on_parameter_views(module, dict.fromkeys(self.added_once, share))
        group = device_mesh.get_group()
        replicated = _replicated_input(group, self.grad_reduce_dtype)

        def enter(_module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
            args, kwargs = on_hidden_states(replicated)(_module, args, kwargs)
            if len(args) >= 3:
                args = (*args[:2], replicated(args[2]), *args[3:])
            for key in ("top_k_weights", "routing_weights"):
                if key in kwargs:
                    kwargs = {**kwargs, key: replicated(kwargs[key])}
            return args, kwargs

        def leave(_module: nn.Module, _args: Any, output: Any) -> Any:
            # A third-party forward's output: summed into a copy (it may be saved for its backward).
            return None if output is None else SumPartialOutputs.apply(output, group, False)

        module.register_forward_pre_hook(enter, with_kwargs=True)
        module.register_forward_hook(leave)
        return module


class LocalParams(ParallelStyle):
    """``local_params``: the module runs on the local shards of the parameters its own entries split (a bare
    parameter such as attention sinks, which has no forward to hook)."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        run_on_local_shards(module)
        return module


class Conv1DParallel(ParallelStyle):
    """GPT-2's ``Conv1D`` (``x @ weight + bias``, weight stored [in, out]) split column-wise (output features: weight
    dim 1 and bias; packed blocks such as [q | k | v] where the style says so, each rank its slice of every block) or
    row-wise (input features: weight dim 0, bias replicated and added once after the partial outputs are summed).
    The same hooks as :class:`ColumnParallel` and :class:`RowParallel`: only the layout differs."""

    def __init__(self, fact: StyleFacts):
        super().__init__()
        self.fact = fact

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        if self.fact.kind != "column":
            return parallelize_module(module, device_mesh, RowParallel(self.fact))
        parallelize_module(module, device_mesh, ColumnParallel(self.fact))
        # Conv1D views its output as [..., nf]: the rank's width (its whole width comes back while weights are
        # initialised).
        local = module.weight.to_local().shape[-1]
        record_local_size(module, "nf", module.nf, local)
        module.nf = local
        return module


class MlaKvAProj(SumsInputGradients, ParallelStyle):
    """``mla_kv_a_proj``: a latent attention's KV down-projection ([latent | rotary key]) stays whole, and the
    gradient of its rotary-key slice, which reaches the rank's heads unprojected, is summed over the TP group. The
    width is the attention module's own (``qk_rope_head_dim``, per layer where the config has per-layer values)."""

    def __init__(self, rope_dim: int):
        super().__init__()
        self.rope_dim = rope_dim

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        group, rope_dim, reduce_dtype = device_mesh.get_group(), self.rope_dim, self.grad_reduce_dtype

        def hook(_module: nn.Module, _args: Any, output: torch.Tensor) -> torch.Tensor:
            latent, rope = output.split([output.shape[-1] - rope_dim, rope_dim], dim=-1)
            return torch.cat([latent, SumGradients.apply(rope, group, reduce_dtype)], dim=-1)

        module.register_forward_hook(hook)
        return module


def _rope_dim(name: str, modules: Mapping[str, nn.Module]) -> int:
    """The rotary key width of the latent attention holding the projection ``name`` (checked when the plan was
    resolved)."""
    width = rotary_width(modules[name.rpartition(".")[0]])
    assert width is not None, name
    return width


Builder = Callable[[str, ResolvedPlan, Mapping[str, nn.Module]], "ParallelStyle | None"]


def _added_once(name: str, plan: ResolvedPlan | None) -> tuple[str, ...]:
    """The parameters of module ``name`` (relative names) that the plan gives a style added once (``partial_bias``)."""
    if plan is None:
        return ()
    prefix = f"{name}." if name else ""
    return tuple(
        key[len(prefix) :]
        for key, style in plan.styles.items()
        if key.startswith(prefix) and "." not in key[len(prefix) :] and getattr(facts(style), "added_once", False)
    )


def _conv1d(style: str) -> Builder:
    fact = STYLES[style]
    return lambda name, plan, modules: Conv1DParallel(fact)


#: The package's own styles applied by a stage of their own in ``apply_tensor_parallel``, parameters and modules
#: alike: the head counts (``localize_heads``) and the mixers' packed blocks (``apply_blocks``).
APPLIED_ELSEWHERE = ("local_heads", "local_heads_alibi", "colwise_blocks", "local_blocks")


def _by_kind(style: str) -> Builder:
    """The layer of a style by its kind in the table."""
    fact = STYLES[style]
    layer: Callable[[], ParallelStyle | None] = {
        "column": lambda: ColumnParallel(fact),
        "row": lambda: RowParallel(fact),
        "embedding": lambda: EmbeddingParallel(fact),
    }.get(fact.kind, lambda: None)
    return lambda name, plan, modules: layer()


#: Each applied style name's layer, built from its module's name, the plan and the model's modules by name; ``None``:
#: the style changes no forward (``replicate``; ``replicated_with_grad_allreduce``, whose gradient sum comes with the
#: whole parameters; a parameter-only style given to a module). A parameter entry is laid out by
#: :func:`shard_parameter` from the style's facts alone.
LAYERS: dict[str, Builder] = {
    **{name: _by_kind(name) for name, fact in STYLES.items() if fact.supported},
    "moe_tp_experts": lambda name, plan, modules: ExpertsParallel(_added_once(name, plan)),
    "local_params": lambda name, plan, modules: LocalParams(),
    **{name: _conv1d(name) for name in ("conv1d_colwise", "conv1d_colwise_qkv", "conv1d_rowwise")},
    "colwise_kv_heads": lambda name, plan, modules: ColwiseKVHeads(plan.kv_heads_of(name)),
    # Partial outputs reduce-scattered on the features: DTensor's Partial -> Shard(-1).
    "rowwise_local_output": lambda name, plan, modules: RowwiseParallel(output_layouts=Shard(-1)),
    "mla_kv_a_proj": lambda name, plan, modules: MlaKvAProj(_rope_dim(name, modules)),
    **{name: lambda name, plan, modules: None for name in APPLIED_ELSEWHERE},
}
