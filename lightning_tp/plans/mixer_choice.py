"""Which sequence mixers a plan splits by heads (the kinds of :mod:`lightning_tp.plans.mixers`), and why the others
stay whole: the user's ``tp_plan`` or another parallelism places them, the model's plan already covers them (attention,
MLPs, experts), the TP size does not divide their heads, or their layout is not the one their kind describes."""

from __future__ import annotations

import importlib.util
from collections.abc import Mapping

from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch import nn
from torch.distributed.tensor import DTensor

from lightning_tp.compat import config_value
from lightning_tp.plans.fallback_kinds import ATTENTION_KINDS, EXPERTS_KINDS, OUTPUT_GATES
from lightning_tp.plans.mixer_kinds import MixerKind
from lightning_tp.plans.mixers import (
    config_heads,
    find_mixers,
    heads_problem,
    per_head_norms,
    rotary_width,
    stacked_sizes,
)
from lightning_tp.plans.resolved import Style
from lightning_tp.plans.source import is_transformers_model, key_regex
from lightning_tp.plans.styles import HEAD_COUNT_ATTRIBUTES, KV_HEAD_COUNT_ATTRIBUTES, facts


def head_parallel_mixers(
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
    (:data:`lightning_tp.plans.fallback_kinds.EXPERTS_KINDS`), or ``None``: its stacked weights must have the kind's
    layout and be all it holds. Whatever the TP size: one that does not divide the experts' intermediate features is
    refused by the even-split check, naming the sizes that work, as the expert rules of a model's plan are (kept
    whole, the experts, most of the model, would be on every rank)."""
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


__all__ = [
    "head_parallel_mixers",
]
