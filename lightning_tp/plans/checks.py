"""The checks of a plan's styles against the model that need no head counts (those are
:mod:`lightning_tp.plans.heads`): style names refused or unknown, even splits where shards meet a rank-local op, tied
parameters given the same layout; and the modules kept whole of which each rank computes a part of the gradient (a
norm over sharded heads, a learnable activation between split projections), summed over the TP group."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor.parallel import ParallelStyle

from lightning_tp.plans.resolved import Style
from lightning_tp.plans.styles import REFUSED_STYLES, SUPPORTED_STYLES, facts, style_names

#: Where activation function classes live: an activation module is applied to an MLP's (sharded) features.
_ACTIVATION_MODULES = ("transformers.activations", "torch.nn.modules.activation")
#: Styles whose output holds each rank's slice of the features (heads): a head count must divide by the TP size.
_COLUMN_STYLES = style_names(output_sharded=True)


def check_style(key: str, style: Any) -> None:
    """Raise a ``ValueError`` naming ``key`` when ``style`` is refused or unknown."""
    if isinstance(style, ParallelStyle):
        return
    if not isinstance(style, str):
        raise ValueError(
            f"tp_plan[{key!r}] = {style!r}: a style must be a Transformers style name or a torch "
            "`ParallelStyle` instance."
        )
    if style in REFUSED_STYLES:
        raise ValueError(f"tp_plan[{key!r}] = {style!r} is not supported: {REFUSED_STYLES[style]}.")
    if style not in SUPPORTED_STYLES:
        raise ValueError(
            f"tp_plan[{key!r}] = {style!r} is not a style this strategy knows (a newer Transformers "
            "may have added it). "
            f"Override the entry: tp_plan={{{key!r}: 'replicate'}} keeps that module whole; or use one of "
            f"{sorted(SUPPORTED_STYLES)} or a torch `ParallelStyle` instance."
        )


def check_even_splits(module: nn.Module, styles: Mapping[str, Style], tp_size: int) -> None:
    """A linear layer whose shards meet another rank-local op must be split on a dim the TP size divides (an MLP's
    intermediate size, say): uneven shards of a column-wise layer whose output stays sharded, or of the row-wise
    layer that takes it, fail mid-forward with a different shape on each rank. Layers whose output is gathered or
    whose replicated input is split locally (``colwise_rep``, ``rowwise_split_input``...) go through DTensor, which
    pads uneven shards; so do the vocabulary (embeddings, the output head) and the K/V projections of KV-head
    replication (gathered before use)."""
    if tp_size == 1:
        return
    out = module.get_output_embeddings() if hasattr(module, "get_output_embeddings") else None
    head = {id(p) for p in out.parameters()} if isinstance(out, nn.Module) else set()
    uneven = {}
    for name, param in module.named_parameters():
        style = styles.get(name)
        fact = facts(style)
        rank_local = fact is not None and (fact.output_sharded or fact.input_sharded)
        if not rank_local or fact.kind not in ("column", "row") or style == "colwise_kv_heads" or id(param) in head:
            continue
        dim = fact.split_dim(param.ndim, is_bias=name.rpartition(".")[2] == "bias")
        if dim is not None and param.shape[dim] % tp_size:
            uneven[name] = param.shape[dim]
    if uneven:
        sizes = set(uneven.values())
        good = [d for d in range(1, max(sizes) + 1) if all(size % d == 0 for size in sizes)]
        shown = dict(list(uneven.items())[:3])
        raise ValueError(
            f"{type(module).__name__}: the plan splits {len(uneven)} parameter(s) on a dim not divisible by "
            f"tp_size={tp_size} (name: size of the split dim, e.g. {shown}), which would fail mid-forward with a "
            f"different shape on each rank. Use a tp_size that divides them: one of {good}, or keep those modules "
            "whole (`tp_plan={'<module>': 'replicate'}`)."
        )


def between_split_projections(module: nn.Module, styles: Mapping[str, Style]) -> list[str]:
    """Activation functions with learnable parameters (Apertus' xIELU) that the plan does not name, next to a
    column-wise projection whose output stays sharded and a row-wise one: an MLP's activation runs on the rank's
    features, so each rank's gradient is a part of the whole one and is summed over the TP group. Only activation
    modules (Transformers' or torch's): another module there (a norm, a head) may run on the whole hidden states,
    and is left to the plan. A parameter with one value per sharded feature would need splitting, not a sum:
    refused by name."""
    modules = dict(module.named_modules())
    found = []
    for name, child in modules.items():
        params = dict(child.named_parameters(recurse=False))
        if not name or not params or name in styles or type(child).__module__ not in _ACTIVATION_MODULES:
            continue
        if any(f"{name}.{p}" in styles for p in params):
            continue
        parent = name.rpartition(".")[0]
        siblings = {
            key: style
            for key, style in styles.items()
            if key.rpartition(".")[0] == parent and key in modules and key != name
        }
        column = [key for key, style in siblings.items() if style in _COLUMN_STYLES]
        if not column or not any(getattr(facts(style), "kind", None) == "row" for style in siblings.values()):
            continue
        widths = {
            weight.shape[dim]
            for key in column
            if isinstance(weight := getattr(modules[key], "weight", None), torch.Tensor)
            and (dim := facts(styles[key]).split_dim(weight.ndim)) is not None
        }
        per_feature = [f"{p} {list(t.shape)}" for p, t in params.items() if widths & set(t.shape)]
        if per_feature:
            raise ValueError(
                f"{type(module).__name__}: {name} ({type(child).__name__}) holds {per_feature}, one value per "
                f"feature of {column[0]}, whose output the plan splits over the TP ranks: give {name!r} a style in "
                f"`tp_plan` that splits it the same way, or keep {column[0]!r} whole ('colwise_rep')."
            )
        found.append(name)
    return found


def sees_sharded_features(norm: str, styles: Mapping[str, Style]) -> bool:
    """Whether a ``replicated_with_grad_allreduce`` module (Qwen3's ``q_norm``) normalises a column-sharded output,
    so that each rank's gradient covers its own heads only. ``q_norm`` follows ``q_proj``; a module with no such twin
    follows its planned siblings (none: the style is taken at its word). When that projection is gathered
    (``colwise_rep``), every rank sees every head, its gradient is already whole, and summing it over the TP group
    would multiply it by ``tp_size``."""
    parent, _, leaf = norm.rpartition(".")
    prefix = f"{parent}." if parent else ""
    twin = f"{prefix}{leaf.removesuffix('_norm')}_proj"
    if twin in styles:
        return styles[twin] in _COLUMN_STYLES
    siblings = [n for n in styles if n.startswith(prefix) and n != norm and "." not in n[len(prefix) :]]
    return not siblings or any(styles[n] in _COLUMN_STYLES for n in siblings)


def tied_aliases(module: nn.Module, param_styles: Mapping[str, Style | None]) -> dict[str, str]:
    """Map each alias of a shared parameter to the name that holds it, and check that every alias asks for the same
    layout (a tied embedding and ``lm_head`` are sharded once and share the shard)."""
    owner: dict[int, str] = {}
    tied: dict[str, str] = {}
    for name, param in module.named_parameters(remove_duplicate=False):
        if id(param) not in owner:
            owner[id(param)] = name
            continue
        source = owner[id(param)]
        tied[name] = source
        layouts = {n: _weight_layout(param_styles.get(n), n, param.ndim) for n in (source, name)}
        if layouts[source] != layouts[name]:
            raise ValueError(
                f"Tied parameters {source!r} and {name!r} would be sharded differently "
                f"({param_styles.get(source)!r} vs {param_styles.get(name)!r}). Give both the same layout, e.g. "
                "'embedding_rowwise' for the embedding with 'colwise_gather_output' for lm_head (both shard the "
                "vocabulary), or untie them (`tie_word_embeddings=False`)."
            )
    return tied


def _weight_layout(style: Style | None, name: str, ndim: int) -> str:
    """The layout ``style`` gives parameter ``name`` of ``ndim`` dims (equal strings: the same shard on every rank)."""
    if style is None or isinstance(style, str):
        fact = facts(style)
        return "replicated" if fact is None else fact.layout(ndim, is_bias=name.rpartition(".")[2] == "bias")
    return f"custom {type(style).__name__}"


__all__ = [
    "between_split_projections",
    "check_even_splits",
    "check_style",
    "sees_sharded_features",
    "tied_aliases",
]
