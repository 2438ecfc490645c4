"""Context parallelism's attention and mask implementations, registered in Transformers' ``AttentionInterface`` and
``AttentionMaskInterface``: a split forward's tiles, or the inner implementation outside one. Stateless: each call
finds its forward's split through the forward's state or its mask. See :mod:`lightning_tp.parallel.context_parallel`.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from lightning_tp.parallel.cp_split import CURRENT_FORWARD, KEY_SEQUENCE_DIM, SINK_ARGUMENTS, SplitMask


@functools.cache
def implementations(inner: str) -> tuple[Callable[..., Any], Callable[..., Any]]:
    """The attention and mask implementations to register over ``inner`` (Transformers' name of the implementation a
    forward that is not split runs): the same pair for every split model, so that registering it again changes
    nothing. They hold no model's state: each call finds its forward's split through the forward's state or its mask.
    """
    return functools.partial(_attention, inner), functools.partial(_mask, inner)


def _mask(inner: str, **kwargs: Any) -> Any:
    """The mask interface: a split forward's :class:`SplitMask`, or the inner implementation's own mask."""
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS

    state = CURRENT_FORWARD.get()
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
    state = CURRENT_FORWARD.get()
    if state is not None and state.split is not None:
        raise ValueError(
            f"Context parallelism: {type(module).__name__} got an attention mask that is not the split one "
            f"({describe(attention_mask)}), so it would attend within its chunk only. Its layer prepares masks of "
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


def sinks_of(kwargs: dict[str, Any]) -> torch.Tensor | None:
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
    sinks = sinks_of(kwargs)
    if sinks is not None:
        scores = torch.cat([scores, sinks.float().reshape(1, -1, 1, 1).expand(*scores.shape[:-1], 1)], dim=-1)
    probs = torch.nan_to_num(scores.softmax(-1), nan=0.0)
    if sinks is not None:
        probs = probs[..., :-1]
    probs = nn.functional.dropout(probs, p=dropout, training=dropout > 0).to(value.dtype)
    return torch.matmul(probs, value).transpose(1, 2).contiguous(), None


def describe(value: Any) -> str:
    return f"shape {tuple(value.shape)}" if isinstance(value, torch.Tensor) else f"a {type(value).__name__}"


__all__ = [
    "implementations",
]
