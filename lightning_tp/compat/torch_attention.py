"""torch's private fused attention kernels that return the log-sum-exp (CPU and CUDA flash attention, forward and
backward), which blockwise attention (:mod:`lightning_tp.parallel.blockwise`) merges partial results with."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

__all__ = [
    "fused_attention_kernels",
    "cuda_flash_attention_kernels",
]


def fused_attention_kernels(
    device: torch.device, dtype: torch.dtype, head_dim: int
) -> tuple[Callable, Callable, bool] | None:
    """torch's fused attention kernels that return the log-sum-exp of each query's scores, which blockwise
    attention (:mod:`lightning_tp.parallel.blockwise`) merges partial results with, for ``device`` and ``dtype``:
    ``(forward, backward, takes_mask)``, or ``None``. SDPA, the public entry, returns the outputs only; the public
    kernels that return the log-sum-exp (``flex_attention(return_lse=True)``, ``torch.nn.attention.varlen``) take
    their backward through autograd from each call's own outputs, where the tiles recompute each call's gradient from
    the merged outputs and log-sum-exp (``O(L)`` kept per layer), and ``varlen`` runs on CUDA only.

    - CPU: ``aten._scaled_dot_product_flash_attention_for_cpu`` and its backward (any float dtype, an additive mask of
      the query's dtype, grouped-query attention).
    - CUDA, fp16/bf16, compute capability 8.0 or later: ``aten._scaled_dot_product_flash_attention`` and its backward
      (no mask: masked calls take the explicit path; head dims of at most 256, a multiple of 8), built by
      :func:`cuda_flash_attention_kernels`.

    ``forward(q, k, v, *, is_causal, bias, scale) -> (out, lse)`` and ``backward(grad, q, k, v, out, lse, *,
    is_causal, bias, scale) -> (dq, dk, dv)`` on ``(batch, heads, length, head_dim)`` tensors; ``lse`` fp32
    ``(batch, heads, queries)``; ``is_causal`` aligns the causal mask to the first key (the calls' are square).
    Present, with these signatures, in torch 2.13 to 2.15 (the declared range). Each call makes a new pair: a
    backward belongs to the pair whose forward ran (the CUDA backward takes arguments from it)."""
    if device.type == "cpu":
        forward_op = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
        backward_op = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward

        def cpu_forward(q, k, v, *, is_causal, bias, scale):
            return forward_op(q, k, v, 0.0, is_causal, attn_mask=bias, scale=scale)

        def cpu_backward(grad, q, k, v, out, lse, *, is_causal, bias, scale):
            return backward_op(grad, q, k, v, out, lse, 0.0, is_causal, attn_mask=bias, scale=scale)

        return cpu_forward, cpu_backward, True
    flash = head_dim <= 256 and head_dim % 8 == 0  # what the CUDA kernel takes unpadded (SDPA pads the others)
    if device.type == "cuda" and dtype in (torch.float16, torch.bfloat16) and flash:
        if torch.cuda.get_device_capability(device) < (8, 0):  # flash attention 2 needs Ampere or later
            return None
        return cuda_flash_attention_kernels()
    return None


def cuda_flash_attention_kernels() -> tuple[Callable, Callable, bool]:
    """CUDA's flash attention (``aten._scaled_dot_product_flash_attention`` and its backward) as
    :func:`fused_attention_kernels` returns it, without dropout, the key heads repeated to the query heads; on any
    device the ops have a kernel for (the meta device's check the calls in the CPU suite).

    The backward's arguments are what torch's own callers pass, the autograd formula of the forward and the ring
    attention of ``torch.distributed.tensor.experimental._context_parallel._attention`` (which passes one forward's
    outputs to every step of its backward): the forward's ``cum_seq_q``/``cum_seq_k`` (undefined, ``None``: ATen takes
    its variable-length path whenever ``cum_seq_q`` is defined, where FlashAttention-2 requires int32 offsets of the
    rows), ``max_q``/``max_k`` (the call's lengths), and its philox seed and offset (read under dropout only; this
    pair runs none, so the latest forward's are every backward's, as torch's ring attention passes them)."""
    flash = torch.ops.aten._scaled_dot_product_flash_attention
    flash_backward = torch.ops.aten._scaled_dot_product_flash_attention_backward
    rng: list[Any] = []  # the latest forward's (philox_seed, philox_offset)

    def repeat(q, k):
        groups = q.shape[1] // k.shape[1]
        return groups, (lambda t: t.repeat_interleave(groups, dim=1) if groups > 1 else t)

    def cuda_forward(q, k, v, *, is_causal, bias, scale):
        assert bias is None, "the CUDA flash kernel takes no mask"
        _, expand = repeat(q, k)
        out, lse, _cum_q, _cum_k, _max_q, _max_k, seed, offset, _debug = flash(
            q, expand(k), expand(v), 0.0, is_causal, False, scale=scale
        )
        rng[:] = (seed, offset)
        return out, lse

    def cuda_backward(grad, q, k, v, out, lse, *, is_causal, bias, scale):
        assert bias is None, "the CUDA flash kernel takes no mask"
        assert rng, "the backward of a pair whose forward has not run"
        groups, expand = repeat(q, k)
        grad, q, out, lse = (t.contiguous() for t in (grad, q, out, lse))
        dq, dk, dv = flash_backward(
            grad,
            q,
            expand(k).contiguous(),
            expand(v).contiguous(),
            out,
            lse,
            None,  # cum_seq_q: the dense path
            None,  # cum_seq_k
            q.shape[2],  # max_q: the forward's (the query's length)
            k.shape[2],  # max_k
            0.0,
            is_causal,
            *rng,
            scale=scale,
        )
        if groups > 1:
            dk = dk.unflatten(1, (k.shape[1], groups)).sum(2)
            dv = dv.unflatten(1, (v.shape[1], groups)).sum(2)
        return dq, dk, dv

    return cuda_forward, cuda_backward, False
