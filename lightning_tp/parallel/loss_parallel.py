"""Loss parallelism: the cross-entropy of a causal LM computed on vocabulary-sharded logits.

With tensor parallelism the ``lm_head`` is sharded column-wise, so each TP rank computes the logits of its own slice
of the vocabulary. Transformers' native TP plans gather them (``colwise_gather_output``), so that every rank holds the
full ``(batch, seq, vocab)`` logits, its fp32 upcast and the gradient of both: for a large vocabulary the largest
activations of the step. Here the logits stay sharded (:func:`lm_head_style`) and the cross-entropy runs on the shards
(:func:`vocab_parallel_cross_entropy`, Megatron's algorithm): each rank only ever holds its slice of the vocabulary,
and only per-token scalars cross the network.

Why not torch's ``torch.distributed.tensor.parallel.loss_parallel()``: its results are right (uneven shards included,
torch 2.13), but it is a context manager that must surround both the forward and the ``backward()``, which Lightning
calls away from the user's ``training_step`` (outside it, the backward raises "got mixed torch.Tensor and DTensor"),
and its loss is a DTensor, which Lightning's logging and loss accumulation do not expect. Ours is an ordinary autograd
function on the local shards: a plain tensor loss, two all-reduces of one float per token in the forward (torch's
issues three), none in the backward, and no DTensor dispatch.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel
from torch.distributed.tensor.placement_types import Placement

from lightning_tp.compat import (
    assert_async,
    causal_lm_loss_function,
    compute_local_shape_and_global_offset,
    set_loss_function,
)
from lightning_tp.plans.resolved import ResolvedPlan
from lightning_tp.plans.rewrite import rewrite_output_head

_REDUCTIONS = ("mean", "sum", "none")


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Per-row cross-entropy of ``(rows, local_vocab)`` logits whose columns are this rank's slice of the vocabulary,
    starting at ``vocab_start``. Returns the fp32 loss per row (0 for ignored rows), identical on every rank."""

    @staticmethod
    def forward(ctx, logits, labels, vocab_start, ignore_index, group):  # type: ignore[override]
        local_vocab = logits.shape[-1]
        # fp32 from here on: bf16 exp-sums over a large vocabulary lose the loss's precision. One fp32 copy of the
        # shard, worked on in place: the upcast when there is one, else a copy (fp32 logits belong to autograd).
        row_max = logits.amax(dim=-1).float()
        dist.all_reduce(row_max, op=dist.ReduceOp.MAX, group=group)
        if logits.dtype == torch.float32:
            shifted = logits - row_max.unsqueeze(-1)
        else:
            shifted = logits.float().sub_(row_max.unsqueeze(-1))

        # Only the rank whose slice holds a row's label contributes its logit (0 elsewhere, and for ignored rows).
        local_labels = labels - vocab_start
        owned = (labels != ignore_index) & (local_labels >= 0) & (local_labels < local_vocab)
        local_labels = torch.where(owned, local_labels, 0)
        target = torch.where(owned, shifted.gather(-1, local_labels.unsqueeze(-1)).squeeze(-1), 0.0)

        exp = shifted.exp_()
        # One all-reduce for both sums: both are one float per row, and the call's latency dominates.
        sums = torch.stack([exp.sum(dim=-1), target])
        dist.all_reduce(sums, op=dist.ReduceOp.SUM, group=group)
        sum_exp, target = sums[0], sums[1]

        valid = labels != ignore_index
        loss = torch.where(valid, torch.log(sum_exp) - target, 0.0)
        softmax = exp.div_(sum_exp.unsqueeze(-1))
        ctx.save_for_backward(softmax, local_labels, owned, valid)
        ctx.logits_dtype = logits.dtype
        ctx.consumed = False
        return loss

    @staticmethod
    def backward(ctx, grad_loss):  # type: ignore[override]
        # d loss / d logits = (softmax - one_hot(label)) * grad: local to each rank's columns, so no collective.
        if ctx.consumed:
            raise RuntimeError(
                "vocab_parallel_cross_entropy: a second backward through the same loss (`retain_graph=True`) is not "
                "supported: the first one reused the saved softmax as the fp32 gradient, to save a copy of the shard."
            )
        softmax, local_labels, owned, valid = ctx.saved_tensors
        grad_row = torch.where(valid, grad_loss, 0.0).unsqueeze(-1)  # ignored rows: 0, even when grad_loss is inf
        # The label's column, in fp32 so that every gradient is rounded once to the logits' dtype.
        at_label = softmax.gather(-1, local_labels.unsqueeze(-1))
        at_label = (at_label - owned.unsqueeze(-1).float()) * grad_row
        if ctx.logits_dtype == torch.float32:
            ctx.consumed = True
            grad = softmax.mul_(grad_row)  # in place: the softmax is no longer needed, one shard saved
        else:
            grad = torch.empty_like(softmax, dtype=ctx.logits_dtype)
            torch.mul(softmax, grad_row, out=grad)  # straight to bf16: no fp32 gradient next to the fp32 softmax
        grad.scatter_(-1, local_labels.unsqueeze(-1), at_label.to(grad.dtype))
        return grad, None, None, None, None


