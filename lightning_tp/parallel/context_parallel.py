"""Context parallelism: each sequence split over the ranks of the ``cp`` mesh axis, attention exchanging keys and
values, everything else on the local chunk.

The ranks of a CP group read the same rows (the sampler splits the data over the data-parallel axes only). A forward
pre-hook on the model's decoder stack cuts each sequence into ``2 x cp`` pieces of equal length and keeps two per
rank, one from the front and its mirror from the back (rank ``r`` of 2 holds pieces ``r`` and ``3 - r``): under a
causal mask the late pieces see more keys, so every rank does the same work (load balancing, as torchtitan and
Megatron-Core do). The position ids the model gets are those of the whole sequence, so RoPE and learned positions are
right; a length that ``2 x cp`` does not divide is padded at the end, where a causal mask hides the padding from every
real token and the loss ignores it.

Attention: each layer all-gathers its keys and values over the CP group (one collective per layer, the Llama 3
paper's choice: with grouped-query attention the keys and values are a fraction of the activations; the backward
reduce-scatters their gradients), and each local piece attends to the keys before its end, in one call of the model's
own attention (``sdpa`` or ``eager``: softcapping, sinks and dropout stay the model's). The mask is Transformers' own:
the model's mask functions (causal, sliding window, chunked) are evaluated at the global positions of the local queries
against every key, with the padding mask of the whole sequence, and packed sequences (``position_ids`` restarting,
without ``attention_mask``) are told apart as Transformers does. This is done by registering an attention and a mask
implementation for the model (Transformers' ``AttentionInterface``/``AttentionMaskInterface``), not by replacing any
``forward``. torch's ring attention (``torch.distributed.tensor.experimental.context_parallel``) is not used: in torch
2.13 it has no CPU/gloo path, and it replaces SDPA for the whole region rather than the model's attention function.

The loss: the model's causal-LM loss gets the labels of the whole sequence, shifted before the split (the label of a
piece's last token is the first token of the next piece, on another rank), and normalised by the count of labelled
tokens of the whole sequence; the ranks' partial losses are summed, so ``outputs.loss`` is the loss of the whole
sequence on every rank. FSDP2 averages gradients over ``dp_shard x cp``; the sum's backward multiplies by ``cp`` so
that the CP ranks' contributions add up instead.

Decoding with a cache (``generate``) runs without the split: every rank of the group decodes the whole sequence.
"""

from __future__ import annotations

import copy
import functools
import inspect
import itertools
import weakref
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.attention.bias import causal_lower_right

from lightning_tp.compat import attention_implementation, pass_attention_default, set_attention_implementation
from lightning_tp.parallel.collectives import SumOverGroup

#: The attention implementations context parallelism runs inside, and the score a masked key gets in the additive
#: mask each is given: ``-inf`` for ``sdpa`` (a query row with no key left gives zeros, as SDPA's boolean masks do on
#: one process), the dtype's minimum for ``eager`` (as Transformers' ``eager_mask``). Additive float masks, built once
#: per forward and piece and shared by the layers: SDPA converts a boolean mask to floats in every call, and its
#: CPU and memory-efficient kernels keep each layer's copy for the backward.
INNER_MASK_FORMATS: Mapping[str, str] = {"sdpa": "-inf", "eager": "min"}
#: Layer types (``config.layer_types``) whose sequence mixing is attention, which the split handles. Any other type
#: (linear attention, state-space and convolution layers) mixes the sequence without keys and values to exchange.
ATTENTION_LAYER_TYPES = frozenset({"full_attention", "sliding_attention", "chunked_attention"})
#: Layer types that mix no tokens (Nemotron-H's MLP and MoE layers): nothing to exchange.
TOKENWISE_LAYER_TYPES = frozenset({"mlp", "moe"})
#: The tensor keyword arguments of the decoder stack's forward that hold one entry per token and are split (or, for
#: ``attention_mask``, replaced by the whole sequence's) here.
SEQUENCE_INPUTS = ("input_ids", "inputs_embeds", "position_ids", "attention_mask")
#: The decoder stack's arguments that pass a cache (Transformers 5.24 renamed ``past_key_values`` to ``cache``).
CACHE_INPUTS = ("cache", "past_key_values")
#: The attribute a context-parallel mask carries: its :class:`MaskTag`.
SPLIT_ATTR = "_lightning_tp_cp_split"
#: Causal LMs whose layers call Transformers' attention interface although their class does not declare it
#: (``is_backend_compatible()`` is False in Transformers 5.24 and 5.25), at parity with cp 2 in the coverage run
#: (``benchmarks/coverage.py``). Keyed by the model class's own name: a subclass under another name is refused like any
#: undeclared model. The first split forward still checks that every decoder layer called the interface.
UNDECLARED_ATTENTION_INTERFACE = frozenset({"BioGptForCausalLM", "StableLmForCausalLM"})
#: The names the splits' attention and mask implementations are registered under (a counter follows).
NAME_PREFIX = "lightning_tp_cp_"
#: The keyword under which a split's attention function gets the default the layer asked the interface with (its
#: modeling file's eager attention; see :func:`lightning_tp.compat.pass_attention_default`).
DEFAULT_ATTENTION_KEYWORD = "default_attention"
#: Sequence dim of the activations (batch, seq, ...) and of the attention's keys (batch, heads, seq, head_dim).
SEQUENCE_DIM = 1
KEY_SEQUENCE_DIM = 2

