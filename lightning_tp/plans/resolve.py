"""Tensor-parallel plans as data: read a model's plan, merge overrides, expand wildcards, validate, all before any
weight moves and without any collective, so every rank raises the same error instead of hanging.

A plan maps a module (or parameter) path to a style. Keys use Transformers' convention: ``*`` stands for one path
component (``model.layers.*.mlp.up_proj``). Values are Transformers' registered style names (``"colwise"``,
``"rowwise"``, ...) or, for any module, a ``torch.distributed.tensor.parallel.ParallelStyle`` instance.
"""

from __future__ import annotations

import importlib.util
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields, replace
from typing import Any

import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from torch import nn
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import ParallelStyle

from lightning_tp.compat import config_value, layer_configs
from lightning_tp.plans.derived import derive_plan, vocabulary_plan
from lightning_tp.plans.mixers import (
    ATTENTION_KINDS,
    EXPERTS_KINDS,
    OUTPUT_GATES,
    MixerKind,
    SplitMixer,
    config_heads,
    find_mixers,
    heads_problem,
    mixer_entries,
    per_head_norms,
    rotary_width,
    shared_norm_names,
    split_mixer,
    stacked_sizes,
)
from lightning_tp.plans.styles import (
    HEAD_COUNT_ATTRIBUTES,
    KV_GROUPS_ATTRIBUTE,
    KV_HEAD_COUNT_ATTRIBUTES,
    REFUSED_STYLES,
    SUPPORTED_STYLES,
    canonical,
    facts,
    style_names,
)

Style = str | ParallelStyle

#: Styles whose gradient sum over the TP group comes with the whole parameters (``replicated_with_grad_allreduce``).
_SUMMED_HERE = style_names(sums_gradients=True)
#: Styles that give an attention module its rank's head counts.
_HEAD_STYLES = style_names(kind="heads")

#: Output projections whose width counts attention heads (query) and KV heads (key/value).
_FUSED_PROJECTIONS = ("qkv_proj", "query_key_value", "c_attn", "Wqkv")
_QUERY_PROJECTIONS = ("q_proj", "query", *_FUSED_PROJECTIONS)
_SEPARATE_KV_PROJECTIONS = ("k_proj", "v_proj", "key", "value")
_KV_PROJECTIONS = (*_SEPARATE_KV_PROJECTIONS, "qkv_proj", "query_key_value")
#: Where activation function classes live: an activation module is applied to an MLP's (sharded) features.
_ACTIVATION_MODULES = ("transformers.activations", "torch.nn.modules.activation")
#: Styles whose output holds each rank's slice of the features (heads): a head count must divide by the TP size.
_COLUMN_STYLES = style_names(output_sharded=True)


