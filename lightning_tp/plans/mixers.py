"""Head-parallel sequence mixers read from a model: which kind each module is (:data:`MIXER_KINDS`: the kinds of
:mod:`lightning_tp.plans.mixer_kinds`, then those of :mod:`lightning_tp.plans.fallback_kinds`), whether the TP size
splits its heads, the plan entries that split it, and what is read from it once, before its head counts change
(:class:`SplitMixer`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

from torch import nn

from lightning_tp.compat import config_value
from lightning_tp.plans.fallback_kinds import ATTENTION_KINDS, FALLBACK_KINDS
from lightning_tp.plans.mixer_kinds import HEAD_MIXER_KINDS, MixerKind

#: Every mixer kind this package splits by heads, in the order :func:`mixer_kind` tries them.
MIXER_KINDS: tuple[MixerKind, ...] = HEAD_MIXER_KINDS + FALLBACK_KINDS


def rotary_width(attention: nn.Module) -> int | None:
    """The rotary key width of a latent attention (``qk_rope_head_dim``): its own attribute (per layer), else its
    config's; ``None`` when neither holds one."""
    width = getattr(attention, "qk_rope_head_dim", None)
    if not isinstance(width, int):
        width = config_value(getattr(attention, "config", None), "qk_rope_head_dim")
    return width if isinstance(width, int) else None


def per_head_norms(attention: nn.Module, head_dim: int) -> list[str]:
    """The children of ``attention`` holding one 1-D ``weight`` of ``head_dim`` features and no other parameter:
    norms applied to each head (Qwen3's ``q_norm``, Hunyuan's ``query_layernorm``), shared by every head."""
    found = []
    for name, child in attention.named_children():
        params = dict(child.named_parameters())
        weight = params.get("weight")
        if weight is not None and weight.ndim == 1 and weight.numel() == head_dim and set(params) <= {"weight", "bias"}:
            found.append(name)
    return found


#: Marks a block every rank takes whole (a multi-query attention's single K/V head): ``"=kv_dim"``.
WHOLE = "="


def _names(expression: str) -> list[str]:
    """The attribute names a block size expression multiplies (``"=n_groups*ssm_state_size"``)."""
    return expression.removeprefix(WHOLE).split("*")


def _size(module: nn.Module, expression: str) -> int:
    return math.prod(int(getattr(module, name)) for name in _names(expression))


def _whole(expressions: tuple[str, ...]) -> tuple[int, ...]:
    return tuple(i for i, e in enumerate(expressions) if e.startswith(WHOLE))


def attribute(module: nn.Module, path: str) -> object:
    """The attribute at ``path`` (``"norm.n_groups"``: a child's), or ``None``."""
    owner, _, name = path.rpartition(".")
    for part in owner.split(".") if owner else ():
        module = getattr(module, part, None)
    return config_value(module, name)


def _has(module: nn.Module, path: str) -> bool:
    owner, _, leaf = path.rpartition(".")
    try:
        holder = module.get_submodule(owner) if owner else module
    except AttributeError:
        return False
    return getattr(holder, leaf, None) is not None


def _base(module: nn.Module) -> nn.Module:
    """A PEFT-wrapped layer's base layer (the plan names the wrapper)."""
    return module.get_base_layer() if hasattr(module, "get_base_layer") and hasattr(module, "base_layer") else module


def _has_param(module: nn.Module, path: str) -> bool:
    owner, _, leaf = path.rpartition(".")
    try:
        holder = _base(module.get_submodule(owner)) if owner else module
    except AttributeError:
        return False
    return isinstance(getattr(holder, leaf, None), nn.Parameter)


