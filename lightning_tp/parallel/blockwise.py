"""Attention by blocks, with an online-softmax merge: what context parallelism computes for each rank's queries
against the whole sequence's keys, in memory that grows with the length, not its square.

**Masks as ranges.** Every mask a causal LM's attention uses (causal, sliding window, chunked, packed documents,
padding) lets a query see an interval of keys that ends at itself, minus the padding keys: query ``i`` sees the key
``k`` iff ``low[b, i] <= k <= position[i]`` and ``valid[b, k]`` (:class:`RangeMask`). The first key of each query
(``low``) is found from the model's own mask function by bisection (``log2(L)`` evaluations of it on one index per
query), never by evaluating it on ``L x L`` indices; on the host, from host copies of the batch's positions and
padding, so that cutting the tiles never waits for the device (:func:`range_mask`).

**Tiles.** The queries and keys are cut into tiles on one grid (:data:`TILE` tokens, cut again at the pieces of the
load-balanced split), and each query tile calls a kernel on the key tiles it can see: a tile wholly before it that
every query sees whole runs with no mask (``FULL``), its own tile runs with a causal flag and no mask (``CAUSAL``), one
that a document boundary, a window's edge or padding cuts gets a mask of one tile (``MASKED``), and one that no
query of the tile can see is **skipped**. A row of packed documents then costs the sum of its documents' own
attention (``sum(len_i^2)``), not ``L^2``; the masks are one tile each, made at the call and not kept.

**The merge.** Each call returns its outputs and their rows' log-sum-exp; the calls of a tile combine as
``l = logsumexp(l_i)``, ``o = sum(exp(l_i - l) o_i)``. Attention sinks (gpt-oss) are one more term of the sum with no
value. The backward recomputes each call's scores from the saved queries, keys, values, merged outputs and
log-sum-exp (as flash attention does), so a forward keeps ``O(L)`` per layer for the backward, not the scores.

**Kernels.** A fused kernel that returns the log-sum-exp where torch has one (:func:`lightning_tp.compat.
fused_attention_kernels`: the CPU's flash kernel; CUDA's flash kernel for unmasked calls in fp16/bf16 on GPUs it runs
on), else, and for softcapping, dropout and values narrower than the queries (which the fused kernels do not take),
scores computed explicitly per call in fp32. All of it outside autocast.

Pure tensor code: no process group, no model. :mod:`lightning_tp.parallel.context_parallel` builds the ranges of each
forward and calls :func:`blockwise_attention`.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from lightning_tp.compat import fused_attention_kernels

#: Tokens per query and key tile. Larger tiles make fewer kernel calls; smaller ones skip more of a packed row's
#: masked area (a document boundary costs at most one tile of keys per query) and make smaller masks.
TILE = 512
#: The most scores (batch x heads x queries x keys) one explicit call of a run of whole tiles computes at once: a
#: longer run of keys is cut (a diagonal or masked call is one tile of queries and keys).
EXPLICIT_SCORES = 1 << 24
#: The kinds of kernel call: keys that every query of the tile sees whole; the tile's own keys under a causal mask
#: (the tiles are on one grid, so the diagonal is square); keys with a mask of one tile.
FULL, CAUSAL, MASKED = "full", "causal", "masked"


@dataclass(frozen=True)
class Call:
    """One kernel call of a query tile: the keys ``[start, end)`` of the whole sequence and what masks them."""

    start: int
    end: int
    kind: str


@dataclass(frozen=True)
class QueryTile:
    """A tile of a rank's queries: its first local row, the global position of its first query, its length, and its
    calls."""

    row: int
    start: int
    length: int
    calls: tuple[Call, ...]

    @property
    def rows(self) -> slice:
        return slice(self.row, self.row + self.length)


@dataclass(frozen=True, eq=False)
class RangeMask:
    """What each of a rank's queries may attend to, as ranges: query ``i``, at global position ``positions[i]``,
    sees the keys ``k`` with ``low[b, i] <= k <= positions[i]`` and ``valid[b, k]``; and the tiles that follow.

    ``valid``: ``None`` when every key is (no padding). ``empty``: the rows that see no key at all (padding at the
    start of a row), whose outputs are zeros, as SDPA gives a query whose mask hides every key; ``None`` when there
    is none."""

    positions: torch.Tensor  # (queries,) long
    low: torch.Tensor  # (batch, queries) long
    valid: torch.Tensor | None  # (batch, keys) bool
    empty: torch.Tensor | None  # (batch, queries) bool
    key_length: int
    tiles: tuple[QueryTile, ...]

    def allowed(self, tile: QueryTile, call: Call) -> torch.Tensor:
        """The boolean mask of one call, ``(batch, 1, tile queries, call keys)``."""
        keys = torch.arange(call.start, call.end, device=self.low.device)
        positions = self.positions[tile.rows]
        allowed = (keys >= self.low[:, tile.rows, None]) & (keys <= positions[:, None])
        if self.valid is not None:
            allowed = allowed & self.valid[:, None, call.start : call.end]
        return allowed.unsqueeze(1)

    def computed(self) -> int:
        """The (query, key) pairs the calls compute for one batch row and head: what the tiles cost."""
        return sum(tile.length * (call.end - call.start) for tile in self.tiles for call in tile.calls)

    def visible(self) -> int:
        """The (query, key) pairs the mask lets attend, summed over the batch: the least any computation costs."""
        count = self.positions[None, :] - self.low + 1
        if self.valid is not None:
            seen = torch.nn.functional.pad(self.valid.long().cumsum(-1), (1, 0))
            count = seen.gather(1, (self.positions + 1).expand_as(self.low)) - seen.gather(1, self.low)
        return int(count.clamp(min=0).sum())


def grid(length: int, *, pieces: int, tile: int) -> list[tuple[int, int]]:
    """The key tiles of a sequence of ``length`` tokens cut into ``pieces`` pieces of equal length: each piece in tiles
    of ``tile`` tokens (the last one shorter), so that every rank's query tiles are key tiles too."""
    piece = length // pieces
    assert piece * pieces == length, (length, pieces)
    return [(s, min(s + tile, p + piece)) for p in range(0, length, piece) for s in range(p, p + piece, tile)]


