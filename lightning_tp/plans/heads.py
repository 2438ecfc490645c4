"""The head counts a plan splits, checked against the TP size before anything moves: the model's attention heads
(and those of each model inside a composite one, and of each layer of a heterogeneous config) and the counts a
``local_heads`` module keeps. Where the TP size divides the query heads but not the KV heads, the K/V projections get
``colwise_kv_heads`` (KV-head replication, :mod:`lightning_tp.parallel.kv_heads`)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from lightning_tp.compat import config_value, layer_configs
from lightning_tp.composition import problem
from lightning_tp.plans.resolved import ResolvedPlan, Style
from lightning_tp.plans.source import is_transformers_model
from lightning_tp.plans.styles import HEAD_COUNT_ATTRIBUTES, KV_GROUPS_ATTRIBUTE, KV_HEAD_COUNT_ATTRIBUTES, style_names

#: Output projections whose width counts attention heads (query) and KV heads (key/value).
_FUSED_PROJECTIONS = ("qkv_proj", "query_key_value", "c_attn", "Wqkv")
_QUERY_PROJECTIONS = ("q_proj", "query", *_FUSED_PROJECTIONS)
_SEPARATE_KV_PROJECTIONS = ("k_proj", "v_proj", "key", "value")
_KV_PROJECTIONS = (*_SEPARATE_KV_PROJECTIONS, "qkv_proj", "query_key_value")
#: Styles whose output holds each rank's slice of the features (heads): a head count must divide by the TP size.
_COLUMN_STYLES = style_names(output_sharded=True)


def check_local_heads(
    module: nn.Module, names: list[str], tp_size: int, *, kv_replicated: Mapping[str, tuple[int, int]]
) -> None:
    """A ``local_heads`` module must keep head counts in attributes, each divisible by the TP size (its KV head
    counts excepted when its KV heads are replicated)."""
    modules = dict(module.named_modules())
    for name in names:
        counts = {
            a: getattr(modules[name], a)
            for a in HEAD_COUNT_ATTRIBUTES
            if isinstance(getattr(modules[name], a, None), int)
            and not (name in kv_replicated and a in KV_HEAD_COUNT_ATTRIBUTES)
        }
        if not counts:
            raise ValueError(
                f"tp_plan[{name!r}] = 'local_heads', but {type(modules[name]).__name__} keeps no head count in any "
                f"of {list(HEAD_COUNT_ATTRIBUTES)}: give that style to the attention module whose code reshapes by "
                "its head count."
            )
        uneven = {a: c for a, c in counts.items() if c % tp_size}
        if uneven:
            raise ValueError(
                f"{name} ({type(modules[name]).__name__}) has head counts {uneven} not divisible by tp_size={tp_size}: "
                "its heads cannot be split evenly over the TP ranks. Use a tp_size that divides them."
            )


def replicate_kv_heads(model: nn.Module, plan: ResolvedPlan, tp_size: int) -> dict[str, tuple[int, int]]:
    """Check that the TP size divides the heads the plan splits; where it divides the query heads but not the KV
    heads, give the K/V projections ``colwise_kv_heads`` (in ``plan.styles``, in place) and return their attention
    modules with the model's (query heads, KV heads) (:mod:`lightning_tp.parallel.kv_heads`). Transformers would load
    such a model and fail in the first forward; this fails here, naming the sizes that work, when replication cannot
    help. The models inside a composite one (a vision tower with plan entries) are checked against their own
    config, without replication."""
    styles = plan.styles
    if tp_size == 1:
        return {}
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    inner = [name for name, m in model.named_modules() if name and is_transformers_model(m) and m.config is not config]
    for name in inner:
        inside = {key: style for key, style in styles.items() if key.startswith(f"{name}.")}
        if inside:
            _check_head_counts(f"{type(model).__name__}.{name}", model.get_submodule(name).config, inside, tp_size)
    if len(layers := layer_configs(config)) > 1:
        # Head counts per layer (a heterogeneous config, Dots 3): each layer's must divide; no KV-head replication.
        outside = {
            key: style
            for key, style in styles.items()
            if not any(key.startswith(f"{prefix}.") for prefix in (*inner, *plan.recurrent_mixers))
        }
        for layer in layers:
            _check_head_counts(f"{type(model).__name__} (a layer of its per_layer_config)", layer, outside, tp_size)
        return {}
    heads = config_value(config, "num_attention_heads")
    kv_heads = config_value(config, "num_key_value_heads") or heads
    if not isinstance(heads, int) or not isinstance(kv_heads, int):
        return {}
    model_name = type(model).__name__

    def sharded(projections: tuple[str, ...]) -> list[str]:
        """The modules of ``projections`` the plan splits column-wise, named by a module or a parameter entry,
        outside the inner models (checked above)."""
        names = [name.removesuffix(".weight").removesuffix(".bias") for name in styles]
        return list(
            dict.fromkeys(
                name
                for name, style in zip(names, styles.values(), strict=True)
                if name.rsplit(".", 1)[-1] in projections
                and style in _COLUMN_STYLES
                and not any(name.startswith(f"{prefix}.") for prefix in inner)
                # A linear-attention mixer's q/k/v (OLMo-hybrid's) count its own heads, not the config's.
                and not any(name.startswith(f"{mixer}.") for mixer in plan.recurrent_mixers)
            )
        )

    if sharded(_QUERY_PROJECTIONS) and heads % tp_size:
        good = [d for d in range(1, heads + 1) if heads % d == 0]
        raise ValueError(
            f"{model_name}: num_attention_heads={heads} not divisible by tp_size={tp_size}, so the attention heads "
            f"cannot be split evenly over the TP ranks (Transformers would load it and fail in the first forward). "
            f"Use a tp_size that divides the query heads: one of {good}."
        )
    if not sharded(_KV_PROJECTIONS):
        return {}

    def both(query_heads: int, kv: int) -> list[int]:
        return [d for d in range(1, query_heads + 1) if query_heads % d == 0 and kv % d == 0]

    fused = sharded(_FUSED_PROJECTIONS)
    if (fused and kv_heads % tp_size) or (kv_heads % tp_size and heads % kv_heads):
        why = (
            f"{fused[0]} packs the KV heads with the query heads, and KV-head replication needs separate K/V "
            "projections"
            if fused
            else f"num_attention_heads={heads} is not a multiple of num_key_value_heads={kv_heads}"
        )
        raise ValueError(
            f"{model_name}: num_key_value_heads={kv_heads} not divisible by tp_size={tp_size}, and the KV heads "
            f"cannot be replicated: {why}. Use a tp_size that divides both head counts: one of "
            f"{both(heads, kv_heads)}."
        )
    modules = dict(model.named_modules())
    replicated: dict[str, tuple[int, int]] = {}
    for name in sharded(_SEPARATE_KV_PROJECTIONS):
        if name not in modules:
            continue
        if name not in styles:  # split by parameter entries only: the style applies to the module
            styles[name] = styles.get(f"{name}.weight", "colwise")
        attention = name.rpartition(".")[0]
        owner = modules[attention]
        # Layers may differ from the config (sliding-window layers with more KV heads, heads per layer).
        layer_heads, layer_kv = _attention_heads(modules, attention, default=(heads, kv_heads))
        if layer_kv % tp_size == 0:
            continue
        sizes = both(layer_heads, layer_kv)
        projection = modules[name]
        base = projection.get_base_layer() if hasattr(projection, "get_base_layer") else projection
        weight = getattr(base, "weight", None)
        if layer_heads % tp_size or layer_heads % layer_kv:
            raise ValueError(
                f"{model_name}: {attention} has {layer_heads} query heads and {layer_kv} KV heads: tp_size={tp_size} "
                f"can split neither evenly. Use a tp_size that divides both head counts: one of {sizes}."
            )
        if styles[name] != "colwise" or not isinstance(base, nn.Linear) or weight.shape[0] % layer_kv:
            raise ValueError(
                f"{model_name}: num_key_value_heads={layer_kv} not divisible by tp_size={tp_size}, and "
                f"{name} ({type(base).__name__}, style {styles[name]!r}) is not an nn.Linear with 'colwise' whose "
                f"output holds {layer_kv} KV heads, so its KV heads cannot be replicated. Use a tp_size that divides "
                f"both head counts: one of {sizes}, or give {name} your own style in `tp_plan`."
            )
        for key in [name, *(f"{name}.{p}" for p in ("weight", "bias"))]:
            if styles.get(key) == "colwise":
                styles[key] = "colwise_kv_heads"
        tells_groups = isinstance(getattr(owner, KV_GROUPS_ATTRIBUTE, None), int) or (
            attention in plan.head_styles
            and any(isinstance(getattr(owner, a, None), int) for a in KV_HEAD_COUNT_ATTRIBUTES)
        )
        if not tells_groups:
            raise ValueError(
                f"{model_name}: num_key_value_heads={layer_kv} not divisible by tp_size={tp_size}, and its attention "
                f"module {attention} ({type(owner).__name__}) keeps no `{KV_GROUPS_ATTRIBUTE}` to be told each rank's "
                f"grouping, so its KV heads cannot be replicated. Use a tp_size that divides both head counts: one "
                f"of {sizes}."
            )
        replicated[attention] = (layer_heads, layer_kv)
    for attention in replicated:
        # The attention is told one grouping for both K and V: a gathered or whole sibling would give it all heads.
        for leaf in _SEPARATE_KV_PROJECTIONS:
            sibling = f"{attention}.{leaf}"
            if sibling in modules and styles.get(sibling) != "colwise_kv_heads":
                raise ValueError(
                    f"{model_name}: num_key_value_heads={replicated[attention][1]} not divisible by "
                    f"tp_size={tp_size}: the KV heads of {attention} are replicated for its other K/V projection, "
                    f"but {sibling} has style {styles.get(sibling)!r}. Give its K and V projections the same style "
                    f"('colwise'), or use a tp_size that divides both head counts: one of "
                    f"{both(*replicated[attention])}."
                )
    return replicated


def _attention_heads(modules: Mapping[str, nn.Module], attention: str, *, default: tuple[int, int]) -> tuple[int, int]:
    """An attention module's own (query heads, KV heads), where it keeps ``head_dim`` and ``num_key_value_groups``
    (layers may differ from the config): its key projection's width over ``head_dim``, and that times the grouping
    (the key projection, not the query one: a gated query projection is twice as wide); else ``default``."""
    owner = modules[attention]
    head_dim, groups = getattr(owner, "head_dim", None), getattr(owner, KV_GROUPS_ATTRIBUTE, None)
    key = next((modules[f"{attention}.{leaf}"] for leaf in ("k_proj", "key") if f"{attention}.{leaf}" in modules), None)
    if key is not None and hasattr(key, "get_base_layer"):
        key = key.get_base_layer()
    width = getattr(getattr(key, "weight", None), "shape", (None,))[0]
    if not all(isinstance(v, int) and v > 0 for v in (head_dim, groups, width)) or width % head_dim:
        return default
    return width // head_dim * groups, width // head_dim


def uneven_kv_projections(module: nn.Module, plan: ResolvedPlan, tp_size: int) -> list[str]:
    """The ``colwise_kv_heads`` projections whose width (KV heads x head_dim) the TP size does not divide: their
    shards are uneven (some may be empty), which TP alone handles and FSDP2 on top does not."""
    modules = dict(module.named_modules())
    return [
        name
        for name, style in plan.styles.items()
        if style == "colwise_kv_heads"
        and name in modules
        and isinstance(weight := getattr(modules[name], "weight", None), torch.Tensor)
        and weight.shape[0] % tp_size
    ]


def uneven_kv_problem(module: nn.Module, plan: ResolvedPlan, tp_size: int, *, fsdp: bool, shards: int) -> str | None:
    """Why FSDP2 (``fsdp``: the layout applies it, HSDP's replicas included) cannot shard ``module``'s TP shards
    further over ``shards`` ranks of data and context parallelism (rule ``tp+dp+uneven_kv``: a KV projection
    :func:`uneven_kv_projections` names), or ``None``: the strategy's refusal and the inspector's problem, one
    message."""
    uneven = uneven_kv_projections(module, plan, tp_size) if fsdp else []
    if not uneven:
        return None
    width = module.get_submodule(uneven[0]).weight.shape[0]
    return problem(
        "tp+dp+uneven_kv",
        f"{type(module).__name__}: the KV heads of {uneven[0]} are replicated over tp_size={tp_size}, and its width "
        f"({width}: KV heads x head_dim) is not divisible by it, with FSDP2 over {shards} rank(s) of data and "
        "context parallelism",
    )


def _check_head_counts(owner: str, config: Any, styles: Mapping[str, Style], tp_size: int) -> None:
    """The heads of a model inside a composite one (a vision tower) that its plan entries split must divide by the
    TP size (no KV-head replication there)."""
    heads = next(
        (v for a in ("num_attention_heads", "num_heads") if isinstance(v := config_value(config, a), int)), None
    )
    kv_heads = config_value(config, "num_key_value_heads") or heads
    if not isinstance(heads, int):
        return

    def shards(projections: tuple[str, ...]) -> bool:
        return any(name.rsplit(".", 1)[-1] in projections and style in _COLUMN_STYLES for name, style in styles.items())

    shards_kv = shards(_KV_PROJECTIONS)
    problems = []
    if shards(_QUERY_PROJECTIONS) and heads % tp_size:
        problems.append(f"num_attention_heads={heads}")
    if shards_kv and isinstance(kv_heads, int) and kv_heads % tp_size:
        problems.append(f"num_key_value_heads={kv_heads}")
    if problems:
        counts = [heads] + ([kv_heads] if shards_kv and isinstance(kv_heads, int) else [])
        good = [d for d in range(1, max(counts) + 1) if all(c % d == 0 for c in counts)]
        raise ValueError(
            f"{owner}: {' and '.join(problems)} not divisible by tp_size={tp_size}, so the attention "
            f"heads cannot be split evenly over the TP ranks (Transformers would load it and fail in the first "
            f"forward). Use a tp_size that divides every sharded head count: one of {good}, or leave that model's "
            "attention out of the plan."
        )


__all__ = [
    "check_local_heads",
    "replicate_kv_heads",
    "uneven_kv_problem",
    "uneven_kv_projections",
]