def mixer_kind(module: nn.Module) -> MixerKind | None:
    """The kind of ``module``, or ``None`` when it is not a mixer this package splits by heads."""
    for kind in MIXER_KINDS:
        if all(_has_param(module, path) for path in kind.holds) and not any(_has(module, p) for p in kind.lacks):
            buffers = dict(module.named_buffers())
            # A child's attribute (dotted) is divided where the child has it (Falcon-H1's norm may be an Identity).
            required = [a for a in kind.attributes if "." not in a] if not kind.complete_only else []
            if (
                all(isinstance(attribute(module, a), int) for a in required)
                and set(kind.buffers) <= set(buffers)
                and all(attribute(module, a) == value for a, value in kind.requires.items())
            ):
                return kind
    return None


def find_mixers(model: nn.Module) -> dict[str, MixerKind]:
    """Every head-structured mixer of ``model``: path -> kind."""
    return {name: kind for name, m in model.named_modules() if (kind := mixer_kind(m)) is not None}


def heads_problem(name: str, mixer: nn.Module, kind: MixerKind, tp_size: int) -> str | None:
    """Why ``tp_size`` cannot split this mixer's heads, naming the sizes that work; ``None`` when it can."""
    counts = {a: int(attribute(mixer, a)) for a in kind.heads}
    sizes = {a: c for a, c in counts.items() if c % tp_size}
    if not sizes:
        for path, expressions in kind.blocks.items():
            if _has_param(mixer, path):
                uneven = [e for e in expressions if not e.startswith(WHOLE) and _size(mixer, e) % tp_size]
                if uneven:
                    sizes = {e: _size(mixer, e) for e in uneven}
                    break
    if not sizes:
        return None
    works = [t for t in range(2, max(counts.values()) + 1) if all(c % t == 0 for c in counts.values())]
    return (
        f"{type(mixer).__name__} ({kind.description}) has {counts}: tp_size={tp_size} does not divide {sizes}, so "
        f"its heads cannot be split; TP sizes that split it: {works or 'none above 1'}"
    )


def mixer_entries(name: str, mixer: nn.Module, kind: MixerKind) -> dict[str, str]:
    """The plan entries (full paths) that split the mixer at ``name`` by heads."""
    prefix = f"{name}." if name else ""
    entries = {}
    for path, style in kind.styles.items():
        if not path:
            entries[name] = style
        elif _has(mixer, path):
            entries[prefix + path] = style
    for norm in shared_norm_names(mixer, kind):
        entries[prefix + norm] = "replicated_with_grad_allreduce"
    return entries


def stacked_sizes(mixer: nn.Module, kind: MixerKind) -> dict[str, int] | None:
    """The sizes :attr:`MixerKind.stacked` names, read from the shapes of the mixer's stacked weights.

    Args:
        mixer: An experts module recognised as ``kind`` (it holds every weight ``kind.stacked`` names).
        kind: One of :data:`EXPERTS_KINDS`.

    Returns:
        Size name -> size (``{"experts": 8, "intermediate": 32, "hidden": 64}``), or ``None`` when a shape does not
        fit the layout (other dims, sizes that disagree between the weights, an odd packed pair).
    """
    sizes: dict[str, int] = {}
    for path, dims in kind.stacked.items():
        shape = tuple(getattr(mixer, path).shape)
        if len(shape) != len(dims):
            return None
        for dim, size in zip(dims, shape, strict=True):
            factor, _, size_name = dim.rpartition("*")
            count, left = divmod(size, int(factor or 1))
            if left or sizes.setdefault(size_name, count) != count:
                return None
    return sizes