@dataclass
class ResolvedPlan:
    """A plan with concrete names, checked against one module.

    ``styles`` maps each module or parameter path (relative to the module the plan was resolved on) to its style.
    ``grad_allreduce`` lists modules whose replicated parameters get their gradient summed over the TP group.
    ``tied`` maps each tied parameter alias to the name that holds the parameter.
    ``head_styles`` maps each attention module given a ``heads`` style (``local_heads``...) to it: kept apart from
    ``styles`` because it changes the module's head counts only, so the module may take a layer style too (the
    region input of the dense-layer rewrite or of sequence parallelism).
    """

    styles: dict[str, Style] = field(default_factory=dict)
    grad_allreduce: list[str] = field(default_factory=list)
    tied: dict[str, str] = field(default_factory=dict)
    head_styles: dict[str, str] = field(default_factory=dict)
    #: Attention modules whose K/V projections replicate KV heads (``colwise_kv_heads``): name -> (query heads, KV
    #: heads) of the whole model.
    kv_replicated: dict[str, tuple[int, int]] = field(default_factory=dict)
    #: Expert parallelism (``ep_size > 1``): the experts modules and their stacked weights, name -> expert-parallel
    #: style (weights first). TP leaves everything under these modules whole; see
    # :mod:`lightning_tp.parallel.expert_parallel`.
    experts: dict[str, str] = field(default_factory=dict)
    #: Head-parallel sequence mixers (:mod:`lightning_tp.plans.mixers`): name -> its kind and the sizes read from it
    #: before its head counts change (its ``local_heads`` in ``head_styles``). The mixers' packed blocks, split dims,
    #: buffers, local sizes and norms across ranks are derived from it (the properties below).
    mixers: dict[str, SplitMixer] = field(default_factory=dict)
    #: Mixers (attention, MLPs) this package would split but keeps whole at this TP size: name -> why.
    whole_mixers: dict[str, str] = field(default_factory=dict)

    def restricted_to(self, module: nn.Module) -> ResolvedPlan:
        """This plan without the entries of modules and tensors that ``module`` (the one it was resolved on) no
        longer holds: a rank of a pipeline keeps its stages' modules only. A tie whose two ends are not both held (an
        embedding tied to the head across stages) is no tie on this rank: each end's rank keeps its own copy."""
        present = {name for name, _ in module.named_modules()}
        present |= {name for name, _ in module.named_parameters(remove_duplicate=False)}
        present |= {name for name, _ in module.named_buffers(remove_duplicate=False)}
        changes: dict[str, Any] = {}
        for entry in fields(self):
            value = getattr(self, entry.name)
            if entry.name == "tied":
                changes[entry.name] = {a: s for a, s in value.items() if a in present and s in present}
            elif isinstance(value, dict):
                changes[entry.name] = {name: v for name, v in value.items() if name in present}
            elif isinstance(value, list):
                changes[entry.name] = [name for name in value if name in present]
        return replace(self, **changes)

    @property
    def expert_modules(self) -> list[str]:
        """The experts modules split over the EP ranks."""
        return [name for name, style in self.experts.items() if facts(style).kind != "expert"]

    def kv_heads_of(self, name: str) -> tuple[int, int]:
        """The (query heads, KV heads) of the attention module holding ``name`` (a K/V projection or its adapter)."""
        owners = [a for a in self.kv_replicated if name.startswith(f"{a}.")]
        assert owners, f"{name} is under no KV-replicated attention module"
        return self.kv_replicated[max(owners, key=len)]

    @property
    def alibi_heads(self) -> list[str]:
        """Attention modules whose ALiBi input is sliced to the rank's heads (``local_heads_alibi``)."""
        return [name for name, style in self.head_styles.items() if style == "local_heads_alibi"]

    def head_attributes(self, name: str) -> tuple[str, ...]:
        """The attributes of the ``local_heads`` module ``name`` that count heads (or sizes made of heads): a mixer's
        size attributes divided by the TP size, else the attention head counts."""
        return self.mixers[name].kind.attributes if name in self.mixers else HEAD_COUNT_ATTRIBUTES

    def _per_mixer(self, part: Callable[[SplitMixer], Mapping[str, Any]]) -> dict[str, Any]:
        """The full paths and values of ``part`` of every split mixer (relative paths there)."""
        return {
            f"{name}.{path}" if name else path: value
            for name, mixer in self.mixers.items()
            for path, value in part(mixer).items()
        }

    @property
    def blocks(self) -> dict[str, tuple[int, ...]]:
        """Parameters whose dim 0 packs blocks each rank takes its slice of (``colwise_blocks``/``local_blocks``):
        full name -> the whole block sizes. One-block parameters are absent (their plain shard is the rank's rows)."""
        return self._per_mixer(lambda mixer: mixer.blocks)

    @property
    def whole_blocks(self) -> dict[str, tuple[int, ...]]:
        """Parameters of ``blocks`` with blocks every rank takes whole (a multi-query attention's K and V): full name
        -> their indices."""
        return self._per_mixer(lambda mixer: mixer.whole_blocks)

    @property
    def block_dims(self) -> dict[str, int]:
        """``local_blocks`` parameters split on another dim than 0: full name -> dim."""
        return self._per_mixer(lambda mixer: mixer.dims)

    @property
    def buffer_blocks(self) -> dict[str, tuple[int, tuple[int, ...], tuple[int, ...]]]:
        """The mixers' packed buffers, sliced once: full name -> (dim, whole block sizes, blocks taken whole)."""
        return self._per_mixer(lambda mixer: mixer.buffers)

    def mixer_sizes(self, tp_size: int) -> dict[str, dict[str, int]]:
        """Mixer attributes set to the rank's own size at ``tp_size`` rather than divided: mixer -> {attribute:
        value}."""
        return {name: mixer.local_sizes(tp_size) for name, mixer in self.mixers.items() if mixer.kind.local_sizes}

    @property
    def recurrent_mixers(self) -> list[str]:
        """The split mixers that are not attention (linear attention, state-space layers): their heads are their
        own."""
        return [name for name, mixer in self.mixers.items() if mixer.recurrent]

    @property
    def norms_across_ranks(self) -> dict[str, int]:
        """Gated norms over one group spread over every TP rank: name -> the group's whole width."""
        return {
            f"{name}.{mixer.kind.norm_across_ranks}": mixer.norm_width
            for name, mixer in self.mixers.items()
            if mixer.norm_width is not None
        }

    @property
    def local_heads(self) -> list[str]:
        """Attention modules whose head counts become the rank's own (``local_heads``)."""
        return list(self.head_styles)

    @property
    def torch_styles(self) -> dict[str, ParallelStyle]:
        """The entries applied with ``torch.distributed.tensor.parallel.parallelize_module``."""
        return {name: style for name, style in self.styles.items() if isinstance(style, ParallelStyle)}