def first_keys(
    mask_function: Callable[..., torch.Tensor], positions: torch.Tensor, *, batch: int, key_length: int
) -> torch.Tensor:
    """The first key each query may see under ``mask_function`` (Transformers' index-based form: ``(batch, head,
    query, key) -> bool`` on broadcast index tensors), found by bisection: ``(batch, queries)``. Each query's keys must
    be an interval that ends at itself; :func:`interval_violations` checks the ends. The bisection takes the steps
    the longest interval needs (``log2(key_length)``), whatever the values: it reads none of them, so on an
    accelerator it does not wait for the device.

    Args:
        mask_function: the mask function, without the padding (its keys are :attr:`RangeMask.valid`).
        positions: ``(queries,)`` the global position of each query, each below ``key_length``.
        batch: the batch size.
        key_length: the whole sequence's length.
    """
    b = torch.arange(batch, device=positions.device)[:, None]
    h = torch.zeros((), dtype=torch.long, device=positions.device)
    q = positions[None, :].expand(batch, -1)
    low = torch.zeros_like(q)
    high = q.clone()
    for _ in range(max(key_length - 1, 0).bit_length()):  # halves every interval [low, high] of at most key_length
        middle = (low + high) // 2
        seen = _evaluate(mask_function, b, h, q, middle)
        open_ = low < high
        high = torch.where(open_ & seen, middle, high)
        low = torch.where(open_ & ~seen, middle + 1, low)
    return low


