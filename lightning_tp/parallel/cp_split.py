"""Context parallelism's split of a sequence: where each rank's tokens lie (pure functions of the lengths, tested on
their own), the per-forward state (:class:`ForwardState`, found through a context variable) and the mask each layer
gets (:class:`SplitMask`), and the sequence's gather with its gradient. See
:mod:`lightning_tp.parallel.context_parallel`.
"""

from __future__ import annotations

import contextvars
import functools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from lightning_tp.parallel.blockwise import RangeMask, first_keys

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
CURRENT_FORWARD: contextvars.ContextVar[ForwardState | None] = contextvars.ContextVar(
    "lightning_tp_cp_forward", default=None
)


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
    (:func:`host_copies`), so that the masks' ranges and tiles read nothing from the device."""

    cp: Any  # the model's `context_parallel.ContextParallel` (which imports this module)
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

    cp: Any  # the model's `context_parallel.ContextParallel` (which imports this module)
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


class GatherSequence(torch.autograd.Function):
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
# Helpers


@functools.lru_cache(maxsize=8)
def rank_layout(padded: int, size: int, rank: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """On the host, for a padded length: this rank's positions, the gathered index of each global position and the
    global position of each gathered index. The last few lengths' are kept (dynamic padding makes a length per
    batch)."""
    gathered = gathered_positions(padded, size)
    return local_positions(padded, size, rank), torch.argsort(gathered), gathered


def host_copies(*tensors: torch.Tensor | None) -> list[torch.Tensor | None]:
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


def split_first_keys(function: Callable, split: BatchSplit, *, batch: int) -> tuple[torch.Tensor, torch.Tensor]:
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


def pad_sequence(tensor: torch.Tensor, length: int, *, value: Any) -> torch.Tensor:
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


def whole_positions(
    position_ids: torch.Tensor | None, batch: int, length: int, padded: int, device: torch.device
) -> torch.Tensor:
    """The position ids of the whole (padded) sequence: as given, or ``0 .. length - 1`` as Transformers counts them
    without a cache; the padding repeats the last position (a causal mask hides it, and learned position tables end
    at the model's longest sequence)."""
    if position_ids is None:
        return pad_sequence(torch.arange(length, device=device).unsqueeze(0), padded, value=None)
    if position_ids.ndim != 2 or position_ids.shape[-1] != length:
        raise ValueError(
            f"Context parallelism takes `position_ids` of shape (batch, seq) with seq = {length}, got shape "
            f"{tuple(position_ids.shape)} (multi-axis positions such as M-RoPE's are not supported)."
        )
    return pad_sequence(position_ids, padded, value=None)


__all__ = [
    "ATTENTION_LAYER_TYPES",
    "BatchSplit",
    "CURRENT_FORWARD",
    "ForwardState",
    "Piece",
    "SplitMask",
    "gathered_positions",
    "local_positions",
    "padded_length",
    "piece_starts",
]
