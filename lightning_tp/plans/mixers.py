"""Head-parallel sequence mixers: the linear-attention and state-space layers of hybrid models, split by heads.

Transformers' plans leave these mixers whole (Nemotron-H, Granite 4) or gather their projections so that every rank
computes the whole recurrence (Qwen3.5's ``colwise_gather_output``). Each kind below is described as data: how it is
recognised (the parameters it holds), which of its size attributes its forward reshapes by (divided by the TP size,
as ``local_heads`` does for attention), and for each parameter the blocks its dim 0 concatenates. Every rank then
holds, and computes, its slice of every block: its own heads of q, k, v, z, the conv channels of those heads, their
``A_log``/``dt_bias``/``D``; the output projection is row-wise, its partial outputs summed. Megatron-Core and vLLM
split these mixers the same way.

A parameter with one block is a plain column split (``colwise``, or ``local_blocks`` for a parameter the mixer reads
itself); one with several (a fused ``[q | k | v]`` projection, the conv over those channels) is ``colwise_blocks`` /
``local_blocks``, whose storage is a plain ``Shard(0)`` of the whole tensor (so checkpoints, resharding and export see
the model's own layout) and whose forward takes the rank's rows of each block (see
:mod:`lightning_tp.parallel.blocks`).

A block size is written as attribute names of the mixer joined by ``*`` (``"n_groups*ssm_state_size"``), read from
the module before its attributes are divided.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field

from torch import nn


@dataclass(frozen=True)
class MixerKind:
    """One kind of head-structured sequence mixer.

    ``holds``: parameter names (relative to the mixer) it must all have to be recognised as this kind; ``lacks``:
    names it must not have (to tell similar kinds apart). ``styles``: relative module or parameter path -> style;
    a path the mixer lacks is skipped (a bias, an optional projection). ``blocks``: relative parameter path -> block
    sizes of its dim 0. ``attributes``: the size attributes divided by the TP size. ``heads``: the attributes whose
    counts the TP size must divide (key heads or groups first), named in the refusal.
    """

    name: str
    description: str
    holds: tuple[str, ...]
    styles: Mapping[str, str]
    blocks: Mapping[str, tuple[str, ...]]
    attributes: tuple[str, ...]
    heads: tuple[str, ...]
    lacks: tuple[str, ...] = ()
    #: Modules holding a norm over one head (or group) whose weight every head shares: kept whole, their gradient
    #: summed over the TP group (each rank's heads contribute their part).
    shared_norms: tuple[str, ...] = field(default=())


_GDN_ATTRIBUTES = ("num_v_heads", "num_k_heads", "key_dim", "value_dim", "conv_dim")
_QKV = ("key_dim", "key_dim", "value_dim")

#: Every mixer kind this package splits by heads.
MIXER_KINDS: tuple[MixerKind, ...] = (
    MixerKind(
        name="latent_attention",
        description="multi-head latent attention (DeepSeek-V2/V3 style)",
        holds=("kv_a_proj_with_mqa.weight", "kv_b_proj.weight", "o_proj.weight"),
        # The up-projections split by head, the output projection row-wise. The low-rank down-projections and their
        # norms stay whole: their outputs feed column-wise layers, whose input gradient is summed over the TP group,
        # except the rotary key slice of `kv_a_proj_with_mqa`, which reaches the heads unprojected (`mla_kv_a_proj`
        # sums its gradient). A sparse-attention indexer (V3.2, GLM-5) stays whole: it picks the same keys for
        # every head, from its own few heads, and that choice must agree on every rank.
        styles={
            "q_proj": "colwise",
            "q_b_proj": "colwise",
            "kv_b_proj": "colwise",
            "kv_a_proj_with_mqa": "mla_kv_a_proj",
            "o_proj": "rowwise",
        },
        blocks={},
        attributes=("num_heads",),
        heads=("num_heads",),
    ),
    MixerKind(
        name="gated_deltanet",
        description="Gated DeltaNet (separate q|k|v, z, b, a projections: Qwen3.5)",
        holds=("in_proj_qkv.weight", "in_proj_z.weight", "conv1d.weight", "A_log", "dt_bias", "out_proj.weight"),
        styles={
            "in_proj_qkv": "colwise_blocks",
            "in_proj_z": "colwise",
            "in_proj_b": "colwise",
            "in_proj_a": "colwise",
            "conv1d": "local_blocks",
            "A_log": "local_blocks",
            "dt_bias": "local_blocks",
            "out_proj": "rowwise",
        },
        blocks={
            "in_proj_qkv.weight": _QKV,
            "in_proj_qkv.bias": _QKV,
            "conv1d.weight": _QKV,
            "conv1d.bias": _QKV,
            "A_log": ("num_v_heads",),
            "dt_bias": ("num_v_heads",),
        },
        attributes=_GDN_ATTRIBUTES,
        heads=("num_k_heads", "num_v_heads"),
        shared_norms=("norm",),
    ),
    MixerKind(
        name="gated_deltanet_grouped",
        description="Gated DeltaNet with q|k|v|z and b|a fused per key head (Qwen3-Next)",
        holds=("in_proj_qkvz.weight", "in_proj_ba.weight", "conv1d.weight", "A_log", "dt_bias", "out_proj.weight"),
        styles={
            # Grouped by key head: a plain column split gives each rank whole key heads with their value heads.
            "in_proj_qkvz": "colwise",
            "in_proj_ba": "colwise",
            "conv1d": "local_blocks",
            "A_log": "local_blocks",
            "dt_bias": "local_blocks",
            "out_proj": "rowwise",
        },
        blocks={
            "conv1d.weight": _QKV,
            "conv1d.bias": _QKV,
            "A_log": ("num_v_heads",),
            "dt_bias": ("num_v_heads",),
        },
        attributes=_GDN_ATTRIBUTES,
        heads=("num_k_heads", "num_v_heads"),
        shared_norms=("norm",),
    ),
)


def _size(module: nn.Module, expression: str) -> int:
    return math.prod(int(getattr(module, name)) for name in expression.split("*"))


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
            if all(isinstance(getattr(module, a, None), int) for a in kind.attributes):
                return kind
    return None


def find_mixers(model: nn.Module) -> dict[str, MixerKind]:
    """Every head-structured mixer of ``model``: path -> kind."""
    return {name: kind for name, m in model.named_modules() if (kind := mixer_kind(m)) is not None}


def block_sizes(mixer: nn.Module, kind: MixerKind, path: str) -> tuple[int, ...] | None:
    """The whole sizes of the blocks of the parameter at ``path`` (relative to ``mixer``), or ``None`` (one block)."""
    expressions = kind.blocks.get(path)
    return None if expressions is None else tuple(_size(mixer, e) for e in expressions)


def heads_problem(name: str, mixer: nn.Module, kind: MixerKind, tp_size: int) -> str | None:
    """Why ``tp_size`` cannot split this mixer's heads, naming the sizes that work; ``None`` when it can."""
    counts = {a: int(getattr(mixer, a)) for a in kind.heads}
    sizes = {a: c for a, c in counts.items() if c % tp_size}
    if not sizes:
        for path, expressions in kind.blocks.items():
            if _has_param(mixer, path):
                uneven = [e for e in expressions if _size(mixer, e) % tp_size]
                if uneven:
                    sizes = {e: _size(mixer, e) for e in uneven}
                    break
    if not sizes:
        return None
    works = [t for t in range(1, max(counts.values()) + 1) if all(c % t == 0 for c in counts.values())]
    return (
        f"{name} ({type(mixer).__name__}, {kind.description}) has {counts}: tp_size={tp_size} does not divide "
        f"{sizes}, so its heads cannot be split. TP sizes that split it: {works}; or keep it whole with "
        f"tp_plan={{'{name}': 'replicate'}}."
    )


def mixer_entries(name: str, mixer: nn.Module, kind: MixerKind) -> dict[str, str]:
    """The plan entries (full paths) that split the mixer at ``name`` by heads."""
    prefix = f"{name}." if name else ""
    entries = {}
    for path, style in kind.styles.items():
        if _has(mixer, path):
            entries[prefix + path] = style
    for norm in kind.shared_norms:
        if _has(mixer, norm):
            entries[prefix + norm] = "replicated_with_grad_allreduce"
    return entries


def mixer_blocks(name: str, mixer: nn.Module, kind: MixerKind) -> dict[str, tuple[int, ...]]:
    """Full parameter path -> whole block sizes, for the mixer's parameters with more than one block."""
    prefix = f"{name}." if name else ""
    out = {}
    for path in kind.blocks:
        sizes = block_sizes(mixer, kind, path)
        if sizes is not None and len(sizes) > 1 and _has_param(mixer, path):
            out[prefix + path] = sizes
    return out