def interval_violations(
    mask_function: Callable[..., torch.Tensor], positions: torch.Tensor, low: torch.Tensor, *, key_length: int
) -> str | None:
    """Why ``mask_function`` is not an interval of keys ending at each query, as :func:`first_keys` found it, at the
    ends checked (each query must see itself and its first key, and neither the key before that nor the one after
    itself), or ``None``. What lies between the ends is taken from the ends: every mask Transformers' causal LMs build
    (causal, sliding window, chunked, packed documents) is such an interval."""
    batch = low.shape[0]
    b = torch.arange(batch, device=positions.device)[:, None]
    h = torch.zeros((), dtype=torch.long, device=positions.device)
    q = positions[None, :].expand(batch, -1)
    if not bool(_evaluate(mask_function, b, h, q, q).all()):
        return (
            "a query does not see its own key: a mask that hides every key, such as a sliding window of 0, makes one "
            "process's eager attention average every key, later ones included"
        )
    if not bool(_evaluate(mask_function, b, h, q, low).all()):
        return "a query does not see every key between the first it sees and itself"
    later = q + 1
    inside = later < key_length
    if bool((_evaluate(mask_function, b, h, q, later.clamp(max=key_length - 1)) & inside).any()):
        return "a query sees a later key (the mask is not causal)"
    earlier = low - 1
    if bool((_evaluate(mask_function, b, h, q, earlier.clamp(min=0)) & (earlier >= 0)).any()):
        return "a query sees a key before an unseen one (its keys are not one interval)"
    return None