def shared_norm_names(mixer: nn.Module, kind: MixerKind) -> list[str]:
    """The relative names of the mixer's norms whose gradient is summed over the TP group."""
    names = list(kind.shared_norms)
    if kind in ATTENTION_KINDS and (heads := config_heads(mixer)):
        names += per_head_norms(mixer, mixer.q_proj.weight.shape[0] // heads)
    return [n for n in names if _has(mixer, n)]


def config_heads(attention: nn.Module) -> int | None:
    """The query heads of the config an attention module keeps (``self.config``), or ``None``."""
    config = getattr(attention, "config", None)
    config = config.get_text_config() if hasattr(config, "get_text_config") else config
    heads = config_value(config, "num_attention_heads")
    return heads if isinstance(heads, int) else None


@dataclass(frozen=True)
class SplitMixer:
    """A mixer split by heads, as its plan holds it: its kind, and what is read from the module once, before its
    head counts are divided (the sizes its kind's block expressions name, which of its optional parameters it holds,
    the width of its norm across ranks). Everything else the split needs is derived from these."""

    kind: MixerKind
    #: The size attributes its kind's ``blocks`` and ``buffers`` expressions name -> their whole values.
    sizes: Mapping[str, int]
    #: The relative paths of its kind's ``blocks`` and ``dims`` that it holds as parameters.
    params: frozenset[str]
    #: The whole width of its :attr:`MixerKind.norm_across_ranks` norm (``None``: no such norm, or no weight).
    norm_width: int | None = None

    def size(self, expression: str) -> int:
        return math.prod(self.sizes[name] for name in _names(expression))

    @property
    def blocks(self) -> dict[str, tuple[int, ...]]:
        """Relative parameter path -> whole block sizes, for its parameters with more than one block."""
        out = {}
        for path, expressions in self.kind.blocks.items():
            if len(expressions) > 1 and path in self.params:
                out[path] = tuple(self.size(e) for e in expressions)
        return out

    @property
    def whole_blocks(self) -> dict[str, tuple[int, ...]]:
        """Relative parameter path -> the indices of its blocks that every rank takes whole (none: absent)."""
        return {
            path: _whole(expressions)
            for path, expressions in self.kind.blocks.items()
            if _whole(expressions) and path in self.params
        }

    @property
    def dims(self) -> dict[str, int]:
        """Relative parameter path -> the dim it is split on, for its parameters not split on dim 0."""
        return {path: dim for path, dim in self.kind.dims.items() if path in self.params}

    @property
    def buffers(self) -> dict[str, tuple[int, tuple[int, ...], tuple[int, ...]]]:
        """Relative buffer path -> (dim, whole block sizes, indices of the blocks taken whole), for its packed
        buffers."""
        return {
            path: (dim, tuple(self.size(e) for e in expressions), _whole(expressions))
            for path, (dim, expressions) in self.kind.buffers.items()
        }

    def local_sizes(self, tp_size: int) -> dict[str, int]:
        """The attributes of :attr:`MixerKind.local_sizes`, set to the number of rows the rank takes of their
        parameter (the same on every rank)."""
        out = {}
        for attr, path in self.kind.local_sizes.items():
            expressions = self.kind.blocks[path]
            out[attr] = sum(self.size(e) if e.startswith(WHOLE) else self.size(e) // tp_size for e in expressions)
        return out

    @property
    def recurrent(self) -> bool:
        """Whether it is a recurrent mixer (linear attention, a state-space layer), whose heads are its own rather
        than the config's attention heads."""
        return not self.kind.complete_only and self.kind.name != "latent_attention"


def split_mixer(mixer: nn.Module, kind: MixerKind) -> SplitMixer:
    """Read once, before its head counts change, what splitting ``mixer`` as ``kind`` needs (:class:`SplitMixer`)."""
    expressions = [*(e for es in kind.blocks.values() for e in es), *(e for _, es in kind.buffers.values() for e in es)]
    sizes = {name: int(getattr(mixer, name)) for e in expressions for name in _names(e)}
    params = frozenset(path for path in (*kind.blocks, *kind.dims) if _has_param(mixer, path))
    norm = mixer.get_submodule(kind.norm_across_ranks) if kind.norm_across_ranks else None
    width = norm.weight.shape[0] if norm is not None and getattr(norm, "weight", None) is not None else None
    return SplitMixer(kind, sizes, params, width)


__all__ = [
    "MIXER_KINDS",
    "SplitMixer",
    "WHOLE",
    "attribute",
    "config_heads",
    "find_mixers",
    "heads_problem",
    "mixer_entries",
    "mixer_kind",
    "per_head_norms",
    "rotary_width",
    "shared_norm_names",
    "split_mixer",
    "stacked_sizes",
]
