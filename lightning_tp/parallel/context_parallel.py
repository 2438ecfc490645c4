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
reduce-scatters their gradients), and the rank's queries attend to them by tiles, with an online-softmax merge
(:mod:`lightning_tp.parallel.blockwise`): no score or mask larger than a tile is ever made, a tile no query can see
(another document of a packed row, keys beyond a sliding window, padding) is skipped, and the forward keeps ``O(L)``
per layer for the backward. The masks are the model's own: its mask functions (causal, sliding window, chunked, with
the padding mask and packed documents added as Transformers adds them) are read as one interval of keys per query,
found by bisection. Softcapping, attention sinks, the scale and dropout are the layer's (the arguments it passes its
attention function). This is done by registering an attention and a mask implementation (Transformers'
``AttentionInterface``/``AttentionMaskInterface``, undone on teardown), not by replacing any ``forward``; the mask
each layer gets is a :class:`SplitMask`, the forward's ranges, handed on unchanged as Transformers hands on
``flex_attention``'s block masks. torch's ring attention (``torch.distributed.tensor.experimental.context_parallel``)
is not used: in torch 2.13 it has no CPU/gloo path, no packed documents, and it replaces SDPA for the whole region.

Packed rows follow Transformers' rule, so that the split computes what one process computes: documents (``position_ids``
restarting, no ``attention_mask``) are told apart only in a forward that makes no cache (``use_cache=False``); with a
cache (the config's default ``use_cache=True``) one process attends across them, and so does the split, with one
warning.

The loss: the model's causal-LM loss gets the labels of the whole sequence, shifted before the split (the label of a
piece's last token is the first token of the next piece, on another rank), and normalised by the count of labelled
tokens of the whole sequence; the ranks' partial losses are summed, so ``outputs.loss`` is the loss of the whole
sequence on every rank. FSDP2 averages gradients over ``dp_shard x cp``; the sum's backward multiplies by ``cp`` so
that the CP ranks' contributions add up instead.

State: what one forward needs lives in one :class:`ForwardState`, made by the pre-hook of the model users call and
found through a context variable (the loss and the mask implementation are called by Transformers, not by this
module); the mask carries the forward's split into the layers, so an activation-checkpointing recompute in the
backward needs nothing else. A deep copy of the model (an EMA or reference model) gets a split of its own.

Decoding with a cache (``generate``) runs without the split: every rank of the group decodes the whole sequence.
"""

from __future__ import annotations

import contextvars
import copy
import functools
import inspect
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from lightning_tp.compat import (
    attention_implementation,
    register_attention_implementation,
    set_attention_implementation,
)
from lightning_tp.parallel.blockwise import RangeMask, Scores, blockwise_attention, first_keys, interval_violations
from lightning_tp.parallel.blockwise import range_mask as make_range_mask
from lightning_tp.parallel.collectives import SumOverGroup
from lightning_tp.parallel.ring import ring_attention

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
#: Causal LMs whose layers call Transformers' attention interface although their class does not declare it
#: (``is_backend_compatible()`` is False in Transformers 5.24 and 5.25), at parity with cp 2 in the coverage run
#: (``benchmarks/coverage.py``). Keyed by the model class's own name: a subclass under another name is refused like any
#: undeclared model. The first split forward still checks that every decoder layer called the interface.
UNDECLARED_ATTENTION_INTERFACE = frozenset({"BioGptForCausalLM", "StableLmForCausalLM"})
#: The implementations registered here are named this, then the inner implementation's name (``..._sdpa``): the one
#: a forward that is not split (decoding with a cache) runs, and whose rules the split follows.
NAME_PREFIX = "lightning_tp_cp_"
#: The attention functions' keyword arguments for attention sinks (gpt-oss's ``s_aux``, Inkling's ``sinks``): one
#: logit per head, with no value, in every query's softmax.
SINK_ARGUMENTS = ("s_aux", "sinks")
#: Attention arguments the split cannot honour: a bias over scores (T5-style ``position_bias``) and attention weights.
UNSUPPORTED_ARGUMENTS = ("position_bias", "head_mask")
#: Sequence dim of the activations (batch, seq, ...) and of the attention's keys (batch, heads, seq, head_dim).
SEQUENCE_DIM = 1
KEY_SEQUENCE_DIM = 2

#: The forward of a split model running now (set by the pre-hook of the model users call, reset by its hook).
_FORWARD: contextvars.ContextVar[ForwardState | None] = contextvars.ContextVar("lightning_tp_cp_forward", default=None)


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


@dataclass(eq=False)
class BatchSplit:
    """One forward's split of its batch: lengths, this rank's positions, the whole sequence's position ids, packed
    documents and padding, and what its attention layers did (for the first forward's checks).

    What the tiles are cut from is on the host (``host_*``, ``doc_ids``): copied from the device once per forward
    (:func:`_host_copies`), so that the masks' ranges and tiles read nothing from the device."""

    cp: ContextParallel
    seq_len: int
    padded_len: int
    positions: torch.Tensor  # (local_len,) global index of each local token
    order: torch.Tensor  # gathered index of each global position
    gathered: torch.Tensor  # global position of each gathered index
    pieces: tuple[Piece, ...]
    position_ids: torch.Tensor  # (batch, padded_len) the whole sequence's
    host_positions: torch.Tensor  # `positions` on the host
    host_position_ids: torch.Tensor  # `position_ids` on the host
    doc_ids: torch.Tensor | None = None  # (batch, padded_len) on the host: which packed document each token is of
    valid: torch.Tensor | None = None  # (batch, padded_len): the keys that are not padding (None: all are)
    host_valid: torch.Tensor | None = None  # `valid` on the host
    called: set[int] = field(default_factory=set)
    problems: list[str] = field(default_factory=list)  # masks that are not one interval of keys per query

    @property
    def local_len(self) -> int:
        return self.positions.numel()

    def local(self, tensor: torch.Tensor) -> torch.Tensor:
        """This rank's tokens of a ``(batch, padded_len, ...)`` tensor."""
        return tensor.index_select(SEQUENCE_DIM, self.positions.to(tensor.device))


@dataclass(frozen=True, eq=False)
class SplitMask:
    """The mask a layer gets in a split forward: the forward's split, and the keys each of this rank's queries sees
    under one of the model's masks (full, sliding window, chunked), as ranges and tiles. Handed to the attention
    function unchanged; it is never a tensor, so no layer can use it as one by mistake."""

    split: BatchSplit
    ranges: RangeMask


@dataclass(eq=False)
class ForwardState:
    """One forward of a split model, from the pre-hook of the model users call to its hook: whether it computes a
    loss, whether it runs unsplit (a cache, or only the last positions' logits), and its split once the decoder stack
    made it."""

    cp: ContextParallel
    labelled: bool = False
    unsplit: bool = False
    split: BatchSplit | None = None
    entered: bool = False
    #: What the context variable held before this forward (restored at its end: a split model's forward may run
    #: inside another's), and whether the decoder stack made the state (called directly, not through the model).
    token: contextvars.Token | None = None
    direct: bool = False


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
    if not _runs_inside(implementation):
        return (
            f"{name} uses attn_implementation={implementation!r}, which is not one of Transformers' attention "
            "implementations that context parallelism runs inside (its tiles replace the attention of a split "
            'forward; a forward that decodes runs the model\'s own). Load the model with `attn_implementation="sdpa"`'
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


def _runs_inside(implementation: str | None) -> bool:
    """Whether context parallelism can register itself around ``implementation``: ``eager`` or a name Transformers'
    attention interface holds (``sdpa``, ``flash_attention_2``, ``flex_attention``, ...), not a split's own."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    if not isinstance(implementation, str) or implementation.startswith(NAME_PREFIX):
        return False
    return implementation == "eager" or implementation in ALL_ATTENTION_FUNCTIONS


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
    forward. What lives longer than a forward is fixed at install (the group, sizes, names) or a check done once (the
    first split forward's).
    """

    def __init__(
        self, model: nn.Module, stack: nn.Module, mesh: Any, *, multiple: int, blocks: set[type], comm: str
    ) -> None:
        self.group = mesh.get_group()
        self.comm = comm
        self.size = mesh.size()
        self.rank = mesh.get_local_rank()
        assert multiple % (2 * self.size) == 0, (multiple, self.size)
        self.multiple = multiple
        self.inner = attention_implementation(model.config)
        self.name = f"{NAME_PREFIX}{self.inner}"
        self.blocks = blocks
        self.stack_name = type(stack).__name__
        self.rows_checked = False  # the first split forward checks the ranks' rows, then the layers and masks
        self.layers_checked = False
        self.warned_packed = False
        self._forward_parameters = inspect.signature(stack.forward).parameters
        self._positions_from_mask = positions_from_mask(stack)

    def __deepcopy__(self, memo: dict) -> ContextParallel:
        """A deep copy of the model (an EMA or reference model) gets a split of its own: the same group and sizes (a
        process group is not copied), its own checks; nothing of a forward is shared."""
        other = copy.copy(self)
        memo[id(self)] = other
        return other

    def register(self, owner: nn.Module) -> None:
        """The attention and mask implementations this split's config selects, registered for ``owner`` (a
        strategy's teardown gives them up; the next forward takes them again)."""
        attention, mask = _implementations(self.inner)
        register_attention_implementation(self.name, attention=attention, mask=mask, owner=owner)

    # --------------------------------------------------------------- the model users call

    def begin(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        """Forward pre-hook of the model users call: this forward's state. It computes a loss or not; it keeps the
        logits of its last positions only (``logits_to_keep``: ``generate`` without a cache, per-token
        log-probabilities of a completion), which are not this rank's to compute, and then runs unsplit."""
        self.register(module)
        keep = kwargs.get("logits_to_keep")
        state = ForwardState(
            self,
            labelled=kwargs.get("labels") is not None or kwargs.get("shift_labels") is not None,
            unsplit=keep is not None and not (isinstance(keep, int) and keep == 0),
        )
        state.token = _FORWARD.set(state)

    def end(self, module: nn.Module, args: tuple, kwargs: dict, output: Any) -> Any:
        """Forward hook of the model users call (run even when the forward raised): the forward's state dropped, and
        for a split forward without labels, which computes no loss, the logits of the whole sequence (padding
        removed) on every rank, differentiably (a loss computed from them on every rank of the group gets the
        gradient of one copy once FSDP2 averages). With labels they stay this rank's, the point of the split."""
        state = _FORWARD.get()
        if state is None or state.cp is not self or state.direct:
            return output
        _FORWARD.reset(state.token)
        if output is None:  # the forward raised
            return output
        if not state.entered:
            raise ValueError(
                f"Context parallelism: {type(module).__name__}'s forward did not call {self.stack_name}, whose inputs "
                "the split cuts; this model's forward is not Transformers' usual one. Run it without `cp_size`."
            )
        split = state.split
        if split is None or state.labelled:
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

    # --------------------------------------------------------------- the decoder stack's inputs

    def split_inputs(self, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        """Forward pre-hook of the decoder stack: this rank's tokens, the whole sequence's positions and padding."""
        state = _FORWARD.get()
        if state is None or state.cp is not self:  # the stack called directly, not through the model: no labels
            self.register(module)
            state = ForwardState(self, direct=True)
            state.token = _FORWARD.set(state)
        state.entered = True
        if args:  # called positionally: name the arguments as the forward does
            kwargs = {**dict(zip(self._forward_parameters, args, strict=False)), **kwargs}
            args = ()
        if any(kwargs.get(name) is not None for name in CACHE_INPUTS) or kwargs.get("use_cache") or state.unsplit:
            # Decoding (a cache, one asked for, or the last positions' logits): the whole sequence on every rank.
            state.split = None
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
        host_positions, *layout = _layout(padded, self.size, self.rank)
        # Copied without waiting for the device (from pageable memory, staged at once): no host synchronisation.
        positions, order, gathered = (t.to(device, non_blocking=True) for t in (host_positions, *layout))
        position_ids = _whole_positions(kwargs.get("position_ids"), batch, length, padded, device)
        if attention_mask is not None and (
            not isinstance(attention_mask, torch.Tensor) or tuple(attention_mask.shape) != (batch, length)
        ):
            raise ValueError(
                "Context parallelism takes a 2-D padding `attention_mask` of shape (batch, seq) = "
                f"{(batch, length)}, got {_describe(attention_mask)}: a prepared (4-D or per-layer) mask cannot be "
                "split. Pass the padding mask, or `position_ids` restarting at 0 for packed sequences."
            )
        given_ids, host_mask = _host_copies(kwargs.get("position_ids"), attention_mask)  # the forward's one read
        host_position_ids = _whole_positions(given_ids, batch, length, padded, torch.device("cpu"))
        doc_ids = valid = host_valid = None
        if attention_mask is None:
            doc_ids = self._documents(module, kwargs, host_position_ids[:, :length].expand(batch, -1))
            if doc_ids is not None:  # each padding token a document of its own: it sees itself only
                pad = torch.arange(1, padded - length + 1)
                doc_ids = torch.cat([doc_ids, doc_ids[:, -1:] + pad], dim=SEQUENCE_DIM)
        else:
            # The padding at the end is visible (a causal mask hides it from every real token already).
            valid = nn.functional.pad(attention_mask.to(torch.bool), (0, padded - length), value=True)
            host_valid = nn.functional.pad(host_mask.to(torch.bool), (0, padded - length), value=True)
        piece = padded // (2 * self.size)
        starts = piece_starts(padded, self.size, self.rank)
        split = BatchSplit(
            cp=self,
            seq_len=length,
            padded_len=padded,
            positions=positions,
            order=order,
            gathered=gathered,
            pieces=(Piece(0, starts[0], piece), Piece(piece, starts[1], piece)),
            position_ids=position_ids,
            host_positions=host_positions,
            host_position_ids=host_position_ids,
            doc_ids=doc_ids,
            valid=valid,
            host_valid=host_valid,
        )
        state.split = split
        if kwargs.get("input_ids") is not None:
            kwargs["input_ids"] = split.local(_pad_sequence(kwargs["input_ids"], padded, value=0))
        else:
            kwargs["inputs_embeds"] = split.local(_pad_sequence(kwargs["inputs_embeds"], padded, value=0.0))
        kwargs["position_ids"] = split.local(position_ids)
        # The whole sequence's padding mask: Transformers sizes the keys from it (kv_length = padded), and makes no
        # packed-document mask of its own (the split's `doc_ids` are).
        kwargs["attention_mask"] = (
            torch.ones(batch, padded, dtype=torch.bool, device=device) if valid is None else valid
        )
        if "use_cache" in self._forward_parameters:
            kwargs["use_cache"] = False  # a cache would hold the local keys only
        return args, kwargs

    def _documents(self, stack: nn.Module, kwargs: dict, position_ids: torch.Tensor) -> torch.Tensor | None:
        """The packed documents of a batch without a padding mask, as one process tells them apart: Transformers
        does only in a forward that makes no cache (``use_cache`` False, given or the config's); with a cache its
        forward attends across them, and so does the split's, with one warning."""
        from transformers.masking_utils import find_packed_sequence_indices

        doc_ids = find_packed_sequence_indices(position_ids)
        if doc_ids is None:
            return None
        use_cache = kwargs.get("use_cache")  # False, or None: not asked for (True runs unsplit), the config's then
        if use_cache is None:
            use_cache = bool(getattr(getattr(stack, "config", None), "use_cache", False))
        if getattr(stack, "gradient_checkpointing", False) and stack.training:
            use_cache = False  # Transformers turns the cache off under its own gradient checkpointing
        if not use_cache:
            return doc_ids
        if not self.warned_packed:
            self.warned_packed = True
            warnings.warn(
                "Context parallelism: the position ids restart within a row (packed documents), but the forward makes "
                "a cache (`use_cache=True`, the config's default), and Transformers then attends across the "
                "documents: on one process and so under `cp_size` too. Pass `use_cache=False` to the model (or set "
                "`model.config.use_cache = False`) to keep each document to itself; context parallelism then also "
                "skips the attention between documents.",
                stacklevel=2,
            )
        return None

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

    def end_direct(self, module: nn.Module, args: tuple, kwargs: dict, output: Any) -> Any:
        """Forward hook of the decoder stack (run even when the forward raised): the state of a stack called
        directly dropped."""
        state = _FORWARD.get()
        if state is not None and state.cp is self and state.direct:
            _FORWARD.reset(state.token)
        return output

    def check_layers(self, module: nn.Module, args: tuple, kwargs: dict, output: Any) -> Any:
        """Forward hook of the decoder stack: after the first split forward, every decoder layer must have exchanged
        keys and values (a layer that mixes the sequence some other way saw its chunk only), and every mask must have
        been one interval of keys per query. The ranks decide together (each checked its own queries)."""
        state = _FORWARD.get()
        split = None if state is None or state.cp is not self else state.split
        if self.layers_checked or split is None:
            return output
        layers = {name: layer for name, layer in module.named_modules() if type(layer) in self.blocks}
        missing = [
            f"{name} ({type(layer).__name__})"
            for name, layer in layers.items()
            if not any(id(m) in split.called for m in layer.modules())
        ]
        flag = torch.tensor([int(bool(split.problems))], dtype=torch.int32, device=split.positions.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.group)
        if flag.item():
            raise ValueError(
                "Context parallelism: this model's attention mask does not let each query see one interval of keys "
                f"ending at itself ({split.problems[0] if split.problems else 'on another rank of the group'}); "
                "the split computes causal, sliding-window, chunked and packed-document masks only. This model "
                "cannot run with `cp_size > 1`."
            )
        if missing:
            raise ValueError(
                f"Context parallelism: the decoder layers {missing[:4]}{' ...' if len(missing) > 4 else ''} did not "
                "call Transformers' attention interface with the split mask, so they mixed each rank's chunk of the "
                "sequence alone (linear attention, state-space or convolution layers, or attention code of their "
                "own). This model cannot run with `cp_size > 1`."
            )
        self.layers_checked = True
        return output

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
        """The mask of a split forward (:func:`_mask` calls it): the keys each of this rank's queries sees under
        ``mask_function``, with the split's padding and packed documents, as a :class:`SplitMask`."""
        from transformers.masking_utils import (
            and_masks,
            packed_sequence_mask_function,
            remap_positions_for_packed_sequence,
        )

        split = _FORWARD.get().split
        if (q_length, kv_length, q_offset, kv_offset) != (split.local_len, split.padded_len, 0, 0):
            raise ValueError(
                f"Context parallelism: the model asked for a mask of {q_length} queries (offset {q_offset}) and "
                f"{kv_length} keys (offset {kv_offset}), where the split has {split.local_len} local queries and "
                f"{split.padded_len} keys. Its mask code is not Transformers' standard one."
            )
        function = mask_function
        if split.doc_ids is not None:  # as Transformers does for packed rows: positions within each document
            function = and_masks(
                remap_positions_for_packed_sequence(function, split.host_position_ids),
                packed_sequence_mask_function(split.doc_ids),
            )
        try:
            low, positions = _first_keys(function, split, batch=batch_size)
            if not self.layers_checked:  # decided with the other ranks at the end of the first split forward
                problem = interval_violations(function, positions, low, key_length=split.padded_len)
                if problem is not None:
                    split.problems.append(problem)
            low = low.cpu()  # on the host already, but where the function holds the device's tensors
        except Exception as err:  # an overlay that is not index-based (Transformers would vmap it)
            raise ValueError(
                "Context parallelism evaluates the model's mask functions on index tensors; this model's mask "
                f"function could not be ({type(err).__name__}: {err})."
            ) from err
        piece = split.pieces
        ranges = make_range_mask(
            positions=split.host_positions,
            low=low,
            valid=split.host_valid,
            pieces=[(p.local_start, p.global_start, p.length) for p in piece],
            key_length=split.padded_len,
            piece_count=2 * self.size,
            device=split.positions.device,
        )
        return SplitMask(split, ranges)

    def attention(
        self,
        module: nn.Module,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: Any,
        scaling: float | None = None,
        dropout: float = 0.0,
        softcap: float | None = None,
        **kwargs: Any,
    ) -> tuple[torch.Tensor, None]:
        """The attention of a split forward (:func:`_attention` calls it): this rank's queries against the whole
        sequence's keys and values by tiles (:func:`lightning_tp.parallel.blockwise.blockwise_attention`), with the
        layer's scale, softcapping, sinks and dropout.

        Raises:
            ValueError: when the layer passes what the tiles cannot honour (a score bias, attention weights), softcaps
                under ``sdpa``, or is not causal.
        """
        name = type(module).__name__
        if not getattr(module, "is_causal", True):
            raise ValueError(
                f"Context parallelism: {name} attends bidirectionally (`is_causal=False`), which the load-balanced "
                "split does not support."
            )
        unsupported = [arg for arg in UNSUPPORTED_ARGUMENTS if kwargs.get(arg) is not None]
        if kwargs.get("output_attentions"):
            unsupported.append("output_attentions")
        if unsupported:
            raise ValueError(
                f"Context parallelism: {name} passes its attention {unsupported}, which the split's tiles do not "
                "compute (no score matrix is ever whole). Run this model without `cp_size`."
            )
        if softcap is not None and self.inner == "sdpa":
            raise ValueError(
                f"Context parallelism: {name} softcaps its scores, which `sdpa` does not do (on one process it raises "
                'too). Load the model with `attn_implementation="eager"`.'
            )
        split = attention_mask.split
        if query.shape[KEY_SEQUENCE_DIM] != split.local_len:
            raise ValueError(
                f"Context parallelism: {name} got {query.shape[KEY_SEQUENCE_DIM]} queries, where this rank holds "
                f"{split.local_len} tokens."
            )
        split.called.add(id(module))
        sinks = _sinks(kwargs)
        if sinks is not None and self.inner == "sdpa":
            sinks = None  # Transformers' `sdpa` ignores them: so does the split, to compute what one process does
        seed = int(torch.empty((), dtype=torch.int64).random_()) if dropout else 0
        scores = Scores(
            scale=query.shape[-1] ** -0.5 if scaling is None else float(scaling),
            softcap=softcap,
            dropout=float(dropout),
            seed=seed,
        )
        if self.comm == "ring":
            piece = split.pieces[0].length
            pieces = [
                [(start, piece) for start in piece_starts(split.padded_len, self.size, rank)]
                for rank in range(self.size)
            ]
            out = ring_attention(
                query, key, value, attention_mask.ranges, scores=scores, sinks=sinks, group=self.group, pieces=pieces
            )
        else:
            keys, values = self._gather(key, value, split)
            out = blockwise_attention(query, keys, values, attention_mask.ranges, scores=scores, sinks=sinks)
        return out.transpose(1, 2).contiguous(), None  # (batch, local_len, heads, head_dim), as Transformers' return

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


def _causal_lm_loss(inner: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    """The causal-LM loss of the whole sequence from this rank's logits in a split forward: labels shifted before the
    split, normalised by the whole sequence's labelled tokens, the ranks' partial sums added; ``inner`` otherwise. It
    finds the forward through its state (the loss is called by the model's forward), so a deep copy of the model
    shares it safely."""

    def context_parallel_loss(
        logits: torch.Tensor,
        labels: torch.Tensor | None,
        vocab_size: int | None = None,
        num_items_in_batch: torch.Tensor | int | None = None,
        ignore_index: int = -100,
        shift_labels: torch.Tensor | None = None,
        **kwargs: Any,
    ) -> torch.Tensor:
        state = _FORWARD.get()
        split = None if state is None else state.split
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
        return SumOverGroup.apply(partial, state.cp.group, state.cp.size)

    return context_parallel_loss


def install_context_parallel(
    model: nn.Module,
    mesh: Any,
    *,
    multiple: int,
    blocks: set[type],
    outers: tuple[nn.Module, ...] = (),
    comm: str = "all_gather",
) -> ContextParallel:
    """Split ``model``'s sequences over the 1-D CP ``mesh``: the attention and mask implementations registered for
    it, the decoder stack's hooks, the loss, the logits of forwards without labels. ``outers``: the modules whose
    calls run the model's forward (default: the model), when others do: a ``PeftModel``, which calls the model's
    ``forward`` directly, past its hooks; a pipeline's stages, each of which runs the model's forward on its layers.
    ``comm``: how keys and values are exchanged (``"all_gather"`` or ``"ring"``: :mod:`lightning_tp.parallel.ring`).
    ``model`` passed :func:`context_parallel_problem`."""
    base = decoder_stack(model, blocks)
    cp = ContextParallel(model, base, mesh, multiple=multiple, blocks=blocks, comm=comm)
    cp.register(model)
    # The model's modules read the implementation from the config at every forward. A config is often shared (two
    # models built from one object: a policy and its frozen reference), so this model gets its own copy first.
    _own_config(model)
    set_attention_implementation(model.config, cp.name)
    # The hooks below hold the split: it lives and dies with the model (and a deep copy of the model gets its own).
    base.register_forward_pre_hook(cp.split_inputs, with_kwargs=True)
    base.register_forward_hook(cp.check_layers, with_kwargs=True)
    base.register_forward_hook(cp.end_direct, with_kwargs=True, always_call=True)
    model.loss_function = _causal_lm_loss(model.loss_function)
    for outer in outers or (model,):
        outer.register_forward_pre_hook(cp.begin, with_kwargs=True)
        outer.register_forward_hook(cp.end, with_kwargs=True, always_call=True)
    return cp


# ---------------------------------------------------------------------------------------------------------------------
# Helpers


@functools.lru_cache(maxsize=8)
def _layout(padded: int, size: int, rank: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """On the host, for a padded length: this rank's positions, the gathered index of each global position and the
    global position of each gathered index. The last few lengths' are kept (dynamic padding makes a length per
    batch)."""
    gathered = gathered_positions(padded, size)
    return local_positions(padded, size, rank), torch.argsort(gathered), gathered


def _host_copies(*tensors: torch.Tensor | None) -> list[torch.Tensor | None]:
    """``tensors`` (the batch's position ids and padding mask, each ``(batch, seq)`` or ``None``) on the host, for the
    tiles of a split forward: one copy from the device for all of them (the forward's one host synchronisation),
    none for a batch on the host already."""
    on_device = [t for t in tensors if t is not None and t.device.type != "cpu"]
    if not on_device:
        return list(tensors)
    flat = torch.cat([t.to(on_device[0].device, torch.long).flatten() for t in on_device]).cpu()
    parts = flat.split([t.numel() for t in on_device])
    copies = iter(part.view(t.shape) for part, t in zip(parts, on_device, strict=True))
    return [next(copies) if t is not None and t.device.type != "cpu" else t for t in tensors]


def _first_keys(function: Callable, split: BatchSplit, *, batch: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The first key each query sees under ``function`` and the positions it was found at: on the host, from the
    split's host copies, so that nothing is read from the device. A mask function that holds tensors of the device
    (Llama 4's chunks start after each row's left padding, which Transformers counts on the device) is evaluated
    there instead, and its first keys are read once (a host synchronisation per such mask and forward)."""
    try:
        low = first_keys(function, split.host_positions, batch=batch, key_length=split.padded_len)
        return low, split.host_positions
    except (RuntimeError, NotImplementedError):  # tensors of two devices in one operation
        if split.positions.device.type == "cpu":
            raise
    low = first_keys(function, split.positions, batch=batch, key_length=split.padded_len)
    return low, split.positions


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


#: The registered implementations by inner implementation: one pair each, shared by every split model that runs
#: inside it (each finds its split through the forward's state or its mask).
_REGISTERED: dict[str, tuple[Callable[..., Any], Callable[..., Any]]] = {}


def _implementations(inner: str) -> tuple[Callable[..., Any], Callable[..., Any]]:
    if inner not in _REGISTERED:
        _REGISTERED[inner] = (functools.partial(_attention, inner), functools.partial(_mask, inner))
    return _REGISTERED[inner]


def _mask(inner: str, **kwargs: Any) -> Any:
    """The mask interface: a split forward's :class:`SplitMask`, or the inner implementation's own mask."""
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS

    state = _FORWARD.get()
    if state is None or state.split is None:
        return ALL_MASK_ATTENTION_FUNCTIONS[inner](**kwargs)
    return state.cp.mask(**kwargs)


def _attention(
    inner: str,
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: Any,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """The attention interface: a split forward's tiles, or (decoding, or a forward keeping the last logits) the inner
    implementation. ``eager`` is no registered function (each layer passes its own as the default, which a registered
    name never gets): the same scores as the tiles', on the whole mask."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    if isinstance(attention_mask, SplitMask):
        return _split_attention(module, query, key, value, attention_mask, **kwargs)
    state = _FORWARD.get()
    if state is not None and state.split is not None:
        raise ValueError(
            f"Context parallelism: {type(module).__name__} got an attention mask that is not the split one "
            f"({_describe(attention_mask)}), so it would attend within its chunk only. Its layer prepares masks of "
            "its own; run this model without `cp_size`."
        )
    if inner != "eager":
        return ALL_ATTENTION_FUNCTIONS[inner](module, query, key, value, attention_mask, **kwargs)
    return _eager_attention(module, query, key, value, attention_mask, **kwargs)


@torch.compiler.disable
def _split_attention(
    module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: SplitMask, **kwargs: Any
) -> tuple[torch.Tensor, None]:
    """A split forward's attention, outside any compiled graph (``compile=True`` compiles each decoder layer around
    it): the tiles' number and masks follow each batch's documents and padding, and their kernels are fused already."""
    return mask.split.cp.attention(module, query, key, value, mask, **kwargs)


def _sinks(kwargs: dict[str, Any]) -> torch.Tensor | None:
    """The attention sinks a layer passes its attention function (:data:`SINK_ARGUMENTS`), or ``None``."""
    return next((kwargs[arg] for arg in SINK_ARGUMENTS if kwargs.get(arg) is not None), None)


def _eager_attention(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    softcap: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """Eager attention as the split computes it, on a whole (additive or boolean) mask: the layer's scale,
    softcapping, sinks and dropout, softmax in fp32."""
    groups = query.shape[1] // key.shape[1]
    if groups > 1:
        key, value = key.repeat_interleave(groups, 1), value.repeat_interleave(groups, 1)
    scale = query.shape[-1] ** -0.5 if scaling is None else scaling
    scores = torch.matmul(query, key.transpose(-1, -2)).float() * scale
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    if attention_mask is not None:
        mask = attention_mask[..., : key.shape[KEY_SEQUENCE_DIM]]
        scores = scores.masked_fill(~mask, -torch.inf) if mask.dtype == torch.bool else scores + mask.float()
    sinks = _sinks(kwargs)
    if sinks is not None:
        scores = torch.cat([scores, sinks.float().reshape(1, -1, 1, 1).expand(*scores.shape[:-1], 1)], dim=-1)
    probs = torch.nan_to_num(scores.softmax(-1), nan=0.0)
    if sinks is not None:
        probs = probs[..., :-1]
    probs = nn.functional.dropout(probs, p=dropout, training=dropout > 0).to(value.dtype)
    return torch.matmul(probs, value).transpose(1, 2).contiguous(), None


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
    "BatchSplit",
    "ContextParallel",
    "ForwardState",
    "SplitMask",
    "context_parallel_problem",
    "gathered_positions",
    "install_context_parallel",
    "local_positions",
    "padded_length",
    "piece_starts",
]