def is_transformers_model(module: nn.Module) -> bool:
    try:
        from transformers import PreTrainedModel
    except ImportError:  # pragma: no cover - transformers is a dependency
        return False
    return isinstance(module, PreTrainedModel)


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


def key_regex(key: str) -> re.Pattern[str]:
    """A plan key as a pattern over module/parameter paths: ``*`` stands for one path component."""
    return re.compile(r"\.".join("[^.]+" if part == "*" else re.escape(part) for part in key.split(".")))


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


def model_plan(module: nn.Module) -> dict[str, Style]:
    """The module's own plan: a Transformers model's ``tp_plan`` (config ``base_model_tp_plan`` plus class rules such
    as ``lm_head``), or, when its config has none, the plan derived from its decoder structure
    (:mod:`lightning_tp.plans.derived`; empty when the structure is not recognised), or nothing for any other module."""
    return plan_source(module)[0]


def plan_source(module: nn.Module) -> tuple[dict[str, Style], str, str | None]:
    """The module's own plan, where it comes from (``"model"``, ``"derived"``, or ``"none"``) and, when there is none,
    why (the structure a derived plan could not understand, and how to write the plan)."""
    if not is_transformers_model(module):
        return {}, "none", None
    own = dict(getattr(module, "tp_plan", None) or {})
    if set(own) - {_output_embedding_name(module)}:
        return own, "model", None
    try:
        return derive_plan(module), "derived", None
    except ValueError as err:
        # A class rule for lm_head alone (no `base_model_tp_plan`) is kept as it was before plans were derived.
        if own:
            return own, "model", None
        # Layers no derived rule describes stay whole (the mixers of lightning_tp.plans.mixers are split on their
        # own); the vocabulary is split, where there is one.
        vocabulary = vocabulary_plan(module)
        if vocabulary and _has_layers(module):
            rank_zero_info(f"{type(module).__name__}: its decoder layers stay whole on every TP rank ({err})")
            return vocabulary, "derived", None
        return {}, "none", str(err)


def kept_whole(module: nn.Module, plan: ResolvedPlan, *, leave: tuple[str, ...] = ()) -> dict[str, tuple[int, float]]:
    """The kinds of modules whose matrices no rule of ``plan`` splits (every TP rank holds and computes all of them):
    kind (the class of the nearest module above them that is not one of torch's building blocks) -> (matrices, share
    of the parameter elements), largest first. Norms and biases (1-D) are left out: they are whole by design; LoRA
    adapters too; and the experts of expert parallelism (``plan.experts``, or the ``leave`` keys of
    :func:`resolve_plan`: split over the EP ranks)."""
    total = sum(p.numel() for p in module.parameters())
    kept: dict[str, list[int]] = {}
    splits = {name for name, style in plan.styles.items() if _split_style(style)}
    experts = tuple(f"{name}." for name in plan.experts)
    for name, param in module.named_parameters():
        owners = [name.rsplit(".", k)[0] for k in range(1, name.count(".") + 1)]
        if param.ndim < 2 or name in splits or any(o in splits for o in owners) or ".lora_" in name:
            continue  # split, under a split module (a LoRA wrapper's base layer), or an adapter (small, by design)
        if (experts and name.startswith(experts)) or any(key_regex(k).fullmatch(o) for k in leave for o in owners):
            continue
        counts = kept.setdefault(_layer_kind(module, name), [0, 0])
        counts[0] += 1
        counts[1] += param.numel()
    ordered = sorted(kept.items(), key=lambda item: -item[1][1])
    return {kind: (k, n / total) for kind, (k, n) in ordered if total}


