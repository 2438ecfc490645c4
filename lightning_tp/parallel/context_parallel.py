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

import copy
import inspect
import warnings
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from lightning_tp.compat import (
    attention_implementation,
    register_attention_implementation,
    set_attention_implementation,
    set_loss_function,
)
from lightning_tp.parallel.blockwise import Scores, blockwise_attention, interval_violations
from lightning_tp.parallel.blockwise import range_mask as make_range_mask
from lightning_tp.parallel.collectives import SumOverGroup
from lightning_tp.parallel.cp_attention import describe, implementations, sinks_of
from lightning_tp.parallel.cp_checks import decoder_stack, positions_from_mask
from lightning_tp.parallel.cp_split import (
    CACHE_INPUTS,
    CURRENT_FORWARD,
    KEY_SEQUENCE_DIM,
    NAME_PREFIX,
    SEQUENCE_DIM,
    SEQUENCE_INPUTS,
    UNSUPPORTED_ARGUMENTS,
    BatchSplit,
    ForwardState,
    GatherSequence,
    Piece,
    SplitMask,
    host_copies,
    pad_sequence,
    padded_length,
    piece_starts,
    rank_layout,
    split_first_keys,
    whole_positions,
)
from lightning_tp.parallel.ring import ring_attention
from lightning_tp.patches import install

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
        attention, mask = implementations(self.inner)
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
        state.token = CURRENT_FORWARD.set(state)

    def end(self, module: nn.Module, args: tuple, kwargs: dict, output: Any) -> Any:
        """Forward hook of the model users call (run even when the forward raised): the forward's state dropped, and
        for a split forward without labels, which computes no loss, the logits of the whole sequence (padding
        removed) on every rank, differentiably (a loss computed from them on every rank of the group gets the
        gradient of one copy once FSDP2 averages). With labels they stay this rank's, the point of the split."""
        state = CURRENT_FORWARD.get()
        if state is None or state.cp is not self or state.direct:
            return output
        CURRENT_FORWARD.reset(state.token)
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
        state = CURRENT_FORWARD.get()
        if state is None or state.cp is not self:  # the stack called directly, not through the model: no labels
            self.register(module)
            state = ForwardState(self, direct=True)
            state.token = CURRENT_FORWARD.set(state)
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
        host_positions, *layout = rank_layout(padded, self.size, self.rank)
        # Copied without waiting for the device (from pageable memory, staged at once): no host synchronisation.
        positions, order, gathered = (t.to(device, non_blocking=True) for t in (host_positions, *layout))
        position_ids = whole_positions(kwargs.get("position_ids"), batch, length, padded, device)
        if attention_mask is not None and (
            not isinstance(attention_mask, torch.Tensor) or tuple(attention_mask.shape) != (batch, length)
        ):
            raise ValueError(
                "Context parallelism takes a 2-D padding `attention_mask` of shape (batch, seq) = "
                f"{(batch, length)}, got {describe(attention_mask)}: a prepared (4-D or per-layer) mask cannot be "
                "split. Pass the padding mask, or `position_ids` restarting at 0 for packed sequences."
            )
        given_ids, host_mask = host_copies(kwargs.get("position_ids"), attention_mask)  # the forward's one read
        host_position_ids = whole_positions(given_ids, batch, length, padded, torch.device("cpu"))
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
            kwargs["input_ids"] = split.local(pad_sequence(kwargs["input_ids"], padded, value=0))
        else:
            kwargs["inputs_embeds"] = split.local(pad_sequence(kwargs["inputs_embeds"], padded, value=0.0))
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
        state = CURRENT_FORWARD.get()
        if state is not None and state.cp is self and state.direct:
            CURRENT_FORWARD.reset(state.token)
        return output

    def check_layers(self, module: nn.Module, args: tuple, kwargs: dict, output: Any) -> Any:
        """Forward hook of the decoder stack: after the first split forward, every decoder layer must have exchanged
        keys and values (a layer that mixes the sequence some other way saw its chunk only), and every mask must have
        been one interval of keys per query. The ranks decide together (each checked its own queries)."""
        state = CURRENT_FORWARD.get()
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

        split = CURRENT_FORWARD.get().split
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
            low, positions = split_first_keys(function, split, batch=batch_size)
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
        sinks = sinks_of(kwargs)
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
        return GatherSequence.apply(local, dim, self.group, self.size, split.order, split.gathered)

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
        state = CURRENT_FORWARD.get()
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
        local = split.local(pad_sequence(shift_labels, split.padded_len, value=ignore_index))
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
    set_loss_function(model, _causal_lm_loss(model.loss_function), owner=model)
    for outer in outers or (model,):
        outer.register_forward_pre_hook(cp.begin, with_kwargs=True)
        outer.register_forward_hook(cp.end, with_kwargs=True, always_call=True)
    return cp


def _own_config(model: nn.Module) -> None:
    """Give ``model`` and its modules a copy of the config they share, so that changing it changes no other model:
    each module's ``config`` patched (:mod:`lightning_tp.patches`), owned by the model."""
    shared = model.config
    own = copy.deepcopy(shared)
    for module in model.modules():
        if vars(module).get("config") is shared:
            install(module, "config", own, owner=model)


__all__ = ["ContextParallel", "install_context_parallel"]