def vocab_parallel_cross_entropy(
    logits: torch.Tensor,
    labels: torch.Tensor,
    *,
    ignore_index: int = -100,
    reduction: str = "mean",
    group: dist.ProcessGroup | None = None,
    vocab_start: int | None = None,
    vocab_size: int | None = None,
) -> torch.Tensor:
    """Cross-entropy of logits sharded on the vocabulary (last) dimension, as ``F.cross_entropy`` on the full logits.
    Gradients reach ``logits`` in their own layout and dtype. Every rank of the logits' group must call it.

    Args:
        logits: ``(..., vocab)``, either a DTensor sharded on its last dim over a 1-D mesh (shards may be uneven), or
            this rank's local ``(..., local_vocab)`` slice with ``group`` and ``vocab_start``.
        labels: ``(...)`` class indices, the same on every rank.
        ignore_index: the label of positions that count for nothing.
        reduction: ``"mean"`` over non-ignored rows (nan when all are ignored, as torch), ``"sum"``, or ``"none"``
            (per row, 0 on ignored rows).
        group: the ranks holding the other slices, for plain-tensor ``logits`` (a DTensor carries its own).
        vocab_start: the vocabulary index of this rank's first column, for plain-tensor ``logits``.
        vocab_size: the full vocabulary, to check the labels against (a DTensor knows it).

    Returns:
        A plain fp32 tensor, the same on every rank.

    Raises:
        ValueError: an unknown ``reduction``; plain logits without ``group`` and ``vocab_start``, or a DTensor with
            them, or one not sharded on its last dim over a 1-D mesh; ``labels`` whose shape is not the logits'
            without the vocabulary dim; a ``vocab_size`` other than the logits' classes.
        RuntimeError: a label outside the vocabulary, where its size is known (a DTensor's, or ``vocab_size``): an
            asynchronous assert, as ``F.cross_entropy``'s on a GPU.
    """
    if reduction not in _REDUCTIONS:
        raise ValueError(f"vocab_parallel_cross_entropy: `reduction={reduction!r}` is not one of {_REDUCTIONS}.")
    if isinstance(logits, DTensor):
        local, group, vocab_start, vocab_size = _local_vocab_shard(logits, group, vocab_start, vocab_size)
    else:
        if group is None or vocab_start is None:
            raise ValueError(
                "vocab_parallel_cross_entropy: plain-tensor `logits` are this rank's vocabulary slice and need "
                "`group` and `vocab_start`; or pass the DTensor sharded on the vocabulary dim."
            )
        local = logits
    if isinstance(labels, DTensor):
        labels = labels.full_tensor()
    if labels.shape != local.shape[:-1]:
        raise ValueError(
            f"vocab_parallel_cross_entropy: `labels` of shape {tuple(labels.shape)} do not match `logits` of shape "
            f"{tuple(logits.shape)} without their last (vocabulary) dimension."
        )
    labels = labels.to(local.device)
    _check_labels(labels, ignore_index, vocab_size)
    loss = _VocabParallelCrossEntropy.apply(
        local.reshape(-1, local.shape[-1]), labels.reshape(-1), vocab_start, ignore_index, group
    )
    if reduction == "none":
        return loss.view(labels.shape)
    if reduction == "sum":
        return loss.sum()
    return loss.sum() / (labels != ignore_index).sum()


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor, *, ignore_index: int = -100) -> torch.Tensor:
    """The log-probability of each given token under ``logits``, fp32, 0 where ``tokens == ignore_index``: what DPO
    sums over a response and GRPO turns into its ratios. ``logits``: ``(..., vocab)``, the full logits (a plain tensor:
    ``log_softmax`` and a gather) or a DTensor sharded on the vocabulary (``loss_parallel=True``, see
    :func:`keep_logits_sharded`): computed on the shards, no rank holding the whole vocabulary (two all-reduces of one
    float per token, as :func:`vocab_parallel_cross_entropy`, of which it is the negative). ``tokens``: ``(...)``, the
    same on every rank. Gradients reach ``logits`` in their own layout.

    Args:
        logits: ``(..., vocab)``, full or a vocabulary-sharded DTensor.
        tokens: ``(...)`` the tokens whose log-probabilities to take.
        ignore_index: the token value of positions that get 0.

    Raises:
        ValueError: as :func:`vocab_parallel_cross_entropy` for sharded logits (shapes that do not match).
    """
    if isinstance(logits, DTensor):
        return -vocab_parallel_cross_entropy(logits, tokens, ignore_index=ignore_index, reduction="none")
    tokens = tokens.to(logits.device)
    valid = tokens != ignore_index
    picked = torch.log_softmax(logits.float(), dim=-1).gather(-1, torch.where(valid, tokens, 0).unsqueeze(-1))
    return torch.where(valid, picked.squeeze(-1), 0.0)