def _report_whole_modules(module: nn.Module, plan: ResolvedPlan, *, leave: tuple[str, ...] = ()) -> None:
    """One info line naming the layer kinds TP keeps whole (:func:`kept_whole`) with 1% of the parameters or more."""
    listed = ", ".join(
        f"{kind} ({100 * share:.0f}% in {k} matrices)"
        for kind, (k, share) in kept_whole(module, plan, leave=leave).items()
        if share >= 0.01
    )
    if listed:
        rank_zero_info(f"{type(module).__name__}: TP keeps these whole on every rank (no rule splits them): {listed}.")


def _layer_kind(module: nn.Module, param: str) -> str:
    """The class of the nearest module above ``param`` that is not one of torch's building blocks (a mixer, an MLP,
    an attention), which names the layer kind better than its ``Linear``."""
    path = param.rpartition(".")[0]
    while True:
        owner = module.get_submodule(path) if path else module
        if not type(owner).__module__.startswith("torch.") or not path:
            return type(owner).__name__
        path = path.rpartition(".")[0]


def _split_style(style: Style | None) -> bool:
    """Whether a style splits the parameters it is given (a torch ParallelStyle is taken to)."""
    if style is None:
        return False
    fact = facts(style)
    return fact is None or fact.weight_dim is not None or fact.kind in ("module", "expert")


def _has_layers(model: nn.Module) -> bool:
    """Whether the model holds a list of layers (a decoder, recurrent or not), as a causal LM does."""
    return any(isinstance(m, nn.ModuleList) and len(m) for m in model.modules())


def _output_embedding_name(model: nn.Module) -> str | None:
    out = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    return next((name for name, m in model.named_modules() if m is out), None) if out is not None else None


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

    mixers, whole_mixers = _head_parallel_mixers(module, overrides, plan, tp_size=tp_size, leave=leave)
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
        if style in _SUMMED_HERE and name in module_names and _sees_sharded_features(name, resolved.styles)
    ]
    resolved.grad_allreduce += _between_split_projections(module, resolved.styles)
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
                    f"blocks of {list(sizes)}: its layout is not the one lightning_tp.plans.mixers describes. Keep it "
                    f"whole with tp_plan={{'{name}': 'replicate'}}, or write its plan."
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
    resolved.tied = _tied_aliases(module, param_styles)
    if is_transformers_model(module):
        resolved.kv_replicated = _replicate_kv_heads(module, resolved, tp_size)
    _check_even_splits(module, resolved.styles, tp_size)
    if tp_size > 1:
        _report_whole_modules(module, resolved, leave=leave)
    attention = [name for name in resolved.local_heads if name not in resolved.mixers]
    _check_local_heads(module, attention, tp_size, kv_replicated=resolved.kv_replicated)
    return resolved