def _evaluate(function: Callable[..., torch.Tensor], b: Any, h: Any, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    out = function(b, h, q, k)
    return torch.as_tensor(out, device=q.device).to(torch.bool).expand(q.shape)


def range_mask(
    *,
    positions: torch.Tensor,
    low: torch.Tensor,
    valid: torch.Tensor | None,
    pieces: Sequence[tuple[int, int, int]],
    key_length: int,
    piece_count: int,
    tile: int | None = None,
    device: torch.device | str | None = None,
) -> RangeMask:
    """The tiles and calls of a rank's queries under the ranges ``low``/``valid`` (see :class:`RangeMask`), cut on
    the host from host copies: nothing is read from the device (an accelerator's queue is never drained here).

    Args:
        positions: ``(queries,)`` the global position of each local query, on the host.
        low: ``(batch, queries)`` the first key each query sees (:func:`first_keys`), on the host.
        valid: ``(batch, key_length)`` the keys that are not padding, on the host, or ``None``.
        pieces: the rank's pieces as ``(first local row, first global position, length)``.
        key_length: the whole sequence's length.
        piece_count: the pieces the whole sequence is cut into (every rank's), each a run of tiles.
        tile: tokens per tile (default :data:`TILE`).
        device: where the mask's tensors go for the kernels (default: the host), copied without waiting for the
            device.
    """
    assert all(t is None or t.device.type == "cpu" for t in (positions, low, valid)), "the tiles are cut on the host"
    tile = TILE if tile is None else tile
    keys = grid(key_length, pieces=piece_count, tile=tile)
    starts = torch.tensor([s for s, _ in keys], dtype=torch.long)
    ends = torch.tensor([e for _, e in keys], dtype=torch.long)
    if valid is not None:
        seen = torch.nn.functional.pad(valid.long().cumsum(-1), (1, 0))  # (batch, keys + 1)
        count = seen[:, ends] - seen[:, starts]  # (batch, tiles)
        whole = (count == (ends - starts)).all(0).tolist()
        some = (count > 0).any(0).tolist()
        count_rows = seen.gather(1, (positions + 1)[None, :].expand(low.shape[0], -1)) - seen.gather(1, low)
        empty_rows = count_rows <= 0
    else:
        whole = some = [True] * len(keys)
        empty_rows = low > positions[None, :]
    tiles = []
    bounds = []
    for row, start, length in pieces:
        for offset in range(0, length, tile):
            size = min(tile, length - offset)
            bounds.append((row + offset, start + offset, size))
    first = torch.stack([low[:, r : r + n].amin() for r, _, n in bounds]).tolist()
    last = torch.stack([low[:, r : r + n].amax() for r, _, n in bounds]).tolist()
    index = {s: i for i, (s, _) in enumerate(keys)}
    for (row, start, size), least, most in zip(bounds, first, last, strict=True):
        assert start in index, (start, tile)
        calls: list[Call] = []
        for i in range(index[start] + 1):
            k0, k1 = keys[i]
            if k1 <= least or not some[i]:
                continue  # no query of the tile sees these keys: skipped, not computed and masked
            unmasked = most <= k0 and whole[i]
            kind = (CAUSAL if unmasked else MASKED) if k0 == start else (FULL if unmasked else MASKED)
            if kind == FULL and calls and calls[-1].kind == FULL and calls[-1].end == k0:
                calls[-1] = Call(calls[-1].start, k1, FULL)  # one call for a run of whole tiles
            else:
                calls.append(Call(k0, k1, kind))
        tiles.append(QueryTile(row, start, size, tuple(calls)))
    empty = empty_rows if bool(empty_rows.any()) else None

    def moved(tensor: torch.Tensor | None) -> torch.Tensor | None:
        # From pageable host memory without waiting: the copy is queued behind the device's work, not waited for.
        return tensor if tensor is None or device is None else tensor.to(device, non_blocking=True)

    return RangeMask(
        positions=moved(positions),
        low=moved(low),
        valid=moved(valid),
        empty=moved(empty),
        key_length=key_length,
        tiles=tuple(tiles),
    )


# ---------------------------------------------------------------------------------------------------------------------
# The attention


@dataclass(frozen=True)
class Scores:
    """What the model's attention does to its scores beyond ``softmax(q k^T scale) v``: its scale, softcapping
    (``cap x tanh(s / cap)``, Gemma 2), dropout (with the seed its masks are drawn from, again in the backward)."""

    scale: float
    softcap: float | None = None
    dropout: float = 0.0
    seed: int = 0


def blockwise_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    mask: RangeMask,
    *,
    scores: Scores,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of a rank's queries against the whole sequence's keys and values, tile by tile (see the module's
    docstring), differentiable in the queries, keys, values and sinks.

    Args:
        query: ``(batch, heads, queries, head_dim)``.
        key: ``(batch, kv_heads, key_length, head_dim)``, the whole sequence's in global order; ``heads`` a multiple
            of ``kv_heads`` (grouped-query attention).
        value: like ``key`` (its head dim may differ).
        mask: the ranges and tiles of the queries (:func:`range_mask`).
        scores: the scale, softcapping and dropout.
        sinks: ``(heads,)`` attention sinks (one logit per head with no value), or ``None``.

    Returns:
        ``(batch, heads, queries, value head_dim)``, in the query's dtype.
    """
    return _BlockwiseAttention.apply(query, key, value, sinks, mask, scores)


def no_autocast(function: Callable[..., Any]) -> Callable[..., Any]:
    """Run an autograd function's forward or backward outside autocast (``bf16-mixed``): the kernels compute in the
    dtypes they are given and accumulate in fp32, and the backward recomputes the scores exactly as the forward made
    them (under autocast the forward's matrix products would run in bf16, the backward's, outside it, in fp32)."""

    @functools.wraps(function)
    def run(ctx: Any, *args: Any) -> Any:
        device = next((a.device.type for a in args if isinstance(a, torch.Tensor)), "cpu")
        if not torch.amp.is_autocast_available(device):  # the meta device (the calls checked without data)
            return function(ctx, *args)
        with torch.autocast(device_type=device, enabled=False):
            return function(ctx, *args)

    return run


class _BlockwiseAttention(torch.autograd.Function):
    @staticmethod
    @no_autocast
    def forward(ctx, query, key, value, sinks, mask, scores):  # type: ignore[override]
        kernel = kernel_for(query, value, scores)
        merged = Merged.empty(query, value)
        for tile in mask.tiles:
            for call in tile.calls:
                k, v = key[:, :, call.start : call.end], value[:, :, call.start : call.end]
                merged.add(tile, *kernel.forward(query[:, :, tile.rows], k, v, mask, tile, call, scores))
        out, lse = merged.finish(mask, sinks)
        ctx.save_for_backward(query, key, value, sinks, out, lse)
        ctx.mask, ctx.scores, ctx.kernel = mask, scores, kernel
        return out

    @staticmethod
    @no_autocast
    def backward(ctx, grad):  # type: ignore[override]
        query, key, value, sinks, out, lse = ctx.saved_tensors
        mask, scores, kernel = ctx.mask, ctx.scores, ctx.kernel
        grad = output_grad(grad, mask)
        acc = accumulation_dtype(query.dtype)
        grad_query = torch.zeros_like(query, dtype=acc)
        grad_key = torch.zeros_like(key, dtype=acc)
        grad_value = torch.zeros_like(value, dtype=acc)
        for tile in mask.tiles:
            for call in tile.calls:
                keys = slice(call.start, call.end)
                dq, dk, dv = kernel.backward(
                    grad[:, :, tile.rows],
                    query[:, :, tile.rows],
                    key[:, :, keys],
                    value[:, :, keys],
                    out[:, :, tile.rows],
                    lse[:, :, tile.rows],
                    mask,
                    tile,
                    call,
                    scores,
                )
                grad_query[:, :, tile.rows] += dq
                grad_key[:, :, keys] += dk
                grad_value[:, :, keys] += dv
        return (
            grad_query.to(query.dtype),
            grad_key.to(key.dtype),
            grad_value.to(value.dtype),
            sinks_grad(sinks, lse, grad, out) if ctx.needs_input_grad[3] else None,
            None,
            None,
        )


class Merged:
    """The online-softmax merge of a rank's partial outputs: each call's outputs and log-sum-exp folded into running
    ones (``l = logaddexp(l_acc, l_i)``, ``o = exp(l_acc - l) o_acc + exp(l_i - l) o_i``), in fp32 (fp64 for fp64)."""

    def __init__(self, out: torch.Tensor, lse: torch.Tensor, dtype: torch.dtype) -> None:
        self.out, self.lse, self.dtype = out, lse, dtype

    @classmethod
    def empty(cls, query: torch.Tensor, value: torch.Tensor) -> Merged:
        acc = accumulation_dtype(query.dtype)
        out = query.new_zeros((*query.shape[:-1], value.shape[-1]), dtype=acc)
        return cls(out, query.new_full(query.shape[:-1], -math.inf, dtype=acc), query.dtype)

    def add(self, tile: QueryTile, out: torch.Tensor, lse: torch.Tensor) -> None:
        rows = tile.rows
        before = self.lse[:, :, rows]
        total = torch.logaddexp(before, lse.to(before.dtype))
        seen = total > -math.inf
        keep = torch.where(seen, (before - total).exp(), 0.0)
        new = torch.where(seen, (lse - total).exp(), 0.0)
        self.out[:, :, rows] = self.out[:, :, rows] * keep[..., None] + out.to(before.dtype) * new[..., None]
        self.lse[:, :, rows] = total

    def finish(self, mask: RangeMask, sinks: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """The outputs in the query's dtype and their log-sum-exp, with the sinks' term and the rows that see no key
        (zeros)."""
        out, lse = self.out, self.lse
        if sinks is not None:
            total = torch.logaddexp(lse, sinks.to(lse.dtype)[None, :, None])
            out = out * torch.where(total > -math.inf, (lse - total).exp(), 0.0)[..., None]
            lse = total
        if mask.empty is not None:
            out = out.masked_fill(mask.empty[:, None, :, None], 0.0)
        return out.to(self.dtype), lse


def output_grad(grad: torch.Tensor, mask: RangeMask) -> torch.Tensor:
    """The outputs' gradient as the calls' backward takes it: contiguous, zero on the rows that see no key."""
    if mask.empty is not None:
        grad = grad.masked_fill(mask.empty[:, None, :, None], 0.0)
    return grad.contiguous()


def sinks_grad(
    sinks: torch.Tensor | None, lse: torch.Tensor, grad: torch.Tensor, out: torch.Tensor
) -> torch.Tensor | None:
    """The sinks' gradient: ``d out / d sink = -p_sink out`` for each row (the sink's share of the softmax)."""
    if sinks is None:
        return None
    share = (sinks.to(lse.dtype)[None, :, None] - lse).exp()
    rowdot = (grad.to(lse.dtype) * out.to(lse.dtype)).sum(-1)
    return -(share * rowdot).sum((0, 2)).to(sinks.dtype)


def accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    """What the merge, the log-sum-exp and the gradients accumulate in: fp32, or fp64 for fp64 inputs."""
    return torch.promote_types(dtype, torch.float32)


def kernel_for(query: torch.Tensor, value: torch.Tensor, scores: Scores) -> Kernel:
    """The fused kernel where it computes what the layer asks (no softcapping, no dropout, one head dim for queries,
    keys and values: multi-head latent attention's values are narrower), else the explicit one."""
    if scores.softcap is None and scores.dropout == 0.0 and value.shape[-1] == query.shape[-1]:
        fused = fused_attention_kernels(query.device, query.dtype, query.shape[-1])
        if fused is not None:
            return _Fused(*fused)
    return _Explicit()


class Kernel:
    """One call's attention: ``forward(q, k, v, mask, tile, call, scores) -> (out, lse)`` on the tile's queries and
    the call's keys and values (``k``, ``v`` hold keys ``[call.start, call.end)``), and its ``backward(grad, q, k, v,
    out, lse, ...) -> (dq, dk, dv)`` from the merged outputs and log-sum-exp."""

    def forward(self, q, k, v, mask, tile, call, scores) -> tuple[torch.Tensor, torch.Tensor]:
        raise NotImplementedError

    def backward(self, grad, q, k, v, out, lse, mask, tile, call, scores):
        raise NotImplementedError


def _additive(mask: RangeMask, tile: QueryTile, call: Call, dtype: torch.dtype) -> torch.Tensor | None:
    """A call's mask as the fused kernels take it: ``0`` where a key is seen, the dtype's minimum where not (a row
    that sees no key of the call then gets a log-sum-exp near the minimum, which the merge weighs as zero)."""
    if call.kind != MASKED:
        return None
    allowed = mask.allowed(tile, call)
    return torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill_(~allowed, torch.finfo(dtype).min)


class _Fused(Kernel):
    """torch's fused kernel that returns the log-sum-exp (:func:`lightning_tp.compat.fused_attention_kernels`); a
    masked call goes to the explicit kernel where the fused one takes no mask."""

    def __init__(self, forward: Callable[..., Any], backward: Callable[..., Any], takes_mask: bool) -> None:
        self._forward, self._backward, self._takes_mask = forward, backward, takes_mask
        self._explicit = _Explicit()

    def forward(self, q, k, v, mask, tile, call, scores):
        if call.kind == MASKED and not self._takes_mask:
            return self._explicit.forward(q, k, v, mask, tile, call, scores)
        bias = _additive(mask, tile, call, q.dtype)
        return self._forward(q, k, v, is_causal=call.kind == CAUSAL, bias=bias, scale=scores.scale)

    def backward(self, grad, q, k, v, out, lse, mask, tile, call, scores):
        if call.kind == MASKED and not self._takes_mask:
            return self._explicit.backward(grad, q, k, v, out, lse, mask, tile, call, scores)
        bias = _additive(mask, tile, call, q.dtype)
        return self._backward(grad, q, k, v, out, lse, is_causal=call.kind == CAUSAL, bias=bias, scale=scores.scale)


class _Explicit(Kernel):
    """Scores computed in fp32, per call, cut into runs of keys of at most :data:`EXPLICIT_SCORES` scores: any device,
    softcapping and dropout. Grouped-query attention without repeating the keys (the query heads of a key head
    share a matrix product)."""

    def _chunks(self, q: torch.Tensor, call: Call) -> list[Call]:
        width = max(1, EXPLICIT_SCORES // max(1, q.shape[0] * q.shape[1] * q.shape[2]))
        if call.kind != FULL or call.end - call.start <= width:
            return [call]
        return [Call(s, min(s + width, call.end), FULL) for s in range(call.start, call.end, width)]

    @staticmethod
    def _scores(q, k, mask, tile, call, scores):
        """Raw and final scores ``(batch, kv_heads, group, queries, keys)`` in fp32 (or fp64), masked with ``-inf``."""
        batch, heads, n, dim = q.shape
        acc = accumulation_dtype(q.dtype)
        grouped = q.to(acc).reshape(batch, k.shape[1], heads // k.shape[1], n, dim)
        raw = torch.matmul(grouped, k.to(acc)[:, :, None].transpose(-1, -2)) * scores.scale
        final = raw if scores.softcap is None else scores.softcap * torch.tanh(raw / scores.softcap)
        if call.kind == CAUSAL:
            final = final.masked_fill(torch.ones(n, n, dtype=torch.bool, device=q.device).triu(1), -math.inf)
        elif call.kind == MASKED:
            final = final.masked_fill(~mask.allowed(tile, call)[:, :, None], -math.inf)
        return raw, final

    @staticmethod
    def _keep(shape, scores: Scores, tile: QueryTile, part: Call, device: torch.device) -> torch.Tensor:
        """The dropout mask of one part of a call, scaled (``keep / (1 - p)``): drawn from the forward's seed and the
        part's place (its first query and key), so the backward draws the same."""
        seed = (scores.seed * 0x9E3779B97F4A7C15 + tile.start * 0xBF58476D1CE4E5B9 + part.start) % (1 << 63)
        generator = torch.Generator(device=device).manual_seed(seed)
        keep = torch.rand(shape, generator=generator, device=device) >= scores.dropout
        return keep / (1 - scores.dropout)

    def forward(self, q, k, v, mask, tile, call, scores):
        outs, logs = [], []
        for part in self._chunks(q, call):
            cut = slice(part.start - call.start, part.end - call.start)
            _, s = self._scores(q, k[:, :, cut], mask, tile, part, scores)
            top = s.amax(-1, keepdim=True).clamp(min=torch.finfo(s.dtype).min)  # a row with no key: -inf
            p = (s - top).exp()
            total = p.sum(-1, keepdim=True)
            if scores.dropout:
                p = p * self._keep(p.shape, scores, tile, part, q.device)
            o = torch.matmul(p, v[:, :, cut].to(s.dtype)[:, :, None]) / total.clamp(min=torch.finfo(s.dtype).tiny)
            outs.append(o.flatten(1, 2))
            logs.append((top + total.log()).squeeze(-1).flatten(1, 2))
        if len(outs) == 1:
            return outs[0], logs[0]
        logs_ = torch.stack(logs)
        total = torch.logsumexp(logs_, 0)
        weights = torch.nan_to_num((logs_ - total).exp(), nan=0.0)
        return sum(w[..., None] * o for w, o in zip(weights, outs, strict=True)), total

    def backward(self, grad, q, k, v, out, lse, mask, tile, call, scores):
        batch, heads, n, _ = q.shape
        kv_heads = k.shape[1]
        groups = heads // kv_heads
        shape = (batch, kv_heads, groups, n)
        acc = accumulation_dtype(q.dtype)
        g = grad.to(acc).reshape(*shape, -1)
        delta = (g * out.to(acc).reshape(*shape, -1)).sum(-1, keepdim=True)  # rowsum(dO o), o the merged output
        log = lse.to(acc).reshape(*shape, 1)
        dq = torch.zeros(*shape, q.shape[-1], dtype=acc, device=q.device)
        dks, dvs = [], []
        for part in self._chunks(q, call):
            cut = slice(part.start - call.start, part.end - call.start)
            keys, values = k[:, :, cut].to(acc), v[:, :, cut].to(acc)
            raw, s = self._scores(q, keys, mask, tile, part, scores)
            p = torch.nan_to_num((s - log).exp(), nan=0.0)  # the merged softmax's share of each key
            dp = torch.matmul(g, values[:, :, None].transpose(-1, -2))
            if scores.dropout:
                keep = self._keep(p.shape, scores, tile, part, q.device)
                dv = torch.matmul((p * keep).transpose(-1, -2), g).sum(2)
                dp = dp * keep
            else:
                dv = torch.matmul(p.transpose(-1, -2), g).sum(2)
            ds = p * (dp - delta)
            if scores.softcap is not None:
                ds = ds * (1 - torch.tanh(raw / scores.softcap) ** 2)
            ds = ds * scores.scale
            dq += torch.matmul(ds, keys[:, :, None])
            dks.append(torch.matmul(ds.transpose(-1, -2), q.to(acc).reshape(*shape, -1)).sum(2))
            dvs.append(dv)
        return dq.reshape(batch, heads, n, -1), torch.cat(dks, 2), torch.cat(dvs, 2)


__all__ = [
    "CAUSAL",
    "FULL",
    "MASKED",
    "TILE",
    "Call",
    "Kernel",
    "Merged",
    "QueryTile",
    "RangeMask",
    "Scores",
    "accumulation_dtype",
    "blockwise_attention",
    "kernel_for",
    "no_autocast",
    "output_grad",
    "sinks_grad",
    "first_keys",
    "grid",
    "interval_violations",
    "range_mask",
]