class _SumOverVocabShards(torch.autograd.Function):
    """The sum over the TP group of each rank's part of a per-token quantity; the backward is the identity: every
    rank holds the same sum and gets the same gradient, which flows into its own shard's part (Megatron's reduction
    from the model-parallel region)."""

    @staticmethod
    def forward(ctx, value, group):  # type: ignore[override]
        total = value.clone()
        dist.all_reduce(total, group=group)
        return total

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        return grad, None


def token_entropy(logits: torch.Tensor) -> torch.Tensor:
    """The entropy of the next-token distribution at each position, fp32: ``logsumexp(l) - sum(softmax(l) l)``.
    ``logits`` as for :func:`token_logprobs` (full, or a vocabulary-sharded DTensor: three all-reduces of one float
    per token, no rank holding the whole vocabulary). Differentiable.

    Args:
        logits: ``(..., vocab)``, full or a vocabulary-sharded DTensor (every rank of its group must call it).

    Raises:
        ValueError: a DTensor not sharded on its last dim over a 1-D mesh.
    """
    if not isinstance(logits, DTensor):
        log_p = torch.log_softmax(logits.float(), dim=-1)
        p = log_p.exp()
        return -torch.where(p > 0, p * log_p, 0.0).sum(dim=-1)  # a -inf logit adds 0, not nan
    local, group, _, _ = _local_vocab_shard(logits, None, None, None)
    local = local.float()
    top = local.detach().amax(dim=-1)
    dist.all_reduce(top, op=dist.ReduceOp.MAX, group=group)
    shifted = local - top.unsqueeze(-1)
    exp = shifted.exp()
    total = _SumOverVocabShards.apply(exp.sum(dim=-1), group)
    weighted = _SumOverVocabShards.apply(torch.where(exp > 0, exp * shifted, 0.0).sum(dim=-1), group) / total
    return torch.log(total) - weighted


#: Set while :func:`keep_logits_sharded` is active (in this thread or task): forwards without ``labels`` keep their
#: logits sharded too.
_KEEP_SHARDED: contextvars.ContextVar[bool] = contextvars.ContextVar("lightning_tp_keep_logits_sharded", default=False)