def _head_parallel_mixers(
    module: nn.Module,
    overrides: Mapping[str, Style],
    plan: Mapping[str, Style],
    *,
    tp_size: int,
    leave: tuple[str, ...] = (),
) -> tuple[dict[str, tuple[nn.Module, MixerKind]], dict[str, str]]:
    """The sequence mixers split by heads: every one :mod:`lightning_tp.plans.mixers` knows, but those the user's
    ``tp_plan`` places itself (a key naming the mixer or something inside it), those at or under a ``leave`` key
    (another parallelism places them: expert parallelism's experts), and attention, MLPs and experts that the model's
    plan already covers. Also the mixers whose heads ``tp_size`` does not divide: kept whole (their derived or
    gathered rules would not fit), said in one info line."""
    already_sharded = any(isinstance(p, DTensor) for p in module.parameters())
    if tp_size == 1 or not is_transformers_model(module) or already_sharded:
        # A model Transformers sharded at load time keeps its plan's placements (gathered mixers included).
        return {}, {}
    found = {}
    whole: dict[str, list[str]] = {}
    for name, kind in find_mixers(module).items():
        mixer = module.get_submodule(name)
        paths = [name] + [f"{name}.{inner}" for inner, _ in mixer.named_modules() if inner]
        paths += [f"{name}.{inner}" for inner, _ in mixer.named_parameters()]
        if any(key_regex(key).fullmatch(path) for key in overrides for path in paths):
            continue
        owners = [name.rsplit(".", k)[0] for k in range(name.count(".") + 1)]
        if any(key_regex(key).fullmatch(owner) for key in leave for owner in owners):
            continue
        if kind.complete_only:
            # Only the text decoder's: a vision or audio tower that the plan leaves whole stays whole.
            if not _in_decoder(module, name) or any(key_regex(key).fullmatch(p) for key in plan for p in paths):
                continue
            if kind in EXPERTS_KINDS:
                problem = _experts_problem(mixer, kind)
            else:
                check = _attention_problem if kind in ATTENTION_KINDS else _mlp_problem
                problem = check(module, mixer, kind, tp_size)
        else:
            problem = heads_problem(name, mixer, kind, tp_size)
            if problem is None and kind.fused_kernel and importlib.util.find_spec(kind.fused_kernel) is not None:
                raise ValueError(
                    f"{name} ({type(mixer).__name__}) would be split by heads, but `{kind.fused_kernel}` is "
                    f"installed: in training Transformers then runs this mixer through its fused kernel, which reads "
                    f"`out_proj` and the norm itself and would skip the TP sums. Uninstall `{kind.fused_kernel}` for "
                    f"TP training, or keep the mixers whole with tp_plan={{'{name}': 'replicate', ...}}."
                )
        if problem is None and "mla_kv_a_proj" in kind.styles.values() and rotary_width(mixer) is None:
            problem = f"{type(mixer).__name__} keeps no `qk_rope_head_dim` (its rotary key width), nor does its config"
        if problem is not None:
            whole.setdefault(problem, []).append(name)
            continue
        found[name] = (mixer, kind)
    for problem, names in whole.items():
        rank_zero_info(f"{len(names)} sequence mixers ({names[0]}, ...) stay whole on every TP rank: {problem}.")
    return found, {name: problem for problem, names in whole.items() for name in names}


def _in_decoder(model: nn.Module, name: str) -> bool:
    """Whether the module at ``name`` sits in the model's text decoder (``get_decoder()``; the whole model when it
    names none)."""
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else None
    if not isinstance(decoder, nn.Module) or decoder is model:
        return True
    path = next((n for n, m in model.named_modules() if m is decoder), None)
    return path is None or name.startswith(f"{path}.")