_names = itertools.count()
#: The splits by the name their model's config selects. Transformers' interfaces are global registries: they hold a
#: function that looks the split up here, weakly, so that a model (and its split, masks and groups) can be freed.
_SPLITS: weakref.WeakValueDictionary[str, ContextParallel] = weakref.WeakValueDictionary()


# ---------------------------------------------------------------------------------------------------------------------
# Where each rank's tokens lie: pure functions of the lengths, tested on their own


def padded_length(length: int, multiple: int) -> int:
    """``length`` rounded up to a multiple of ``multiple``."""
    return -(-length // multiple) * multiple


def piece_starts(length: int, cp_size: int, rank: int) -> tuple[int, int]:
    """The global start of rank ``rank``'s two pieces of a sequence of ``length`` tokens (divisible by ``2 x cp``):
    piece ``rank`` from the front and piece ``2 cp - 1 - rank`` from the back."""
    piece = length // (2 * cp_size)
    return rank * piece, (2 * cp_size - 1 - rank) * piece


def local_positions(length: int, cp_size: int, rank: int) -> torch.Tensor:
    """The global index of each of rank ``rank``'s tokens, in its local order (front piece, then back piece)."""
    piece = length // (2 * cp_size)
    return torch.cat([torch.arange(start, start + piece) for start in piece_starts(length, cp_size, rank)])


def gathered_positions(length: int, cp_size: int) -> torch.Tensor:
    """The global index of each token of an all-gather over the CP group (rank 0's tokens first)."""
    return torch.cat([local_positions(length, cp_size, rank) for rank in range(cp_size)])


@dataclass(frozen=True)
class Piece:
    """One of a rank's two pieces: its rows in the local sequence and the global positions it covers."""

    local_start: int
    global_start: int
    length: int

    @property
    def global_end(self) -> int:
        return self.global_start + self.length


@dataclass(frozen=True, eq=False)
class MaskTag:
    """What a mask made for a split forward is: that forward's split, and whether the mask is plain causal (then it
    holds no values: each piece's mask follows from the positions, or is a kernel's lower-right causal flag)."""

    split: BatchSplit
    causal: bool


@dataclass(eq=False)
class BatchSplit:
    """One forward's split: lengths, this rank's positions, the packed-sequence ids of the whole sequence, and what
    the forward's attention layers did (for the check that each of them exchanged keys and values)."""

    seq_len: int
    padded_len: int
    positions: torch.Tensor  # (local_len,) global index of each local token
    order: torch.Tensor  # gathered index of each global position
    gathered: torch.Tensor  # global position of each gathered index
    pieces: tuple[Piece, ...]
    doc_ids: torch.Tensor | None = None  # (batch, padded_len): which packed sequence each token belongs to
    padding: bool = False  # the batch came with a padding mask
    called: set[int] = field(default_factory=set)
    outside: list[torch.Tensor] = field(default_factory=list)  # per piece mask: whether it allows a key left out
    masks: dict[tuple, torch.Tensor] = field(default_factory=dict)

    @property
    def local_len(self) -> int:
        return self.positions.numel()

    def local(self, tensor: torch.Tensor) -> torch.Tensor:
        """This rank's tokens of a ``(batch, padded_len, ...)`` tensor."""
        return tensor.index_select(SEQUENCE_DIM, self.positions.to(tensor.device))


# ---------------------------------------------------------------------------------------------------------------------
# Collectives with their gradients


class _GatherSequence(torch.autograd.Function):
    """All-gather a tensor's sequence dim ``dim`` over the CP group into the whole sequence in global order; the
    backward reduce-scatters the gradients (each rank's keys were read by every rank's queries)."""

    @staticmethod
    def forward(ctx, local, dim, group, size, order, gathered):  # type: ignore[override]
        ctx.dim, ctx.group, ctx.size, ctx.gathered = dim, group, size, gathered
        first = local.movedim(dim, 0).contiguous()  # the collective stacks along dim 0
        out = first.new_empty((size * first.shape[0], *first.shape[1:]))
        dist.all_gather_single(out, first, group=group)
        return out.index_select(0, order).movedim(0, dim)

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        ranked = grad.movedim(ctx.dim, 0).index_select(0, ctx.gathered).contiguous()
        out = ranked.new_empty((ranked.shape[0] // ctx.size, *ranked.shape[1:]))
        dist.reduce_scatter_single(out, ranked, group=ctx.group)
        return out.movedim(0, ctx.dim), None, None, None, None, None


# ---------------------------------------------------------------------------------------------------------------------
# What can run split: checked before anything moves


def context_parallel_problem(model: nn.Module) -> str | None:
    """Why ``model`` cannot run with its sequences split, or ``None``. Reads the model's structure, class declarations
    and config only (never its code), so every rank decides the same before any collective.

    Args:
        model: the model to split (a Transformers causal LM, else refused).
    """
    from lightning_tp.parallel.loss_parallel import computes_causal_lm_loss
    from lightning_tp.plans.resolve import is_transformers_model
    from lightning_tp.plans.structure import block_classes

    name = type(model).__name__
    if not is_transformers_model(model):
        return f"{name} is not a Transformers model; context parallelism splits the sequences of causal LMs"
    config = model.config
    if config.get_text_config() is not config:
        return (
            f"{name} is a composite (vision-language or audio) model; context parallelism supports text causal LMs "
            "(their image and audio tokens have positions and masks of their own)"
        )
    if not getattr(config, "is_causal", True) or getattr(config, "is_encoder_decoder", False):
        return f"{name} does not use causal attention; the load-balanced split assumes a causal mask"
    implementation = attention_implementation(config)
    if implementation not in INNER_MASK_FORMATS:
        return (
            f"{name} uses attn_implementation={implementation!r}; context parallelism runs inside "
            f'{" or ".join(map(repr, INNER_MASK_FORMATS))} (load the model with `attn_implementation="sdpa"`)'
        )
    layer_types = set(getattr(config, "layer_types", None) or ())
    other = sorted(layer_types - ATTENTION_LAYER_TYPES - TOKENWISE_LAYER_TYPES)
    if other:
        # A recurrence over a chunk would need the state the previous rank's chunk ended with (not passed yet).
        return (
            f"{name} has layers of type {other} (`config.layer_types`), which mix the sequence without attention "
            "(linear attention, state-space or convolution layers): each rank would see its chunk only, so context "
            "parallelism is refused for it; use tp_size (their heads are split) or dp_shard_size instead"
        )
    if getattr(config, "output_router_logits", False):
        return (
            f"{name} adds its router's load-balancing loss (`output_router_logits=True`), which is computed over the "
            "local chunk's tokens; set `output_router_logits=False`"
        )
    if not computes_causal_lm_loss(model):
        current = model.loss_function
        return (
            f"{name} computes its loss with {getattr(current, '__name__', current)!r}, not Transformers' causal-LM "
            "loss, whose labels the split shifts before cutting them"
        )
    if not declares_attention_interface(model):
        return (
            f"{name} does not declare that its layers compute attention through Transformers' attention interface "
            f"(`{name}.is_backend_compatible()` is False), the only place where context parallelism exchanges keys and "
            "values: layers with attention code of their own (GPT-Neo, Bloom, MPT, Falcon's in Transformers 5.24) "
            "would attend within each rank's chunk. Run it without `cp_size` (tp_size or dp_shard_size instead)"
        )
    base = decoder_stack(model, block_classes(model))
    parameters = inspect.signature(base.forward).parameters
    missing = [arg for arg in ("position_ids", "attention_mask") if arg not in parameters]
    if missing:
        return f"{type(base).__name__}.forward takes no {missing}; the split passes the whole sequence's positions"
    return None


def declares_attention_interface(model: nn.Module) -> bool:
    """Whether ``model``'s layers compute attention through Transformers' attention interface, the registry that
    context parallelism registers its attention in: as the model's class declares it (``is_backend_compatible()``,
    what Transformers' models that dispatch through ``AttentionInterface`` set), or as
    :data:`UNDECLARED_ATTENTION_INTERFACE` lists it. A model that declares nothing is taken not to: what its layers
    do is not read from their code.

    Args:
        model: a Transformers model (:func:`lightning_tp.plans.resolve.is_transformers_model`).
    """
    declared = getattr(type(model), "is_backend_compatible", None)
    return (callable(declared) and bool(declared())) or type(model).__name__ in UNDECLARED_ATTENTION_INTERFACE


def decoder_stack(model: nn.Module, blocks: set[type] | None = None) -> nn.Module:
    """The module that embeds the tokens and runs the decoder layers (``model.model`` for Llama, ``model.model.decoder``
    for OPT, ``model.transformer`` for GPT-2): the innermost one holding the input embedding and every layer, which
    the causal LM calls with the token ids and positions. ``blocks``: the decoder layer classes (default: the
    model's ``_no_split_modules``)."""
    from lightning_tp.plans.structure import block_classes

    blocks = block_classes(model) if blocks is None else blocks
    embedding = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    names = [name for name, m in model.named_modules() if m is embedding or type(m) in blocks]
    if embedding is None or len(names) < 2:
        base = getattr(model, "base_model", None)
        return model if base is None else base
    prefix = names[0].split(".")
    for name in names[1:]:
        parts = name.split(".")
        common = 0
        while common < min(len(prefix), len(parts)) and prefix[common] == parts[common]:
            common += 1
        prefix = prefix[:common]
    return model.get_submodule(".".join(prefix))


# ---------------------------------------------------------------------------------------------------------------------
# The split


class ContextParallel:
    """The split of one model's sequences over a CP group, installed by :func:`install_context_parallel`.

    ``stack``: the model's decoder stack (:func:`decoder_stack`). ``multiple``: what the padded length must be
    divisible by (``2 x cp``, times ``tp`` under sequence parallelism, which splits each rank's tokens again).
    ``blocks``: the decoder layer classes, each of whose instances must exchange keys and values in the first split
    forward.
    """

    def __init__(self, model: nn.Module, stack: nn.Module, mesh: Any, *, multiple: int, blocks: set[type]) -> None:
        self.group = mesh.get_group()
        self.size = mesh.size()
        self.rank = mesh.get_local_rank()
        assert multiple % (2 * self.size) == 0, (multiple, self.size)
        self.multiple = multiple
        self.inner = attention_implementation(model.config)
        self.name = f"{NAME_PREFIX}{next(_names)}"
        self.blocks = blocks
        self.current: BatchSplit | None = None
        self.labelled = False
        self.unsplit = False
        self.entered = True
        self.rows_checked = False
        self.stack_name = type(stack).__name__
        self.checked = False
        self._layouts: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}
        self._forward_parameters = inspect.signature(stack.forward).parameters
        self._positions_from_mask = positions_from_mask(stack)

    def __deepcopy__(self, memo: dict) -> ContextParallel:
        """A deep copy of the model (a frozen reference, an EMA copy) shares its split: the same group and sizes, and
        state that lives for one forward at a time (its config's copy selects the same implementation)."""
        return self

    # --------------------------------------------------------------- the decoder stack's inputs

    def split_inputs(self, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        """Forward pre-hook of the decoder stack: this rank's tokens, the whole sequence's positions and padding."""
        self.entered = True
        if args:  # called positionally: name the arguments as the forward does
            kwargs = {**dict(zip(self._forward_parameters, args, strict=False)), **kwargs}
            args = ()
        if any(kwargs.get(name) is not None for name in CACHE_INPUTS) or kwargs.get("use_cache") or self.unsplit:
            self.current = None  # decoding (a cache, or the last positions' logits): the whole sequence on every rank
            return args, kwargs
        if kwargs.get("output_router_logits"):
            raise ValueError(
                "Context parallelism computes each rank's chunk of the sequence, and the router's load-balancing loss "
                "(`output_router_logits=True`) would cover the chunk only. Drop `output_router_logits`."
            )
        tokens = kwargs.get("input_ids")
        tokens = kwargs.get("inputs_embeds") if tokens is None else tokens
        if tokens is None:
            raise ValueError("Context parallelism splits `input_ids` or `inputs_embeds`; the model got neither.")
        batch, length = tokens.shape[:2]
        if not self.rows_checked:
            self._check_same_rows(tokens)
        for name, value in kwargs.items():
            per_token = isinstance(value, torch.Tensor) and value.ndim >= 2 and value.shape[:2] == (batch, length)
            if per_token and name not in SEQUENCE_INPUTS:
                raise ValueError(
                    f"The model got `{name}` with one entry per token (shape {tuple(value.shape)}); context "
                    f"parallelism knows how to split {list(SEQUENCE_INPUTS)} only. Drop `{name}`, or run without "
                    "`cp_size`."
                )
        attention_mask = kwargs.get("attention_mask")
        if self._positions_from_mask and kwargs.get("position_ids") is None and attention_mask is not None:
            raise ValueError(
                f"Context parallelism: {self._positions_from_mask} derives the positions from `attention_mask` (a "
                "left-padded row starts at position 0), which each rank's chunk cannot do alone. Pass `position_ids` "
                "with the mask, e.g. `(attention_mask.cumsum(-1) - 1).clamp(min=0)`."
            )
        padded = padded_length(length, self.multiple)
        device = tokens.device
        positions, order, gathered = self._layout(padded, device)
        position_ids = _whole_positions(kwargs.get("position_ids"), batch, length, padded, device)
        doc_ids = None
        if attention_mask is None:
            from transformers.masking_utils import find_packed_sequence_indices

            doc_ids = find_packed_sequence_indices(position_ids[:, :length].expand(batch, -1))
            if doc_ids is not None:  # the padding joins the last sequence
                doc_ids = _pad_sequence(doc_ids, padded, value=None)
            whole_mask = torch.ones(batch, padded, dtype=torch.bool, device=device)
        else:
            if not isinstance(attention_mask, torch.Tensor) or tuple(attention_mask.shape) != (batch, length):
                raise ValueError(
                    "Context parallelism takes a 2-D padding `attention_mask` of shape (batch, seq) = "
                    f"{(batch, length)}, got {_describe(attention_mask)}: a prepared (4-D or per-layer) mask cannot be "
                    "split. Pass the padding mask, or `position_ids` restarting at 0 for packed sequences."
                )
            # The padding at the end is visible (a causal mask hides it from every real token already): no query row
            # is left without a key.
            whole_mask = nn.functional.pad(attention_mask.to(torch.bool), (0, padded - length), value=True)
        piece = padded // (2 * self.size)
        starts = piece_starts(padded, self.size, self.rank)
        split = BatchSplit(
            seq_len=length,
            padded_len=padded,
            positions=positions,
            order=order,
            gathered=gathered,
            pieces=(Piece(0, starts[0], piece), Piece(piece, starts[1], piece)),
            doc_ids=doc_ids,
            padding=attention_mask is not None,
        )
        self.current = split
        if kwargs.get("input_ids") is not None:
            kwargs["input_ids"] = split.local(_pad_sequence(kwargs["input_ids"], padded, value=0))
        else:
            kwargs["inputs_embeds"] = split.local(_pad_sequence(kwargs["inputs_embeds"], padded, value=0.0))
        kwargs["position_ids"] = split.local(position_ids)
        # The whole sequence's padding mask: Transformers sizes the keys from it (kv_length = padded), and the mask
        # functions below index it at global positions.
        kwargs["attention_mask"] = whole_mask
        if "use_cache" in self._forward_parameters:
            kwargs["use_cache"] = False  # training needs no cache; a cache would hold the local keys only
        return args, kwargs

    def _check_same_rows(self, tokens: torch.Tensor) -> None:
        """The first split forward: the ranks of the group must hold the same rows (a loader that splits the data
        over every rank, not over the data-parallel ones, gives each its own). One all-gather of the batch's shape and
        a checksum; every rank raises the same error, before the exchanges that would otherwise mismatch."""
        self.rows_checked = True
        flat = tokens.detach().double().flatten()
        checksum = (flat * torch.arange(1, flat.numel() + 1, dtype=torch.float64, device=flat.device)).sum()
        mine = torch.tensor([*tokens.shape[:2], checksum.item()], dtype=torch.float64, device=tokens.device)
        everyone = mine.new_empty(self.size * mine.numel())
        dist.all_gather_single(everyone, mine, group=self.group)
        rows = everyone.view(self.size, -1).tolist()
        if any(row != rows[0] for row in rows):
            raise ValueError(
                "Context parallelism: the ranks of a CP group got different batches (batch, length, checksum by "
                f"rank: {rows}), but they must read the same rows and split each sequence. Split the data over the "
                "data-parallel ranks only: Lightning's sampler does (`use_distributed_sampler=True`), or use "
                "`strategy.distributed_sampler_kwargs` / `strategy.dp_mesh`, not the global rank."
            )

    def check_layers(self, module: nn.Module, args: tuple, kwargs: dict, output: Any) -> Any:
        """Forward hook of the decoder stack: after the first split forward, every decoder layer must have exchanged
        keys and values (a layer that mixes the sequence some other way saw its chunk only). The same on every rank:
        the structure is."""
        split = self.current
        if self.checked or split is None:
            return output
        layers = {name: layer for name, layer in module.named_modules() if type(layer) in self.blocks}
        missing = [
            f"{name} ({type(layer).__name__})"
            for name, layer in layers.items()
            if not any(id(m) in split.called for m in layer.modules())
        ]
        outside = torch.stack(split.outside).any() if split.outside else torch.zeros((), dtype=torch.bool)
        # One all-reduce, once: whether any rank's pieces met a mask that lets a query see past the keys it was given
        # (the check runs on each rank's own pieces, so the ranks decide together).
        flag = outside.to(torch.int32).reshape(1)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.group)
        if flag.item():
            raise ValueError(
                "Context parallelism: this model's attention mask lets a query attend to a later key (it is not "
                "causal) or to one outside the sliding window its attention declares; the pieces cannot be computed "
                "against the keys before their end. This model cannot run with `cp_size > 1`."
            )
        if missing:
            raise ValueError(
                f"Context parallelism: the decoder layers {missing[:4]}{' ...' if len(missing) > 4 else ''} did not "
                "call Transformers' attention interface with the split mask, so they mixed each rank's chunk of the "
                "sequence alone (linear attention, state-space or convolution layers, or attention code of their "
                "own). This model cannot run with `cp_size > 1`."
            )
        self.checked = True
        return output

    def _layout(self, padded: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        key = (padded, str(device))
        if key not in self._layouts:
            gathered = gathered_positions(padded, self.size)
            self._layouts[key] = (
                local_positions(padded, self.size, self.rank).to(device),
                torch.argsort(gathered).to(device),
                gathered.to(device),
            )
        return self._layouts[key]

    # --------------------------------------------------------------- Transformers' interfaces

    def mask(
        self,
        batch_size: int,
        q_length: int,
        kv_length: int,
        q_offset: int = 0,
        kv_offset: int = 0,
        mask_function: Callable | None = None,
        attention_mask: torch.Tensor | None = None,
        **kwargs: Any,
    ) -> Any:
        """The mask interface: in a split forward, the model's mask function evaluated at the global positions of
        this rank's queries against every key, ``(batch, 1, local_len, padded_len)`` booleans tagged with the split;
        otherwise the inner implementation's own mask."""
        from transformers.masking_utils import (
            ALL_MASK_ATTENTION_FUNCTIONS,
            and_masks,
            causal_mask_function,
            packed_sequence_mask_function,
            padding_mask_function,
        )

        split = self.current
        if split is None:
            return ALL_MASK_ATTENTION_FUNCTIONS[self.inner](
                batch_size=batch_size,
                q_length=q_length,
                kv_length=kv_length,
                q_offset=q_offset,
                kv_offset=kv_offset,
                mask_function=mask_function,
                attention_mask=attention_mask,
                **kwargs,
            )
        if (q_length, kv_length, q_offset, kv_offset) != (split.local_len, split.padded_len, 0, 0):
            raise ValueError(
                f"Context parallelism: the model asked for a mask of {q_length} queries (offset {q_offset}) and "
                f"{kv_length} keys (offset {kv_offset}), where the split has {split.local_len} local queries and "
                f"{split.padded_len} keys. Its mask code is not Transformers' standard one."
            )
        device = split.positions.device
        if mask_function is causal_mask_function and not split.padding and split.doc_ids is None:
            # Plain causal: no values (a view of one element); each piece's mask follows from the positions.
            mask = torch.ones((), dtype=torch.bool, device=device).expand(batch_size, 1, q_length, kv_length)
            setattr(mask, SPLIT_ATTR, MaskTag(split, causal=True))
            return mask
        function = mask_function
        if split.padding:  # the whole sequence's padding mask (without one: all ones, nothing to apply)
            function = and_masks(function, padding_mask_function(attention_mask))
        if split.doc_ids is not None:
            function = and_masks(function, packed_sequence_mask_function(split.doc_ids))
        try:
            mask = function(
                torch.arange(batch_size, device=device)[:, None, None, None],
                torch.zeros(1, dtype=torch.long, device=device)[None, :, None, None],
                split.positions[None, None, :, None],
                torch.arange(kv_length, device=device)[None, None, None, :],
            )
        except Exception as err:  # an overlay that is not index-based (Transformers would vmap it)
            raise ValueError(
                "Context parallelism evaluates the model's mask functions on index tensors; this model's mask "
                f"function could not be ({type(err).__name__}: {err})."
            ) from err
        mask = mask.expand(batch_size, 1, q_length, kv_length)  # a view where the batch does not matter
        setattr(mask, SPLIT_ATTR, MaskTag(split, causal=False))
        return mask

    def attention(
        self,
        module: nn.Module,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
        default_attention: Callable[..., Any] | None = None,
        **kwargs: Any,
    ) -> tuple[torch.Tensor, None]:
        """The attention interface: this rank's queries against the whole sequence's keys and values, piece by piece,
        through the model's own attention function: Transformers' ``sdpa``, or for ``eager`` the function the layer
        asked the interface with (``default_attention``, its modeling file's own: see
        :func:`lightning_tp.compat.pass_attention_default`).

        Raises:
            ValueError: under ``eager``, when the layer asked the interface without its eager function (it indexes
                the registry), which the split then cannot call.
        """
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

        tag = getattr(attention_mask, SPLIT_ATTR, None) if isinstance(attention_mask, torch.Tensor) else None
        if tag is None and self.current is not None:
            raise ValueError(
                f"Context parallelism: {type(module).__name__} got an attention mask that is not the split one "
                f"({None if attention_mask is None else tuple(attention_mask.shape)}), so it would attend within "
                "its chunk only. Its layer prepares masks of its own; run this model without `cp_size`."
            )
        inner = ALL_ATTENTION_FUNCTIONS.get_interface(self.inner, default_attention)
        if inner is None:
            raise ValueError(
                f"Context parallelism: {type(module).__name__} looked its attention implementation up without its "
                "eager function (`ALL_ATTENTION_FUNCTIONS[name]`, not `ALL_ATTENTION_FUNCTIONS.get_interface(name, "
                "eager_attention_forward)`), so under `eager` the split cannot run the model's own eager attention. "
                'Load the model with `attn_implementation="sdpa"`, or run it without `cp_size`.'
            )
        if tag is None:
            return inner(module, query, key, value, attention_mask, **kwargs)
        if not getattr(module, "is_causal", True):
            raise ValueError(
                f"Context parallelism: {type(module).__name__} attends bidirectionally (`is_causal=False`), which the "
                "load-balanced split does not support."
            )
        split = tag.split
        if query.shape[KEY_SEQUENCE_DIM] != split.local_len:
            raise ValueError(
                f"Context parallelism: {type(module).__name__} got {query.shape[KEY_SEQUENCE_DIM]} queries, where this "
                f"rank holds {split.local_len} tokens."
            )
        split.called.add(id(module))
        keys, values = self._gather(key, value, split)
        window = kwargs.get("sliding_window")
        if self.inner == "sdpa" and query.device.type == "cpu" and not _SDPA_EXTRAS & kwargs.keys():
            inner = _grouped_sdpa
        outputs = []
        for index, piece in enumerate(split.pieces):
            rows = slice(piece.local_start, piece.local_start + piece.length)
            # Keys after the piece are masked for every query in it (causal): not computed at all. With a sliding
            # window, neither are the keys before it.
            low = max(0, piece.global_start - int(window) + 1) if isinstance(window, int) and window > 0 else 0
            if tag.causal and low == 0 and self.inner == "sdpa" and uses_lower_right_kernel(query.device):
                # CUDA's flash kernel aligns a causal mask to the last key: no mask in memory at all.
                mask = causal_lower_right(piece.length, piece.global_end)
            else:
                mask = self._piece_mask(attention_mask, tag, index, low, query.dtype)
            out, _ = inner(
                module,
                query[:, :, rows],
                keys[:, :, low : piece.global_end],
                values[:, :, low : piece.global_end],
                mask,
                **kwargs,
            )
            outputs.append(out)
        return torch.cat(outputs, dim=SEQUENCE_DIM), None  # (batch, local_len, heads, head_dim), as the inner returns

    def gather(self, local: torch.Tensor, split: BatchSplit, *, dim: int = SEQUENCE_DIM) -> torch.Tensor:
        """The whole (padded) sequence of a tensor holding this rank's tokens on ``dim``, in global order, on every
        rank of the group; differentiable."""
        return _GatherSequence.apply(local, dim, self.group, self.size, split.order, split.gathered)

    def _gather(self, key: torch.Tensor, value: torch.Tensor, split: BatchSplit) -> tuple[torch.Tensor, torch.Tensor]:
        if key.shape == value.shape and key.dtype == value.dtype:  # one collective for both
            both = self.gather(torch.stack([key, value]).flatten(0, 1), split, dim=KEY_SEQUENCE_DIM)
            keys, values = both.unflatten(0, (2, key.shape[0])).unbind(0)
            return keys, values
        return self.gather(key, split, dim=KEY_SEQUENCE_DIM), self.gather(value, split, dim=KEY_SEQUENCE_DIM)

    def _piece_mask(self, mask: torch.Tensor, tag: MaskTag, index: int, low: int, dtype: torch.dtype) -> torch.Tensor:
        """The additive mask of one piece against keys ``[low, piece end)``; once per mask, piece and window in a
        forward (the layers of one type share it). In the first split forward it also records whether the mask lets a
        query of the piece attend to a key left out (decided with the other ranks in :meth:`check_layers`)."""
        split = tag.split
        key = (None if tag.causal else id(mask), index, low, dtype)
        cached = split.masks.get(key)
        if cached is not None:
            return cached
        piece = split.pieces[index]
        if tag.causal:
            queries = torch.arange(piece.global_start, piece.global_end, device=mask.device)
            keys = torch.arange(low, piece.global_end, device=mask.device)
            kept = (keys[None, :] <= queries[:, None])[None, None]
        else:
            rows = mask[:, :, piece.local_start : piece.local_start + piece.length]
            if not self.checked:  # decided with the other ranks at the end of the first split forward
                split.outside.append(torch.cat([rows[..., :low], rows[..., piece.global_end :]], dim=-1).any())
            kept = rows[..., low : piece.global_end]
        masked = float("-inf") if INNER_MASK_FORMATS[self.inner] == "-inf" else torch.finfo(dtype).min
        additive = torch.zeros(kept.shape, dtype=dtype, device=mask.device).masked_fill_(~kept, masked)
        split.masks[key] = additive
        return additive

    # --------------------------------------------------------------- the model's outputs

    def note_labels(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        """Forward pre-hook of the model users call: whether this forward computes a loss, and whether it keeps the
        logits of its last positions only (``logits_to_keep``: ``generate`` without a cache, per-token
        log-probabilities of a completion), which are not this rank's to compute: such a forward runs unsplit."""
        self.labelled = kwargs.get("labels") is not None or kwargs.get("shift_labels") is not None
        keep = kwargs.get("logits_to_keep")
        self.unsplit = keep is not None and not (isinstance(keep, int) and keep == 0)
        self.entered = False

    def gather_logits(self, module: nn.Module, args: tuple, kwargs: dict, output: Any) -> Any:
        """Forward hook of the model users call: a split forward without labels computes no loss, so its caller wants
        the logits: those of the whole sequence (padding removed), on every rank, differentiably (a loss computed from
        them on every rank of the group gets the gradient of one copy once FSDP2 averages). With labels they stay
        this rank's, the point of the split."""
        self.unsplit = False
        split, self.current = self.current, None  # the forward is over (a recompute reads its masks' tag)
        if not self.entered:
            raise ValueError(
                f"Context parallelism: {type(module).__name__}'s forward did not call {self.stack_name}, whose inputs "
                "the split cuts; this model's forward is not Transformers' usual one. Run it without `cp_size`."
            )
        if split is None or self.labelled:
            return output
        as_tuple = isinstance(output, tuple)  # `return_dict=False`: the logits come first without a loss
        logits = output[0] if as_tuple else getattr(output, "logits", None)
        if not isinstance(logits, torch.Tensor) or logits.ndim < 2 or logits.shape[SEQUENCE_DIM] != split.local_len:
            return output
        if hasattr(logits, "placements"):  # vocabulary-sharded, kept so by `keep_logits_sharded` (every rank alike)
            raise ValueError(
                "Context parallelism gathers the logits of a forward without labels; `keep_logits_sharded()` asks for "
                "vocabulary-sharded ones, which it does not gather. Call the forward outside `keep_logits_sharded()` "
                "(full logits), or pass `labels` (this rank's tokens, sharded)."
            )
        logits = self.gather(logits, split).narrow(SEQUENCE_DIM, 0, split.seq_len)
        if as_tuple:
            return (logits, *output[1:])
        output.logits = logits
        return output

    # --------------------------------------------------------------- the loss

    def loss(self, inner: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
        """The causal-LM loss of the whole sequence from this rank's logits: labels shifted before the split,
        normalised by the whole sequence's labelled tokens, the ranks' partial sums added."""

        def context_parallel_loss(
            logits: torch.Tensor,
            labels: torch.Tensor | None,
            vocab_size: int | None = None,
            num_items_in_batch: torch.Tensor | int | None = None,
            ignore_index: int = -100,
            shift_labels: torch.Tensor | None = None,
            **kwargs: Any,
        ) -> torch.Tensor:
            split = self.current
            if split is None:
                return inner(logits, labels, vocab_size, num_items_in_batch, ignore_index, shift_labels, **kwargs)
            if shift_labels is None:
                shift_labels = nn.functional.pad(labels, (0, 1), value=ignore_index)[..., 1:]
            if shift_labels.shape[-1] != split.seq_len:
                raise ValueError(
                    f"Context parallelism: the labels cover {shift_labels.shape[-1]} tokens, the input {split.seq_len}."
                )
            if num_items_in_batch is None:
                num_items_in_batch = (shift_labels != ignore_index).sum()
            local = split.local(_pad_sequence(shift_labels, split.padded_len, value=ignore_index))
            partial = inner(logits, None, vocab_size, num_items_in_batch, ignore_index, local, **kwargs)
            return SumOverGroup.apply(partial, self.group, self.size)

        return context_parallel_loss


def install_context_parallel(
    model: nn.Module, mesh: Any, *, multiple: int, blocks: set[type], outer: nn.Module | None = None
) -> ContextParallel:
    """Split ``model``'s sequences over the 1-D CP ``mesh``: the attention and mask implementations registered for
    it, the decoder stack's hooks, the loss, the logits of forwards without labels. ``outer``: the module users call,
    when it wraps ``model`` (a ``PeftModel``, which calls the model's ``forward`` directly, past its hooks).
    ``model`` passed :func:`context_parallel_problem`."""
    from transformers.masking_utils import AttentionMaskInterface
    from transformers.modeling_utils import AttentionInterface

    base = decoder_stack(model, blocks)
    cp = ContextParallel(model, base, mesh, multiple=multiple, blocks=blocks)
    _SPLITS[cp.name] = cp
    pass_attention_default(NAME_PREFIX, keyword=DEFAULT_ATTENTION_KEYWORD)  # each layer's eager function, for `eager`
    AttentionInterface.register(cp.name, functools.partial(_dispatch, cp.name, "attention"))
    AttentionMaskInterface.register(cp.name, functools.partial(_dispatch, cp.name, "mask"))
    # The model's modules read the implementation from the config at every forward. A config is often shared (two
    # models built from one object: a policy and its frozen reference), so this model gets its own copy first.
    _own_config(model)
    set_attention_implementation(model.config, cp.name)
    # The hooks below hold the split (the registries only weakly): it lives and dies with the model.
    base.register_forward_pre_hook(cp.split_inputs, with_kwargs=True)
    base.register_forward_hook(cp.check_layers, with_kwargs=True)
    model.loss_function = cp.loss(model.loss_function)
    outer = model if outer is None else outer
    outer.register_forward_pre_hook(cp.note_labels, with_kwargs=True)
    outer.register_forward_hook(cp.gather_logits, with_kwargs=True)
    return cp


# ---------------------------------------------------------------------------------------------------------------------
# Helpers


def _pad_sequence(tensor: torch.Tensor, length: int, *, value: Any) -> torch.Tensor:
    """``tensor`` (batch, seq, ...) padded at the end of its sequence dim to ``length``, with ``value`` (``None``:
    the last entry repeated)."""
    missing = length - tensor.shape[SEQUENCE_DIM]
    if missing == 0:
        return tensor
    if value is None:
        last = tensor.narrow(SEQUENCE_DIM, tensor.shape[SEQUENCE_DIM] - 1, 1)
        return torch.cat([tensor, last.expand(*tensor.shape[:SEQUENCE_DIM], missing, *tensor.shape[2:])], SEQUENCE_DIM)
    pad = [0, 0] * (tensor.ndim - 1 - SEQUENCE_DIM) + [0, missing]
    return nn.functional.pad(tensor, pad, value=value)


def _whole_positions(
    position_ids: torch.Tensor | None, batch: int, length: int, padded: int, device: torch.device
) -> torch.Tensor:
    """The position ids of the whole (padded) sequence: as given, or ``0 .. length - 1`` as Transformers counts them
    without a cache; the padding repeats the last position (a causal mask hides it, and learned position tables end
    at the model's longest sequence)."""
    if position_ids is None:
        return _pad_sequence(torch.arange(length, device=device).unsqueeze(0), padded, value=None)
    if position_ids.ndim != 2 or position_ids.shape[-1] != length:
        raise ValueError(
            f"Context parallelism takes `position_ids` of shape (batch, seq) with seq = {length}, got shape "
            f"{tuple(position_ids.shape)} (multi-axis positions such as M-RoPE's are not supported)."
        )
    return _pad_sequence(position_ids, padded, value=None)


#: Keyword arguments of Transformers' ``sdpa_attention_forward`` that do more than torch's SDPA (a bias, softcapping,
#: attention weights): with one of them the piece goes through Transformers' function.
_SDPA_EXTRAS = frozenset({"position_bias", "softcap", "s_aux", "sinks", "output_attentions"})


def _grouped_sdpa(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor,
    *,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """One piece through torch's SDPA with its own grouped-query attention, on the CPU. Transformers'
    ``sdpa_attention_forward`` repeats the KV heads to the query heads whenever a mask is given (CUDA's
    memory-efficient kernel has no GQA), and SDPA keeps the repeated copy for the backward: for the pieces' keys, the
    query-head count times the gathered keys, in every layer (in ``benchmarks/context_parallel.py`` at cp 4 and 8k
    tokens, 75 MiB: more than its masks and gathered keys together). torch's CPU kernels take the mask and the
    grouping together (same values)."""
    out = nn.functional.scaled_dot_product_attention(
        query,
        key,
        value,
        attn_mask=attention_mask,
        dropout_p=dropout,
        scale=scaling,
        enable_gqa=query.shape[1] != key.shape[1],
    )
    return out.transpose(1, 2).contiguous(), None


def _dispatch(name: str, method: str, *args: Any, **kwargs: Any) -> Any:
    split = _SPLITS.get(name)
    if split is None:  # pragma: no cover - the model that selects the name holds its split
        raise RuntimeError(f"Context parallelism: the split {name!r} of a freed model was called.")
    return getattr(split, method)(*args, **kwargs)


def uses_lower_right_kernel(device: torch.device) -> bool:
    """Whether SDPA takes a causal mask aligned to the last key without materialising it on ``device``: CUDA's flash
    kernel does; on the CPU, torch builds the mask in every call (a cached additive mask costs less there)."""
    return device.type == "cuda"


def _own_config(model: nn.Module) -> None:
    """Give ``model`` and its modules a copy of the config they share, so that changing it changes no other model."""
    shared = model.config
    own = copy.deepcopy(shared)
    for module in model.modules():
        if getattr(module, "config", None) is shared:
            module.config = own


def positions_from_mask(stack: nn.Module) -> str | None:
    """The position table of the decoder stack that derives position ids from the attention mask when it gets none,
    as ``"Stack.name (Class)"``, or ``None`` for Transformers' usual ``0 .. length - 1``. Found by structure: a module
    directly in the stack that is an embedding table (``nn.Embedding``, looked up by index) and whose ``forward``
    takes ``attention_mask`` computes its indices from the mask (OPT's and BioGPT's learned positions count a
    left-padded row from its first real token). A stack that derives them in its own ``forward`` without such a table
    is not found; of Transformers' text causal LMs in 5.24 and 5.25, the one stack that does (OPT's) has one too.

    Args:
        stack: the model's decoder stack (:func:`decoder_stack`).
    """
    for name, module in stack.named_children():
        if isinstance(module, nn.Embedding) and "attention_mask" in inspect.signature(module.forward).parameters:
            return f"{type(stack).__name__}.{name} ({type(module).__name__})"
    return None


def _describe(value: Any) -> str:
    return f"shape {tuple(value.shape)}" if isinstance(value, torch.Tensor) else f"a {type(value).__name__}"


__all__ = [
    "ATTENTION_LAYER_TYPES",
    "INNER_MASK_FORMATS",
    "BatchSplit",
    "ContextParallel",
    "context_parallel_problem",
    "gathered_positions",
    "install_context_parallel",
    "local_positions",
    "padded_length",
    "piece_starts",
]
