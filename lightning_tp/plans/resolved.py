"""A resolved plan as data: the style of each concrete module and parameter name, checked against one module, and
what the parallelisms read from it (head styles, KV-head replication, experts, the split mixers' packed blocks and
sizes). :func:`lightning_tp.plans.resolve.resolve_plan` makes it; :func:`lightning_tp.plans.resolve.no_plan` makes
the one of TP over one rank.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields, replace
from typing import Any

from torch import nn
from torch.distributed.tensor.parallel import ParallelStyle

from lightning_tp.plans.mixers import SplitMixer
from lightning_tp.plans.styles import HEAD_COUNT_ATTRIBUTES, facts

#: A plan's value: a Transformers style name or a torch ``ParallelStyle`` instance.
Style = str | ParallelStyle


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


__all__ = [
    "ResolvedPlan",
    "Style",
]
