"""Rewrites of a resolved plan, before anything is sharded: the dense-layer regions, sequence parallelism and the
vocabulary-sharded output head of loss parallelism. Each takes a :class:`~lightning_tp.plans.resolved.ResolvedPlan`
and returns a new one (the given plan is left as it is); the styles a rewrite puts in that this package defines
(:mod:`lightning_tp.parallel`) are given as factories by the caller, so that plans stay below the layer that applies
them.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from typing import Any

from torch import nn
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle

from lightning_tp.composition import problem
from lightning_tp.plans.resolved import ResolvedPlan
from lightning_tp.plans.structure import decoder_layers, layer_entries, layer_stacks, output_head, text_decoder_layers
from lightning_tp.plans.styles import style_names

#: A factory of a style a rewrite puts in (a new instance per entry).
StyleFactory = Callable[[], ParallelStyle]

#: Transformers styles a decoder layer may hold for its regions to be rewritten with torch's styles.
_REWRITABLE = style_names(rewritable=True)


def region_problem(styles: Mapping[str, Any], layer: str) -> str | None:
    """Why ``layer``'s entries are not column-/row-wise pairs, or ``None``."""
    inside = layer_entries(styles, layer)
    for key, style in inside.items():
        if not (isinstance(style, str) and style in _REWRITABLE):
            return problem("sp+style_not_rewritable", f"{key!r} has style {style!r}")
    if not any(style == "rowwise" for style in inside.values()):
        return problem("sp+no_rowwise", f"decoder layer {layer!r} has no row-wise projection")
    direct = [key for key, style in inside.items() if style == "rowwise" and key.rpartition(".")[0] == layer]
    if direct:
        # The region's input is the parent's `hidden_states`: here the whole layer, norms and residuals included.
        return problem("sp+rowwise_in_layer", f"{direct[0]!r} sits directly in decoder layer {layer!r}")
    return None


def rewrite_layer_styles(
    styles: dict[str, Any],
    layer: str,
    *,
    rowwise: StyleFactory,
    region: StyleFactory,
) -> set[str]:
    """Rewrite ``layer``'s column-/row-wise entries with torch's styles in place: ``ColwiseParallel`` entries,
    ``rowwise()`` exits, and ``region()`` on each parent of an exit (``self_attn``, ``mlp``). Returns the regions."""
    inside = layer_entries(styles, layer)
    for key in [k for k in styles if k.startswith(f"{layer}.") and k.endswith((".weight", ".bias"))]:
        if styles[key] in ("colwise", "rowwise"):
            del styles[key]  # torch's styles shard the parameters of the module entry
    for key, style in inside.items():
        if style == "colwise":
            styles[key] = ColwiseParallel()
        elif style == "rowwise":
            styles[key] = rowwise()
    regions = {key.rsplit(".", 1)[0] for key, style in inside.items() if style == "rowwise"}
    for name in regions:
        styles[name] = region()
    return regions


def rewrite_dense_layers(
    model: nn.Module, plan: ResolvedPlan, *, blocks: set[type], rowwise: StyleFactory, region: StyleFactory
) -> ResolvedPlan:
    """Decoder layers made of column-/row-wise pairs, rewritten so that each attention and MLP makes its input one
    replicated DTensor (``region()``, :class:`lightning_tp.parallel.tensor_parallel.ReplicateRegionInput`) shared by
    its column-wise projections: their partial input gradients are summed and all-reduced once, 2 all-reduces per
    layer in backward (Megatron's count) instead of one per projection (5 for q, k, v, gate, up) with a column-wise
    layer each. A stack of layers (a vision-language model has one per tower) with any other layer keeps the plan's
    own layers. ``rowwise()``: the style of each row-wise exit."""
    styles: dict[str, Any] = dict(plan.styles)
    rewritten = False
    # Stack by stack: a vision tower's layers with another style leave the language model's rewritten.
    for stack in layer_stacks(decoder_layers(model, styles, blocks)).values():
        if any(region_problem(styles, layer) for layer in stack):
            continue
        for layer in stack:
            rewrite_layer_styles(styles, layer, rowwise=rowwise, region=region)
        rewritten = True
    if not rewritten:
        return plan
    return replace(plan, styles=styles, grad_allreduce=list(plan.grad_allreduce))