@contextlib.contextmanager
def keep_logits_sharded() -> Iterator[None]:
    """Forwards of a model with ``loss_parallel=True`` return vocabulary-sharded DTensor logits inside this context
    even without ``labels`` (outside it they are gathered, for ``generate`` and prediction): for
    :func:`token_logprobs` and :func:`token_entropy` on the shards (DPO, GRPO). Not with context parallelism, whose
    forwards without labels gather each sequence's logits (refused there)::

        with lightning_tp.keep_logits_sharded():
            logits = policy(input_ids=ids, attention_mask=mask).logits  # DTensor, Shard(-1) on the TP mesh
        logprobs = lightning_tp.token_logprobs(logits[:, :-1], ids[:, 1:])

    Raises:
        Nothing of its own; a forward under context parallelism inside it raises ``ValueError`` (see above).
    """
    token = _KEEP_SHARDED.set(True)
    try:
        yield
    finally:
        _KEEP_SHARDED.reset(token)


def _local_vocab_shard(
    logits: DTensor, group: Any, vocab_start: int | None, vocab_size: int | None
) -> tuple[torch.Tensor, dist.ProcessGroup, int, int]:
    """This rank's slice of DTensor logits sharded on the last dim, its group and its first vocabulary index."""
    if group is not None or vocab_start is not None:
        raise ValueError(
            "vocab_parallel_cross_entropy: DTensor `logits` carry their group and vocabulary offset; do not pass "
            "`group` or `vocab_start` with them."
        )
    mesh, placements = logits.device_mesh, logits.placements
    if mesh.ndim != 1 or not placements[0].is_shard(logits.ndim - 1):
        raise ValueError(
            "vocab_parallel_cross_entropy: DTensor `logits` must be sharded on their last (vocabulary) dim over a "
            f"1-D mesh (`Shard(-1)`, the TP mesh), got placements {placements} on a {mesh.ndim}-D mesh."
        )
    if vocab_size is not None and vocab_size != logits.shape[-1]:
        raise ValueError(
            f"vocab_parallel_cross_entropy: `vocab_size={vocab_size}` but the logits hold {logits.shape[-1]} classes."
        )
    # Torch chunks a dim like `torch.chunk` (vocab 11 over 2 ranks: 6 + 5); its own helper gives this rank's offset.
    _, offset = compute_local_shape_and_global_offset(logits.shape, mesh, placements)
    return logits.to_local(), mesh.get_group(), offset[-1], logits.shape[-1]


def _check_labels(labels: torch.Tensor, ignore_index: int, vocab_size: int | None) -> None:
    """Fail on labels outside the vocabulary, as ``F.cross_entropy`` does: the shards would silently give them a
    target logit of 0. Asynchronous on GPU (a device assert, like torch's), so no host sync per step."""
    if vocab_size is None:
        return
    bad = (labels != ignore_index) & ((labels < 0) | (labels >= vocab_size))
    assert_async(~bad.any(), f"vocab_parallel_cross_entropy: a label is outside [0, {vocab_size})")


def causal_lm_loss(
    logits: torch.Tensor,
    labels: torch.Tensor,
    vocab_size: int | None = None,
    num_items_in_batch: torch.Tensor | int | None = None,
    ignore_index: int = -100,
    shift_labels: torch.Tensor | None = None,
    **kwargs: Any,
) -> torch.Tensor:
    """Transformers' ``ForCausalLMLoss`` (same arguments, same result) that keeps vocabulary-sharded logits sharded.

    Logits that are a DTensor sharded on the vocabulary go to :func:`vocab_parallel_cross_entropy`; replicated
    DTensor logits are taken locally (each rank computes the same loss); plain tensors go to Transformers' function.
    """
    ForCausalLMLoss = causal_lm_loss_function()

    if isinstance(logits, DTensor) and all(isinstance(p, Replicate) for p in logits.placements):
        logits = logits.to_local()
    if not isinstance(logits, DTensor):
        return ForCausalLMLoss(logits, labels, vocab_size, num_items_in_batch, ignore_index, shift_labels, **kwargs)

    if shift_labels is None:
        # Shift so that tokens < n predict n: the labels only, the logits (and their vocabulary dim) stay as they are.
        labels = nn.functional.pad(labels, (0, 1), value=ignore_index)
        shift_labels = labels[..., 1:]
    if isinstance(shift_labels, DTensor):
        shift_labels = shift_labels.full_tensor()
    reduction = "sum" if num_items_in_batch is not None else "mean"
    loss = vocab_parallel_cross_entropy(
        logits,
        shift_labels.reshape(logits.shape[:-1]),
        ignore_index=ignore_index,
        reduction=reduction,
        vocab_size=vocab_size,
    )
    if num_items_in_batch is not None:
        if torch.is_tensor(num_items_in_batch):
            num_items_in_batch = num_items_in_batch.to(loss.device)
        loss = loss / num_items_in_batch
    return loss


