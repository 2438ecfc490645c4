"""Tensor-parallel plans resolved: a model's own plan (:mod:`lightning_tp.plans.source`) merged with the user's
overrides, its wildcards expanded to concrete names, the sequence mixers split by heads added
(:mod:`lightning_tp.plans.mixer_choice`) and the checks run (:mod:`lightning_tp.plans.checks`,
:mod:`lightning_tp.plans.heads`), all before any weight moves and without any collective, so every rank raises the
same error instead of hanging. The result is a :class:`~lightning_tp.plans.resolved.ResolvedPlan`.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from torch import nn

from lightning_tp.plans.checks import (
    between_split_projections,
    check_even_splits,
    check_style,
    sees_sharded_features,
    tied_aliases,
)
from lightning_tp.plans.coverage import report_whole_modules
from lightning_tp.plans.heads import check_local_heads, replicate_kv_heads
from lightning_tp.plans.mixer_choice import head_parallel_mixers
from lightning_tp.plans.mixers import mixer_entries, rotary_width, shared_norm_names, split_mixer
from lightning_tp.plans.resolved import ResolvedPlan, Style
from lightning_tp.plans.source import is_transformers_model, key_regex, plan_source
from lightning_tp.plans.styles import REFUSED_STYLES, canonical, style_names

#: Styles whose gradient sum over the TP group comes with the whole parameters (``replicated_with_grad_allreduce``).
_SUMMED_HERE = style_names(sums_gradients=True)
#: Styles that give an attention module its rank's head counts.
_HEAD_STYLES = style_names(kind="heads")


def _match(name: str, patterns: list[tuple[str, re.Pattern[str], Style, bool]]) -> Style | None:
    """The style of the key that matches ``name`` whole: a user override before the model's own rule, then the most
    specific key (fewest wildcards)."""
    best: tuple[tuple[bool, int], Style] | None = None
    for key, regex, style, is_override in patterns:
        if regex.fullmatch(name):
            rank = (is_override, -key.count("*"))
            if best is None or rank > best[0]:
                best = (rank, style)
    return None if best is None else best[1]


def resolve_plan(
    module: nn.Module, tp_plan: str | Mapping[str, Style], *, tp_size: int, leave: tuple[str, ...] = ()
) -> ResolvedPlan:
    """Merge ``tp_plan`` into the module's own plan, expand it to concrete names and check it.

    ``tp_plan="auto"`` uses the module's own plan. A dict overrides it key by key with
    ``DistributedConfig.tp_plan`` semantics: an empty dict means no rules, and a key must match a module or parameter.
    ``leave``: plan keys (module paths with ``*``) whose rules, and those under them, are dropped before the checks:
    another parallelism places those modules (expert parallelism's experts), so their TP styles do not matter.
    """
    model_name = type(module).__name__
    if getattr(module, "hf_device_map", None) is not None:
        raise ValueError(
            f"{model_name} was loaded with a `device_map` ({module.hf_device_map}), which places whole layers on "
            "devices and conflicts with tensor parallelism. Load it without `device_map`: the strategy places the "
            "shards."
        )
    if isinstance(tp_plan, str):
        if tp_plan != "auto":
            raise ValueError(f'`tp_plan` must be "auto" or a dict of module path to style, got {tp_plan!r}.')
        overrides: dict[str, Style] = {}
        plan, _, no_plan_reason = plan_source(module)
    elif isinstance(tp_plan, Mapping):
        overrides = dict(tp_plan)
        own, _, no_plan_reason = plan_source(module) if overrides else ({}, "none", None)
        plan = {**own, **overrides}
    else:
        raise ValueError(f'`tp_plan` must be "auto" or a dict of module path to style, got {type(tp_plan).__name__}.')

    # Another name for the same split is read as that name (Transformers 5.25's `unit_colwise` is `colwise`).
    plan = {key: canonical(style) for key, style in plan.items()}
    if leave:
        under = tuple(f"{k}." for k in leave)
        left = [key for key in plan if key in leave or key.startswith(under)]
        if given := [key for key in left if key in overrides]:
            rank_zero_warn(
                f"`tp_plan` entries {given} are ignored: expert parallelism places those experts (ep_size > 1)."
            )
        plan = {key: style for key, style in plan.items() if key not in left}
    module_names = [name for name, _ in module.named_modules() if name]
    all_params = list(module.named_parameters(remove_duplicate=False))
    params = dict(all_params)
    unique_params = {name for name, _ in module.named_parameters()}
    names = set(module_names) | {name for name, _ in all_params}

    refused = {}
    for key, style in plan.items():
        if not isinstance(key, str) or not key:
            raise ValueError(f"tp_plan keys must be non-empty module paths, got {key!r}.")
        if isinstance(style, str) and style in REFUSED_STYLES:
            # A rule of the model's that matches nothing does nothing (Llama 4's expert rules where every layer is
            # dense; a composite model's plan also lists its text model's rules under a stale prefix).
            if key in overrides or any(key_regex(key).fullmatch(n) for n in names):
                refused[key] = style
        else:
            check_style(key, style)
    if refused:
        reasons = "; ".join(f"{key!r}: {style!r} ({REFUSED_STYLES[style]})" for key, style in refused.items())
        # The rules under a refused module go too: they would split the weights whose partial outputs its style was to
        # sum (Inkling's shared experts under `all_reduce`, as Transformers 5.24 ships them).
        whole = {key: "replicate" for key in plan if any(key == r or key.startswith(f"{r}.") for r in refused)}
        raise ValueError(
            f"{model_name}'s plan uses styles this strategy does not support: {reasons}. To keep those modules whole, "
            f"pass tp_plan={whole}."
        )

    if not plan:
        if no_plan_reason is not None and not overrides:
            raise ValueError(no_plan_reason)
        if is_transformers_model(module):
            raise ValueError(
                f"{model_name} has no tensor-parallel plan (its config has no `base_model_tp_plan`) and `tp_plan` "
                "gives none. Pass `tp_plan={'model.layers.*.self_attn.q_proj': 'colwise', ...}` to "
                "TensorParallelStrategy, or use tp_size=1."
            )
        raise ValueError(
            f"{model_name} is not a Transformers model, so it has no plan of its own: pass "
            "`tp_plan={'<module path>': 'colwise' | 'rowwise' | <ParallelStyle>, ...}` to TensorParallelStrategy."
        )

    mixers, whole_mixers = head_parallel_mixers(module, overrides, plan, tp_size=tp_size, leave=leave)
    mixer_styles = {
        key: style for name, (mixer, kind) in mixers.items() for key, style in mixer_entries(name, mixer, kind).items()
    }
    # A mixer that cannot be split is kept whole: every module under it that holds parameters is replicated.
    mixer_styles.update(
        {
            f"{name}.{inner}" if inner else name: "replicate"
            for name in whole_mixers
            for inner, m in module.get_submodule(name).named_modules()
            if list(m.parameters(recurse=False))
        }
    )
    patterns = [(key, key_regex(key), style, key in overrides) for key, style in plan.items()]
    # A mixer's own entries name concrete paths, so they win over the model's `layers.*` rules (Qwen3.5's gathered
    # projections), and lose to the user's overrides.
    patterns += [(key, key_regex(key), style, False) for key, style in mixer_styles.items()]
    unmatched = [
        key for key, regex, _, is_override in patterns if is_override and not any(regex.fullmatch(n) for n in names)
    ]
    if unmatched:
        raise ValueError(
            f"tp_plan keys {unmatched} match no module or parameter of {model_name}. Keys are paths relative to the "
            f"model with `*` for one component; some of its modules: {module_names[:8]}."
        )

    resolved = ResolvedPlan(whole_mixers=whole_mixers)
    param_styles: dict[str, Style | None] = {}
    for module_name, submodule in module.named_modules():
        module_style = _match(module_name, patterns) if module_name else None
        for param_name, _ in submodule.named_parameters(recurse=False, remove_duplicate=False):
            full = f"{module_name}.{param_name}" if module_name else param_name
            own = _match(full, patterns)
            style = own if own is not None else module_style
            param_styles[full] = style
            # torch ParallelStyles shard their module's parameters themselves; `local_heads` names a module only.
            if isinstance(style, str) and full in unique_params and style not in _HEAD_STYLES:
                resolved.styles[full] = style
        if module_name in mixers and mixers[module_name][1].attributes:  # an MLP has no head counts
            resolved.head_styles[module_name] = "local_heads"
        if isinstance(module_style, str) and module_style in _HEAD_STYLES and module_name not in whole_mixers:
            resolved.head_styles[module_name] = module_style
        elif module_style is not None:
            resolved.styles[module_name] = module_style

    # Stacked expert weights packing gate and up as two halves (`gate_up_proj`, chunked in two by the experts'
    # forward) that a plan splits with plain `colwise` (Inkling's) would give one rank the gates and the other the
    # ups: each rank takes its slice of each half instead.
    packed = [n for n, st in resolved.styles.items() if st == "colwise" and n.endswith(".gate_up_proj") and n in params]
    for name in packed:
        if params[name].ndim == 3:
            resolved.styles[name] = "packed_colwise"
    if packed:
        rank_zero_info(f"{model_name}: {packed[0]} (and {len(packed) - 1} more) split per half (`packed_colwise`).")
    resolved.grad_allreduce = [
        name
        for name, style in resolved.styles.items()
        if style in _SUMMED_HERE and name in module_names and sees_sharded_features(name, resolved.styles)
    ]
    resolved.grad_allreduce += between_split_projections(module, resolved.styles)
    for name, (mixer, kind) in mixers.items():
        # Its per-head norm sees the rank's heads only, whatever the twin-name guess above says (OLMo-hybrid's
        # `o_norm` sits next to a row-wise `o_proj`).
        resolved.grad_allreduce += [
            f"{name}.{norm}" for norm in shared_norm_names(mixer, kind) if f"{name}.{norm}" in resolved.styles
        ]
        resolved.grad_allreduce = list(dict.fromkeys(resolved.grad_allreduce))
        split = split_mixer(mixer, kind)
        for path, sizes in split.blocks.items():
            rows = mixer.get_parameter(path).shape[0]
            if sum(sizes) != rows:
                full = f"{name}.{path}" if name else path
                raise ValueError(
                    f"{full} has {rows} rows where {type(mixer).__name__}, recognised as {kind.description}, packs "
                    f"blocks of {list(sizes)}: its layout is not the one lightning_tp.plans.mixer_kinds describes. "
                    f"Keep it whole with tp_plan={{'{name}': 'replicate'}}, or write its plan."
                )
        resolved.mixers[name] = split
    for name in [n for n, style in resolved.styles.items() if style == "mla_kv_a_proj" and n in module_names]:
        attention = module.get_submodule(name.rpartition(".")[0])
        if rotary_width(attention) is None:
            raise ValueError(
                f"{model_name}: {name} has style 'mla_kv_a_proj', but neither its attention module "
                f"({type(attention).__name__}) nor its config holds `qk_rope_head_dim`, the width of the rotary key "
                f"whose gradient it sums over the TP group. Keep the attention whole with "
                f"tp_plan={{'{name.rpartition('.')[0]}': 'replicate'}}, or set the attribute."
            )
    resolved.tied = tied_aliases(module, param_styles)
    if is_transformers_model(module):
        resolved.kv_replicated = replicate_kv_heads(module, resolved, tp_size)
    check_even_splits(module, resolved.styles, tp_size)
    if tp_size > 1:
        report_whole_modules(module, resolved, leave=leave)
    attention = [name for name in resolved.local_heads if name not in resolved.mixers]
    check_local_heads(module, attention, tp_size, kv_replicated=resolved.kv_replicated)
    return resolved


def no_plan(module: nn.Module) -> ResolvedPlan:
    """The plan of TP over one rank, which splits nothing: no rules (the model's own, which may be refused or missing,
    are not applied), its tied weights found as :func:`resolve_plan` finds them."""
    params = {name: None for name, _ in module.named_parameters(remove_duplicate=False)}
    return ResolvedPlan(tied=tied_aliases(module, params))


__all__ = [
    "no_plan",
    "resolve_plan",
]