def rewrite_for_sequence_parallel(
    model: nn.Module,
    plan: ResolvedPlan,
    *,
    blocks: set[type],
    rowwise: StyleFactory,
    region: StyleFactory,
    layer: Callable[..., Any],
    final_norm: StyleFactory,
    stages: Sequence[range] = (),
) -> ResolvedPlan:
    """``plan`` rewritten for sequence parallelism (:mod:`lightning_tp.parallel.sequence_parallel`): each text decoder
    layer's column-/row-wise pairs with torch's styles, ``rowwise()`` exits (the reduce-scatter), ``region()`` on each
    attention and MLP (the all-gather), ``layer(first=..., last=...)`` on each decoder layer (``first``: it cuts the
    sequence, the first layer of the model or of a pipeline stage; ``last``: it gathers it, the last layer of a
    pipeline stage before the last, whose output goes to the next stage whole; ``None`` for nothing),
    ``final_norm()`` on the norm after the layers (gathers it); the parameters outside the regions (the norms) get
    their gradients summed over the TP group. ``blocks``: the classes of the decoder layers; ``stages``: the decoder
    layers of each pipeline stage (none: one stage). Refuses, naming the module and style, what sequence parallelism
    cannot rewrite."""
    styles: dict[str, Any] = dict(plan.styles)
    grad_allreduce = list(plan.grad_allreduce)
    # The language model's stack only: a vision tower planned too runs on its patches with plain TP.
    layers = text_decoder_layers(model, decoder_layers(model, styles, blocks))
    if not layers:
        classes = sorted(b.__name__ for b in blocks)
        raise ValueError(
            f"sequence_parallel=True needs the decoder layers of {type(model).__name__} (classes {classes}), and "
            "found none. Pass `fsdp_blocks=[<decoder layer class>]`, or drop `sequence_parallel`."
        )
    problems = [found for layer in layers if (found := region_problem(styles, layer))]
    if not problems:
        problems = [found for layer in layers if (found := _outside_regions(model, styles, layer))]
    if problems:
        raise ValueError(f"sequence_parallel=True rewrites column-wise/row-wise pairs, but {problems[0]}.")
    firsts = {stage.start for stage in stages} | {0}
    lasts = {stage.stop - 1 for stage in stages[:-1]}
    for index, path in enumerate(layers):
        regions = rewrite_layer_styles(styles, path, rowwise=rowwise, region=region)
        # The stages count positions in the layer list ("model.layers.7"), which skip no layer; the first layer with
        # a plan cuts the sequence whatever its position.
        position = int(path.rsplit(".", 1)[1]) if stages else index
        style = layer(first=index == 0 or position in firsts, last=position in lasts)
        if style is not None:
            styles[path] = style
        # Replicated parameters outside the regions (the norms) see one sequence shard each.
        inside = layer_entries(plan.styles, path)
        for name, module in model.get_submodule(path).named_modules(prefix=path):
            if any(name == r or name.startswith(f"{r}.") for r in regions) or name in inside:
                continue
            if any(True for _ in module.parameters(recurse=False)):
                grad_allreduce.append(name)
    norms = _norms_after_layers(model, layers, styles)
    if len(norms) != 1:
        raise ValueError(
            f"sequence_parallel=True gathers the sequence after the final norm, but found {norms or 'none'} "
            f"after the decoder layers of {type(model).__name__}."
        )
    grad_allreduce += norms
    styles[norms[0]] = final_norm()
    return replace(plan, styles=styles, grad_allreduce=grad_allreduce)


def _outside_regions(model: nn.Module, styles: dict[str, Any], layer: str) -> str | None:
    """A module of the layer with parameters that would run on sequence shards and is not a norm (an attention the
    plan leaves whole, say), or ``None``."""
    regions = {key.rsplit(".", 1)[0] for key, style in layer_entries(styles, layer).items() if style == "rowwise"}
    for name, child in model.get_submodule(layer).named_children():
        path = f"{layer}.{name}"
        if path in regions or "norm" in type(child).__name__.lower() or not any(True for _ in child.parameters()):
            continue
        inside = [r for r in regions if r.startswith(f"{path}.")]
        if inside and all(any(p.startswith(f"{r}.") for r in inside) for p, _ in child.named_parameters(prefix=path)):
            continue  # a wrapper around a region (GPT-Neo's `attn` around `attn.attention`), nothing else in it
        return f"{path!r} ({type(child).__name__}) would run on sequence shards; only norms can"
    return None


def _norms_after_layers(model: nn.Module, layers: list[str], styles: dict[str, Any]) -> list[str]:
    """Modules with parameters that run on the last layer's output shards: the final norm, among the modules
    registered after the list of layers (Bloom's embedding norm, registered before it, runs before the layers)."""
    base, list_name, _ = layers[-1].rsplit(".", 2)  # "model.layers.N" -> "model", "layers"
    found = []
    children = list(model.get_submodule(base).named_children())
    after = [i for i, (name, _) in enumerate(children) if name == list_name][0] + 1
    for name, module in children[after:]:
        path = f"{base}.{name}"
        if path in styles or isinstance(module, nn.ModuleList) or isinstance(module, nn.Embedding):
            continue
        if any(True for _ in module.parameters()):
            found.append(path)
    return found


def rewrite_output_head(model: nn.Module, plan: ResolvedPlan, *, head: StyleFactory) -> ResolvedPlan:
    """``plan`` with the model's output head (``lm_head``, which must be in the plan) given ``head()`` for its module
    entry and no parameter entry (loss parallelism's column-wise head whose logits stay vocabulary-sharded)."""
    styles = dict(plan.styles)
    name = output_head(model, styles)
    styles.pop(f"{name}.weight", None)
    styles[name] = head()
    return replace(plan, styles=styles, grad_allreduce=list(plan.grad_allreduce))