def install_loss_parallel(model: nn.Module, *, gather_logits: bool = True) -> nn.Module:
    """Make ``model(..., labels=...).loss`` of a Transformers causal LM use :func:`causal_lm_loss`, on this instance
    only. Pair it with :func:`lm_head_style` for the ``lm_head``; with gathered logits nothing changes.

    ``gather_logits``: a forward called without ``labels`` (``generate``, prediction) computes no loss, so its caller
    wants the logits: they are gathered into a plain tensor (``generate`` fails on DTensor logits, torch 2.13). With
    ``labels`` they stay a sharded DTensor (``.full_tensor()`` gathers them), which is the point.
    """
    if _check_causal_lm_loss(model) is causal_lm_loss:
        return model
    set_loss_function(model, causal_lm_loss, owner=model)
    if gather_logits:
        model.register_forward_hook(_gather_logits_without_labels, with_kwargs=True)
    return model


def _gather_logits_without_labels(module: nn.Module, args: tuple, kwargs: dict, output: Any) -> Any:
    """Forward hook: full logits for a forward that computed no loss. In ``generate`` these are the last position's
    only (``logits_to_keep=1``), so the gather is small."""
    logits = getattr(output, "logits", None)
    if kwargs.get("labels") is None and isinstance(logits, DTensor) and not _KEEP_SHARDED.get():
        output.logits = logits.full_tensor()
    return output


def computes_causal_lm_loss(model: nn.Module) -> bool:
    """Whether the model's loss function is Transformers' causal-LM loss (or ours, installed already)."""
    from transformers import PreTrainedModel

    # `PreTrainedModel.loss_function` is a property: an instance's `_loss_function` when set, else
    # `LOSS_MAPPING[self.loss_type]` (from the class name: `...ForCausalLM`, and `...ForConditionalGeneration`
    # also map to `ForCausalLMLoss`). Its setter stores `_loss_function` on the instance.
    current = model.loss_function if isinstance(model, PreTrainedModel) else None
    return current is causal_lm_loss or current is causal_lm_loss_function()


def _check_causal_lm_loss(model: nn.Module) -> Any:
    """The model's loss function, which must be Transformers' causal-LM loss (or ours, installed already)."""
    if not computes_causal_lm_loss(model):
        current = getattr(model, "loss_function", None)
        raise ValueError(
            f"loss_parallel: {type(model).__name__} does not compute Transformers' causal-LM loss (its "
            f"`loss_function` is {getattr(current, '__name__', current)!r}), so there is nothing to replace. Pass "
            "the `...ForCausalLM` model itself (not a wrapper), or call `vocab_parallel_cross_entropy` on its logits."
        )
    return model.loss_function


def lm_head_style(input_layouts: Placement | None = None) -> ColwiseParallel:
    """The ``lm_head`` style for loss parallelism: column-wise, logits left sharded on the vocabulary as a DTensor.

    The model's output ``logits`` are then a ``Shard(-1)`` DTensor too: ``.full_tensor()`` gathers them where full
    logits are needed (e.g. sampling). ``input_layouts``: the hidden states' layout (``Shard(1)`` after sequence
    parallelism); replicated by default.
    """
    return ColwiseParallel(input_layouts=input_layouts or Replicate(), output_layouts=Shard(-1), use_local_output=False)


def loss_parallel_plan(model: nn.Module, plan: ResolvedPlan) -> ResolvedPlan:
    """``plan`` with the output head (``lm_head``) column-wise and its logits left vocabulary-sharded
    (:func:`lm_head_style`, put in by :func:`lightning_tp.plans.rewrite.rewrite_output_head`), after checking that
    the model computes Transformers' causal-LM loss, which :func:`install_loss_parallel` replaces once the model is
    sharded. Changes nothing on the model."""
    _check_causal_lm_loss(model)
    return rewrite_output_head(model, plan, head=lm_head_style)
