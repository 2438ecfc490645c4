"""Applying a resolved plan to a module on the TP mesh axis.

Style names are applied with this package's layers (:mod:`lightning_tp.parallel.layers`), torch ``ParallelStyle``
entries as they are, both with ``parallelize_module``. Then every parameter the plan left whole becomes a replicated
DTensor, so that the model holds DTensors only. Without that, a TP model mixes DTensors (sharded weights) with plain
tensors (norms), and ``foreach``/``fused`` optimizers and ``clip_grad_norm_`` fail on the mix (torch 2.13).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.distributed as dist
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate
from torch.distributed.tensor.parallel import ParallelStyle, parallelize_module

from lightning_tp.compat import distributed_is_initialized, parameter_dict, remove_transformers_grad_allreduce
from lightning_tp.parallel.blocks import apply_blocks
from lightning_tp.parallel.collectives import (
    ReplicatedFromLocal,
    SumGradients,
    SumsInputGradients,
    collective_device,
)
from lightning_tp.parallel.hooks import RUNS_NO_PARAMETERS_ATTR, on_hidden_states, run_on_parameter_views
from lightning_tp.parallel.kv_heads import kv_head_layout, localize_kv_groups
from lightning_tp.parallel.layers import APPLIED_ELSEWHERE, LAYERS, RowParallel, shard_parameter
from lightning_tp.parallel.random_init import record_local_size
from lightning_tp.plans.resolved import ResolvedPlan
from lightning_tp.plans.rewrite import rewrite_dense_layers
from lightning_tp.plans.styles import (
    KV_GROUPS_ATTRIBUTE,
    KV_HEAD_COUNT_ATTRIBUTES,
    QUERY_HEAD_COUNT_ATTRIBUTES,
    STYLES,
    facts,
    style_names,
)

#: Set on every module this package sharded, to the TP mesh, so a second ``setup`` does not shard it again.
SHARDED_MARKER = "_lightning_tp_mesh"


def is_sharded(module: nn.Module) -> bool:
    """Whether the module already holds TP shards (from this package, or from Transformers' ``from_pretrained``)."""
    if getattr(module, SHARDED_MARKER, None) is not None:
        return True
    return any(isinstance(p, DTensor) for p in module.parameters())


def apply_tensor_parallel(
    module: nn.Module,
    tp_mesh: DeviceMesh,
    plan: ResolvedPlan,
    *,
    device: torch.device | None = None,
    grad_reduce_dtype: torch.dtype | None = None,
) -> nn.Module:
    """Shard ``module`` in place following ``plan`` (from :func:`lightning_tp.plans.resolve.resolve_plan` on this
    module), with this package's layers (:mod:`lightning_tp.parallel.layers`) and the plan's torch styles.

    ``device``: where the parameters the plan leaves whole go (sharded ones land on the mesh's device while they are
    cut). Modules on the meta device stay there, to be materialised after sharding. ``grad_reduce_dtype``: the dtype
    the layers built here sum their inputs' gradients in over the TP group (``None``: the gradient's own; the plan's
    own styles, a dense region's, were given theirs when the plan was rewritten).
    """
    assert tp_mesh.ndim == 1, "apply_tensor_parallel takes the 1-D TP sub-mesh"
    # Sharding slices each rank's local copy (no communication), so the weights must be identical on every TP rank
    # beforehand (same seed or file). Parameter entries first: a module's layer runs on what its parameters' own
    # entries split (an experts module's stacked weights).
    modules = dict(module.named_modules())
    for name, style in plan.styles.items():
        fact = facts(style)
        if fact is not None and name not in modules and style not in APPLIED_ELSEWHERE:
            owner, _, param = name.rpartition(".")
            shard_parameter(modules[owner], param, fact, tp_mesh)
    layers = {
        name: style if isinstance(style, ParallelStyle) else LAYERS[style](name, plan, modules)
        for name, style in plan.styles.items()
        if name in modules
    }
    for name, layer in layers.items():
        if isinstance(layer, SumsInputGradients) and not isinstance(plan.styles[name], ParallelStyle):
            layer.grad_reduce_dtype = grad_reduce_dtype  # a layer built here (the plan's own are left as given)
    if layers := {name: layer for name, layer in layers.items() if layer is not None}:
        parallelize_module(module, tp_mesh, layers)
    # Before the head counts change: the mixers' block sizes were read from them when the plan was resolved.
    apply_blocks(module, tp_mesh, plan, grad_reduce_dtype=grad_reduce_dtype)
    retie(module, plan.tied)
    localize_heads(module, plan, tp_size=tp_mesh.size(), rank=tp_mesh.get_local_rank())
    slice_alibi_heads(module, plan.alibi_heads, tp_mesh=tp_mesh)
    if device is not None and not on_meta(module):
        module.to(device)
    # The experts of expert parallelism stay plain: the EP stage splits them over the expert mesh next.
    replicate_unsharded_parameters(module, tp_mesh, grad_allreduce=plan.grad_allreduce, keep=plan.expert_modules)
    gather_embedding_for_direct_reads(module)
    setattr(module, SHARDED_MARKER, tp_mesh)
    return module


def localize_heads(module: nn.Module, plan: ResolvedPlan, *, tp_size: int, rank: int) -> None:
    """``local_heads``: each named attention module's head counts become the rank's own (its q/k/v projections are
    column-sharded, so each rank computes ``count / tp_size`` whole heads; divisibility was checked with the plan).
    An attention module whose KV heads are replicated gets its rank's KV heads and grouping instead
    (:func:`lightning_tp.parallel.kv_heads.localize_kv_groups`)."""
    modules = dict(module.named_modules())
    for name in plan.local_heads:
        attention = modules[name]
        for path in plan.head_attributes(name):
            # A mixer's attribute may be its child's (Falcon-H1's `norm.n_groups`).
            owner, _, attribute = path.rpartition(".")
            holder = attention.get_submodule(owner) if owner else attention
            count = getattr(holder, attribute, None)
            if name in plan.kv_replicated and attribute in KV_HEAD_COUNT_ATTRIBUTES:
                continue
            if isinstance(count, int) and not isinstance(count, bool):
                assert count % tp_size == 0, (name, path, count, tp_size)
                setattr(holder, attribute, count // tp_size)
                record_local_size(attention, path, count, count // tp_size)
    for name, sizes in plan.mixer_sizes(tp_size).items():
        for attribute, value in sizes.items():
            record_local_size(modules[name], attribute, getattr(modules[name], attribute), value)
            setattr(modules[name], attribute, value)
    for name in plan.local_heads:
        if name not in plan.kv_replicated:
            _localize_groups(modules[name])
    for name, (query_heads, kv_heads) in plan.kv_replicated.items():
        layout = kv_head_layout(query_heads, kv_heads, tp_size=tp_size, rank=rank)
        attributes = KV_HEAD_COUNT_ATTRIBUTES if name in plan.local_heads else ()
        localize_kv_groups(modules[name], layout, count_attributes=attributes)


def _localize_groups(attention: nn.Module) -> None:
    """The query heads per KV head (``num_key_value_groups``, what ``repeat_kv`` and SDPA's GQA expand by) derived
    again from the rank's own head counts: a multi-query attention that takes its one K/V head whole on every rank
    (Falcon's) keeps 1 KV head for half the query heads at TP 2. Where the counts were divided alike, the ratio is
    the same."""
    groups = getattr(attention, KV_GROUPS_ATTRIBUTE, None)
    query = next((getattr(attention, a) for a in QUERY_HEAD_COUNT_ATTRIBUTES if hasattr(attention, a)), None)
    kv = next((getattr(attention, a) for a in KV_HEAD_COUNT_ATTRIBUTES if hasattr(attention, a)), None)
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in (groups, query, kv)) or not kv:
        return
    if query % kv == 0 and query // kv != groups:
        record_local_size(attention, KV_GROUPS_ATTRIBUTE, groups, query // kv)
        setattr(attention, KV_GROUPS_ATTRIBUTE, query // kv)


def slice_alibi_heads(module: nn.Module, names: list[str], *, tp_mesh: DeviceMesh) -> None:
    """``local_heads_alibi``: the ALiBi biases the model builds for every head (Bloom's ``alibi`` keyword,
    [batch * heads, 1, keys], batch-major; MPT's ``position_bias``, [heads, 1, keys]) sliced to this rank's heads
    (contiguous, as the column split gives them) before each named attention module runs."""
    rank, tp_size = tp_mesh.get_local_rank(), tp_mesh.size()
    modules = dict(module.named_modules())

    def hook(attention: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
        heads = next(getattr(attention, a) for a in ("num_heads", "n_heads") if hasattr(attention, a))  # the rank's
        if kwargs.get("alibi") is not None:  # Bloom: [batch * heads, 1, keys]
            alibi = kwargs["alibi"]
            batch = alibi.shape[0] // (heads * tp_size)
            whole = alibi.view(batch, heads * tp_size, *alibi.shape[1:])
            mine = whole[:, rank * heads : (rank + 1) * heads].reshape(batch * heads, *alibi.shape[1:])
            return args, {**kwargs, "alibi": mine}
        if kwargs.get("position_bias") is not None:  # MPT: [heads, 1, keys]
            bias = kwargs["position_bias"]
            return args, {**kwargs, "position_bias": bias[rank * heads : (rank + 1) * heads]}
        return None

    for name in names:
        modules[name].register_forward_pre_hook(hook, with_kwargs=True)


def transformers_tp_mesh(model: nn.Module) -> DeviceMesh:
    """The TP mesh of a model sharded by Transformers' ``from_pretrained(distributed_config=...)``."""
    meshes = {id(p.device_mesh): p.device_mesh for p in model.parameters() if isinstance(p, DTensor)}
    if len(meshes) != 1 or next(iter(meshes.values())).ndim != 1:
        raise ValueError(
            f"{type(model).__name__} was sharded by Transformers on more than a 1-D tensor-parallel mesh (FSDP or "
            "pipeline sizes in its `distributed_config`). Load it with `DistributedConfig(tp_size=...)` alone, or "
            "without one, and let the strategy apply FSDP2."
        )
    return next(iter(meshes.values()))


def adopt_transformers_sharding(model: nn.Module, tp_mesh: DeviceMesh, plan: ResolvedPlan) -> nn.Module:
    """Bring a model that ``from_pretrained(distributed_config=...)`` sharded into the state that
    :func:`apply_tensor_parallel` leaves: its whole parameters become replicated DTensors, so that optimizers and
    clipping see DTensors only.

    Transformers' ``replicated_with_grad_allreduce`` layer hooks plain parameters in their first forward; it is
    removed (from the instance's ``forward`` or its forward pre-hooks, by release) and replaced by the same gradient
    sum on the local view.
    """
    modules = dict(model.named_modules())
    summed = {name for name, style in plan.styles.items() if facts(style) is not None and facts(style).sums_gradients}
    for name in sorted((summed | set(plan.grad_allreduce)) & set(modules)):
        remove_transformers_grad_allreduce(modules[name])
    replicate_unsharded_parameters(model, tp_mesh, grad_allreduce=plan.grad_allreduce)
    gather_embedding_for_direct_reads(model)
    keep_gradient_layout(model, plan)
    setattr(model, SHARDED_MARKER, tp_mesh)
    return model


#: Largest number of bytes moved to the device per broadcast when taking rank 0's values (NCCL needs device tensors).
_BROADCAST_BUCKET_BYTES = 256 * 1024 * 1024


@torch.no_grad()
def take_rank_zero_values(module: nn.Module, group: dist.ProcessGroup | None = None) -> list[str]:
    """Give every rank of ``group`` (default: all ranks) rank 0's values of the module's parameters and buffers, where
    they differ; return the names of the tensors taken from rank 0 (the same list on every rank).

    TP and FSDP2 both slice each rank's own copy, so ranks built with different seeds would otherwise train a model
    that is no single model. As torch's parallel styles do (``src_data_rank=0``), rank 0's values win: the run then
    equals one process initialised like rank 0. One all-gather of a checksum per tensor tells which tensors differ
    (every rank compares the same gathered values, so every rank takes the same decision), then only those are
    broadcast. Sharded (DTensor) and meta tensors are left alone.
    """
    if not distributed_is_initialized() or dist.get_world_size(group) == 1:
        return []
    names, tensors, sums = [], [], []
    for name, tensor in [*module.named_parameters(), *module.named_buffers()]:
        if tensor is None or isinstance(tensor, DTensor) or tensor.is_meta:
            continue
        data = tensor.detach()
        if data.is_complex():
            data = torch.view_as_real(data)  # complex rotary tables: a real view, no copy
        elif not data.is_floating_point():
            data = data.double()  # integer and boolean buffers (position ids, masks): small
        names.append(name)
        tensors.append(tensor)
        sums.append(torch.stack([data.sum(dtype=torch.float64), torch.linalg.vector_norm(data, dtype=torch.float64)]))
    if not sums:
        return []
    device = collective_device(group)
    local = torch.stack(sums).to(device)
    gathered = [torch.empty_like(local) for _ in range(dist.get_world_size(group))]
    dist.all_gather(gathered, local, group=group)
    reference = gathered[0]
    differs = torch.zeros(len(names), dtype=torch.bool, device=device)
    for other in gathered[1:]:
        # Exact comparison (NaN equal to NaN): identical tensors give identical checksums.
        same = (other == reference) | (other.isnan() & reference.isnan())
        differs |= ~same.all(dim=1)
    indices = differs.nonzero().flatten().tolist()
    _broadcast_from_rank_zero([tensors[i] for i in indices], group=group, device=device)
    return [names[i] for i in indices]


def _broadcast_from_rank_zero(
    tensors: list[torch.Tensor], *, group: dist.ProcessGroup | None, device: torch.device
) -> None:
    """Overwrite ``tensors`` on every rank with rank 0's values, in buckets of one dtype flattened into one tensor on
    ``device`` (bounded device memory when the model lives on the CPU)."""
    src = dist.get_global_rank(group, 0) if group is not None else 0
    buckets: list[list[torch.Tensor]] = []
    filled = 0
    for tensor in sorted(tensors, key=lambda t: str(t.dtype)):
        size = tensor.numel() * tensor.element_size()
        if not buckets or buckets[-1][0].dtype != tensor.dtype or filled + size > _BROADCAST_BUCKET_BYTES:
            buckets.append([])
            filled = 0
        buckets[-1].append(tensor)
        filled += size
    for bucket in buckets:
        flat = torch.cat([t.detach().reshape(-1).to(device) for t in bucket])
        dist.broadcast(flat, src=src, group=group)
        for tensor, values in zip(bucket, flat.split([t.numel() for t in bucket]), strict=True):
            tensor.detach().copy_(values.view_as(tensor))


def on_meta(module: nn.Module) -> bool:
    """Whether any parameter of the module is on the meta device (built without memory, to be materialised)."""
    return any(t.is_meta for t in module.parameters())


def retie(module: nn.Module, tied: dict[str, str]) -> None:
    """Point every alias of a shared parameter at the one held under its first name again: sharding and ``to_empty``
    replace that parameter (``to_empty`` gives every alias its own storage)."""
    for alias, source in tied.items():
        owner_name, _, param_name = alias.rpartition(".")
        owner = module.get_submodule(owner_name)
        parameter_dict(owner)[param_name] = module.get_parameter(source)


def replicate_unsharded_parameters(
    module: nn.Module, tp_mesh: DeviceMesh, *, grad_allreduce: Iterable[str] = (), keep: Iterable[str] = ()
) -> None:
    """Turn every plain parameter into a ``Replicate()`` DTensor on ``tp_mesh``; its module's forward then runs on the
    local tensor (a view: no copy, no communication). Modules named in ``grad_allreduce`` get their parameters'
    gradients summed over the TP group in backward (Transformers' ``replicated_with_grad_allreduce``). Modules in
    ``keep`` (and everything under them) are left as they are."""
    summed = set(grad_allreduce)
    kept = tuple(keep)
    replaced: dict[int, nn.Parameter] = {}  # a parameter shared by several modules (tied) is wrapped once
    modules = dict(module.named_modules())
    for name, submodule in modules.items():
        if kept and (name in kept or name.startswith(tuple(f"{k}." for k in kept))):
            continue
        local_names = []
        for param_name, param in list(parameter_dict(submodule).items()):
            if param is None:
                continue
            if id(param) not in replaced:
                if isinstance(param, DTensor):
                    continue
                replicated = DTensor.from_local(param.data, tp_mesh, [Replicate()], run_check=False)
                replaced[id(param)] = nn.Parameter(replicated, requires_grad=param.requires_grad)
            parameter_dict(submodule)[param_name] = replaced[id(param)]
            local_names.append(param_name)
        if local_names:
            view = _local_view(tp_mesh.get_group() if name in summed else None)
            if isinstance(submodule, (nn.ParameterDict, nn.ParameterList)) and name:
                # A parameter container has no forward: its owner (e.g. PEFT's LoRA embedding) reads it in its own.
                owner = modules[name.rpartition(".")[0]]
                run_on_parameter_views(owner, dict.fromkeys(local_names, view), holder=submodule)
            else:
                run_on_parameter_views(submodule, dict.fromkeys(local_names, view))
                if "." in name and isinstance(submodule, nn.Conv1d):
                    # Sequence mixers read their convolution's parameters without calling it (`self.conv1d.weight`
                    # passed to a causal-conv function): the parent's call swaps them too, when still replicated.
                    # Only there: a swap at every parent breaks torch.compile (the swapped view becomes a constant).
                    parent = modules[name.rpartition(".")[0]]
                    parent_view = _replicated_view(tp_mesh.get_group() if name in summed else None)
                    run_on_parameter_views(parent, dict.fromkeys(local_names, parent_view), holder=submodule)
    _run_replicated_subtrees_on_views(module, {id(p) for p in replaced.values()}, summed)


#: What a class may do with the embedding's weight without reading its values (Llama 4 reads its device).
#: The classes whose forward reads their input embedding's ``weight`` without calling the embedding, by class name ->
#: the path of that embedding from the class's module. Read off the modeling files of every causal-LM family of
#: Transformers 5.24 and 5.25: Gemma 4's per-layer inputs take ``self.language_model.embed_tokens.weight[pad_token_id]``
#: (and its text model ``self.embed_tokens.weight[...]``). Nothing is inferred from source text: a class not listed
#: that reads a vocabulary-split table meets a DTensor among plain tensors and fails there, loudly; add it here.
EMBEDDING_READERS: dict[str, str] = {
    "Gemma4Model": "language_model.embed_tokens",
    "Gemma4TextModel": "embed_tokens",
}


def _input_embedding(model: nn.Module) -> nn.Module | None:
    """``model``'s input embedding (a LoRA wrapper's base layer), or ``None`` where it has none."""
    try:
        embedding = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    except NotImplementedError:  # Transformers' default for a model it cannot resolve
        return None
    if hasattr(embedding, "get_base_layer"):
        embedding = embedding.get_base_layer()
    return embedding if isinstance(embedding, nn.Module) and embedding is not model else None


def embedding_readers(model: nn.Module) -> list[str]:
    """The modules above ``model``'s input embedding that read its ``weight`` without calling it
    (:data:`EMBEDDING_READERS`), outermost first."""
    embedding = _input_embedding(model)
    path = next((name for name, m in model.named_modules() if m is embedding and name), None)
    if path is None:
        return []
    parts = path.removesuffix(".base_layer").split(".")
    ancestors = [".".join(parts[:i]) for i in range(len(parts))]
    return [
        ancestor
        for i, ancestor in enumerate(ancestors)
        if EMBEDDING_READERS.get(type(model.get_submodule(ancestor)).__name__) == ".".join(parts[i:])
    ]


def gather_embedding_for_direct_reads(model: nn.Module) -> None:
    """Where a module reads the input embedding's ``weight`` itself (:func:`embedding_readers`), that module's call
    sees the whole table: ``full_tensor()``, gathered at each of its calls when the vocabulary is split (nothing to
    gather when it is replicated), a row's gradient going back to its shard. The embedding's own call inside it sees
    its shard as usual. Every reader is hooked (one may be called without the others); a nested one finds the table
    whole already."""
    embedding = _input_embedding(model)
    readers = embedding_readers(model)
    if embedding is None or not readers or not isinstance(parameter_dict(embedding).get("weight"), DTensor):
        return
    # Per reader's call: (what it replaced, the shard the embedding's own call sees, the whole table).
    stack: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []

    def gather(_module: nn.Module, _args: Any) -> None:
        params = parameter_dict(embedding)
        weight = params["weight"]
        if stack and weight is stack[-1][2]:  # inside another reader's call: the table is whole already
            stack.append((weight, stack[-1][1], weight))
        else:
            stack.append((weight, weight, weight.full_tensor() if isinstance(weight, DTensor) else weight))
        params["weight"] = stack[-1][2]

    def put(index: int) -> Callable[..., None]:
        def hook(*_: Any) -> None:
            if stack:
                parameter_dict(embedding)["weight"] = stack[-1][index]

        return hook

    def restore(*_: Any) -> None:
        if stack:
            replaced, _, whole = stack.pop()
            params = parameter_dict(embedding)
            if params["weight"] is whole:  # left alone if something else (FSDP2) put its own in since
                params["weight"] = replaced

    for name in readers:
        reader = model.get_submodule(name)
        reader.register_forward_pre_hook(gather)
        reader.register_forward_hook(restore, prepend=True, always_call=True)
    embedding.register_forward_pre_hook(put(1), prepend=True)
    embedding.register_forward_hook(put(2), always_call=True)
    rank_zero_info(
        f"{type(model).__name__}: {type(model.get_submodule(readers[0])).__name__} reads its input embedding's weight "
        "itself; it sees the whole table during its call (gathered at each call where the vocabulary is split)."
    )


def _run_replicated_subtrees_on_views(module: nn.Module, replicated: set[int], summed: set[str]) -> None:
    """A module whose whole subtree was left whole (a vision tower, a projector, a norm) also swaps its descendants'
    parameters during its own call: some forwards read a child's parameters without calling the child
    (``nn.MultiheadAttention`` passes ``out_proj.weight`` to ``F.multi_head_attention_forward``), which would
    otherwise meet the replicated DTensor. Only ``Replicate`` DTensors on one mesh axis are swapped: a parameter
    FSDP2 holds sharded at that moment is left to its unit, whose own views run after its all-gather. Subtrees
    holding a TP-sharded parameter, or a module whose gradients are summed over the TP group, keep per-module views
    only."""

    def visit(name: str, submodule: nn.Module) -> tuple[bool, list[nn.Module]]:
        """Whether the subtree holds only parameters replicated here, and its modules holding parameters."""
        own = [p for p in parameter_dict(submodule).values() if p is not None]
        whole = name not in summed and all(id(p) in replicated for p in own)
        holders = [submodule] if own else []
        inside: list[nn.Module] = []
        for child_name, child in submodule.named_children():
            child_whole, child_holders = visit(f"{name}.{child_name}" if name else child_name, child)
            whole = whole and child_whole
            inside += child_holders
        if whole and inside and not getattr(submodule, RUNS_NO_PARAMETERS_ATTR, False):
            _swap_subtree_on_call(submodule, inside)
        return whole, holders + inside

    visit("", module)


def _replicated_local(param: torch.Tensor) -> torch.Tensor | None:
    """The local tensor of a parameter replicated over one mesh axis (the TP group), else ``None``."""
    if isinstance(param, DTensor) and param.device_mesh.ndim == 1 and param.placements == (Replicate(),):
        return param.to_local()
    return None


def _swap_subtree_on_call(module: nn.Module, holders: list[nn.Module]) -> None:
    """During each call of ``module``, the replicated parameters of ``holders`` are their local tensors; afterwards
    each is put back, unless something else (FSDP2 resharding a unit inside) replaced it meanwhile."""
    pending: list[list[tuple[dict[str, Any], str, torch.Tensor, torch.Tensor]]] = []

    def swap(_module: nn.Module, _args: Any) -> None:
        swapped = []
        for holder in holders:
            params = parameter_dict(holder)
            for name, param in list(params.items()):
                local = _replicated_local(param) if param is not None else None
                if local is not None:
                    params[name] = local
                    swapped.append((params, name, param, local))
        pending.append(swapped)

    def restore(_module: nn.Module, _args: Any, _output: Any) -> None:
        if pending:
            for params, name, param, local in pending.pop():
                if params.get(name) is local:
                    params[name] = param

    module.register_forward_pre_hook(swap)
    module.register_forward_hook(restore, prepend=True, always_call=True)


class _GradInParameterLayout(torch.autograd.Function):
    """Identity forward on a DTensor parameter; backward gives its gradient the parameter's layout."""

    @staticmethod
    def forward(ctx, param: DTensor) -> DTensor:  # type: ignore[override]
        ctx.mesh, ctx.placements = param.device_mesh, param.placements
        return param.view_as(param)

    @staticmethod
    def backward(ctx, grad: DTensor):  # type: ignore[override]
        if isinstance(grad, DTensor) and grad.placements != ctx.placements:
            grad = grad.redistribute(ctx.mesh, ctx.placements)
        return grad


#: Styles whose DTensor backward returns the weight's gradient in another layout than the weight's: the embeddings.
_GRADIENT_LAYOUT_STYLES = style_names(kind="embedding")


def keep_gradient_layout(module: nn.Module, plan: ResolvedPlan) -> None:
    """Give the gradients of embedding weights their weight's layout as they are computed.

    DTensor computes the gradient of a vocabulary-sharded embedding (``embedding_rowwise``) replicated, at full size
    (torch 2.13): it would stay allocated at full size on every rank until the optimizer step. Redistributing
    ``Replicate`` to ``Shard`` in backward is a local slice (no communication). The module's forward takes the view
    of its current parameter each time, so it survives ``to_empty``, ``.to()`` and FSDP2 swapping parameters.
    """
    modules = dict(module.named_modules())
    for name, style in plan.styles.items():
        if style in _GRADIENT_LAYOUT_STYLES and isinstance(modules.get(name), nn.Embedding):
            run_on_parameter_views(modules[name], {"weight": _in_parameter_layout})


def _in_parameter_layout(param: torch.Tensor) -> torch.Tensor:
    if isinstance(param, DTensor) and param.requires_grad and torch.is_grad_enabled():
        return _GradInParameterLayout.apply(param)
    return param


def _replicated_view(grad_group: dist.ProcessGroup | None) -> Callable[[torch.Tensor], torch.Tensor]:
    """The local view of a parameter replicated over the TP group only; anything else (a parameter FSDP2 holds
    sharded at that moment) is left for its own module's view."""
    local_view = _local_view(grad_group)

    def view(param: torch.Tensor) -> torch.Tensor:
        return local_view(param) if _replicated_local(param) is not None else param

    return view


def _local_view(grad_group: dist.ProcessGroup | None) -> Callable[[torch.Tensor], torch.Tensor]:
    def view(param: torch.Tensor) -> torch.Tensor:
        if not isinstance(param, DTensor):
            return param
        local = param.to_local()
        if grad_group is not None and local.requires_grad and torch.is_grad_enabled():
            # A parameter's gradient (norms left whole): summed in fp32, as FSDP2's `reduce_dtype` reduces the rest.
            local = SumGradients.apply(local, grad_group, torch.float32)
        return local

    return view


# ---------------------------------------------------------------------------------------------------------------------
# Regions: the attention and MLP of a dense decoder layer, between one column-wise entry and one row-wise exit


def dense_layers_plan(
    model: nn.Module, plan: ResolvedPlan, *, blocks: set[type], grad_reduce_dtype: torch.dtype | None = None
) -> ResolvedPlan:
    """``plan`` with its dense decoder layers rewritten so that each attention and MLP takes one replicated input
    DTensor (:class:`ReplicateRegionInput`; 2 backward all-reduces per layer instead of one per column-wise
    projection, in ``grad_reduce_dtype``): :func:`lightning_tp.plans.rewrite.rewrite_dense_layers` with this module's
    styles."""
    return rewrite_dense_layers(
        model,
        plan,
        blocks=blocks,
        rowwise=lambda: RowParallel(STYLES["rowwise"]),
        region=lambda: ReplicateRegionInput(grad_reduce_dtype),
    )


class ReplicateRegionInput(SumsInputGradients, ParallelStyle):
    """The module's ``hidden_states`` (whole on every rank) enter as one replicated DTensor, shared by the
    column-wise projections inside: the backward sums their partial input gradients, then all-reduces once (in the
    gradient's dtype, DTensor's own backward, or in ``grad_reduce_dtype``)."""

    def __init__(self, grad_reduce_dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.grad_reduce_dtype = grad_reduce_dtype

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        reduce_dtype = self.grad_reduce_dtype

        def as_dtensor(local: Any) -> Any:
            if reduce_dtype is not None and isinstance(local, torch.Tensor) and torch.is_grad_enabled():
                return ReplicatedFromLocal.apply(local, device_mesh, reduce_dtype)
            return DTensor.from_local(local, device_mesh, [Replicate()], run_check=False)

        module.register_forward_pre_hook(on_hidden_states(as_dtensor), with_kwargs=True)
        return module