def _mlp_problem(model: nn.Module, mlp: nn.Module, kind: MixerKind, tp_size: int) -> str | None:
    """Why an MLP the model's plan leaves whole cannot be split at ``tp_size``, or ``None``: its column-wise
    projections' intermediate sizes (of each packed half, for a packed gate|up) must be equal and divide by it."""
    ups = []
    for name, style in kind.styles.items():
        fact = facts(style)
        if fact.kind != "column":
            continue
        projection = mlp.get_submodule(name)
        if fact.strided and hasattr(projection, "get_base_layer"):
            return (
                f"{type(mlp).__name__}'s {name} is a LoRA layer, whose adapters cannot follow its packed halves "
                f"({style!r})"
            )
        weight = projection.weight
        rows = weight.shape[fact.split_dim(weight.ndim)]  # [.., out, in]: stacked experts' too
        ups.append(rows // fact.blocks if rows % fact.blocks == 0 else rows / fact.blocks)
    if ups[0] % tp_size or len(set(ups)) != 1:
        return f"{type(mlp).__name__}'s intermediate sizes {ups} do not split over tp_size={tp_size}"
    known = set(kind.styles) | set(kind.whole)
    unknown = [
        name
        for name, m in mlp.named_modules()
        if name and not any(name == k or name.startswith(f"{k}.") for k in known) and list(m.parameters(False))
    ]
    unknown += [name for name, _ in mlp.named_parameters(recurse=False) if name not in known]
    if unknown:
        return f"{type(mlp).__name__} also holds {unknown}, which no rule of an MLP splits"
    return None


def _experts_problem(experts: nn.Module, kind: MixerKind) -> str | None:
    """Why a mixture-of-experts experts module the model's plan leaves whole cannot be split as its kind says
    (:data:`lightning_tp.plans.mixers.EXPERTS_KINDS`), or ``None``: its stacked weights must have the kind's layout
    and be all it holds. Whatever the TP size: one that does not divide the experts' intermediate features is refused
    by the even-split check, naming the sizes that work, as the expert rules of a model's plan are (kept whole, the
    experts, most of the model, would be on every rank)."""
    name = type(experts).__name__
    if stacked_sizes(experts, kind) is None:
        shapes = {path: list(getattr(experts, path).shape) for path in kind.stacked}
        return f"{name}'s stacked weights {shapes} are not laid out as {kind.description}"
    unknown = [path for path, _ in experts.named_parameters() if path not in kind.stacked]
    if unknown:
        return f"{name} also holds {unknown}, which no rule of stacked experts splits"
    return None


def _attention_problem(model: nn.Module, attention: nn.Module, kind: MixerKind, tp_size: int) -> str | None:
    """Why an attention module the model's plan leaves whole cannot be split by heads at ``tp_size``, or ``None``.
    Its head counts are the config's (most attention modules reshape by ``-1`` and keep none); KV heads the TP size
    does not divide are replicated (:mod:`lightning_tp.parallel.kv_heads`) where the query heads group evenly."""
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    heads = config_value(config, "num_attention_heads")
    kv_heads = config_value(config, "num_key_value_heads") or heads
    if not isinstance(heads, int) or not isinstance(kv_heads, int):
        return f"{type(attention).__name__} has no head counts in its config"
    if heads % tp_size or (kv_heads % tp_size and heads % kv_heads):
        name = type(attention).__name__
        return f"{name} has {heads} query and {kv_heads} KV heads: tp_size={tp_size} cannot split them"
    if config_heads(attention) != heads:
        return f"{type(attention).__name__} keeps no config with its head count"
    uneven = {
        a: getattr(attention, a)
        for a in HEAD_COUNT_ATTRIBUTES
        if isinstance(getattr(attention, a, None), int)
        and getattr(attention, a) % tp_size
        and not (a in KV_HEAD_COUNT_ATTRIBUTES and heads % kv_heads == 0)  # KV heads replicated
    }
    if uneven:
        return f"{type(attention).__name__} keeps head counts {uneven} that tp_size={tp_size} does not divide"
    out = attention.q_proj.weight.shape[0]
    if out % heads:
        return f"{type(attention).__name__}'s q_proj has {out} features for {heads} heads"
    for gate in OUTPUT_GATES:
        width = getattr(getattr(getattr(attention, gate, None), "weight", None), "shape", (None,))[0]
        if width is not None and width not in (out, heads):
            return f"{type(attention).__name__}'s {gate} has {width} features: neither one per head nor per q feature"
    # Everything else it holds must be known: a per-head norm (kept whole, its gradient summed) or a rule of the
    # kind. Anything more (a differential attention's lambdas, a short convolution) keeps it whole.
    known = set(per_head_norms(attention, out // heads)) | set(kind.styles)
    unknown = [
        name
        for name, m in attention.named_modules()
        if name and not any(name == k or name.startswith(f"{k}.") for k in known) and list(m.parameters(False))
    ]
    unknown += [name for name, _ in attention.named_parameters(recurse=False) if name not in known]
    if unknown:
        return f"{type(attention).__name__} also holds {unknown}, which no rule of plain attention splits"
    return None


def no_plan(module: nn.Module) -> ResolvedPlan:
    """The plan of TP over one rank, which splits nothing: no rules (the model's own, which may be refused or missing,
    are not applied), its tied weights found as :func:`resolve_plan` finds them."""
    params = {name: None for name, _ in module.named_parameters(remove_duplicate=False)}
    return ResolvedPlan(tied=_tied_aliases(module, params))


def _check_local_heads(
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


def _check_even_splits(module: nn.Module, styles: Mapping[str, Style], tp_size: int) -> None:
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


def _between_split_projections(module: nn.Module, styles: Mapping[str, Style]) -> list[str]:
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


def _sees_sharded_features(norm: str, styles: Mapping[str, Style]) -> bool:
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


def _tied_aliases(module: nn.Module, param_styles: Mapping[str, Style | None]) -> dict[str, str]:
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


def _replicate_kv_heads(model: nn.Module, plan: ResolvedPlan, tp_size: int) -> dict[str, tuple[int, int]]:
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
