"""Attention by blocks (lightning_tp/parallel/blockwise.py) against dense attention on the same mask, on one process:
a rank's queries of the load-balanced split against the whole sequence's keys, with packed documents, padding,
sliding windows, softcapping, sinks, grouped-query heads and dropout; and the tiles a packed row skips."""

from __future__ import annotations

import math

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from lightning_tp import compat
from lightning_tp.parallel import blockwise
from lightning_tp.parallel.blockwise import (
    CAUSAL,
    FULL,
    MASKED,
    Scores,
    blockwise_attention,
    first_keys,
    interval_violations,
    range_mask,
)
from lightning_tp.parallel.cp_split import local_positions

#: fp64's unit roundoff: the explicit kernel in fp64 against the dense reference in fp64 differs by the order of the
#: sums only (a few roundings per score, times the number of terms of a row).
FP64_EPS = torch.finfo(torch.float64).eps
FP32_EPS = torch.finfo(torch.float32).eps


def _docs(batch: int, length: int, cuts: list[list[int]]) -> torch.Tensor:
    """Document ids (batch, length) from each row's document starts."""
    ids = torch.zeros(batch, length, dtype=torch.long)
    for row, starts in enumerate(cuts):
        for start in starts:
            ids[row, start:] += 1
    return ids


def _mask_function(docs: torch.Tensor | None, window: int | None):
    def function(b, h, q, k):
        seen = k <= q
        if window is not None:
            seen = seen & (k > q - window)
        if docs is not None:
            seen = seen & (docs[b, q] == docs[b, k])
        return seen

    return function


def _setup(*, length=96, cp=2, rank=1, batch=2, docs=None, window=None, padding=None, tile=8, device=None):
    positions = local_positions(length, cp, rank)
    function = _mask_function(docs, window)
    low = first_keys(function, positions, batch=batch, key_length=length)
    assert interval_violations(function, positions, low, key_length=length) is None
    piece = length // (2 * cp)
    pieces = [(0, rank * piece, piece), (piece, (2 * cp - 1 - rank) * piece, piece)]
    mask = range_mask(
        positions=positions,
        low=low,
        valid=padding,
        pieces=pieces,
        key_length=length,
        piece_count=2 * cp,
        tile=tile,
        device=device,
    )
    dense = torch.stack(
        [torch.stack([function(b, 0, positions[:, None], torch.arange(length)[None, :]) for b in range(batch)])]
    )[0][:, None]
    if padding is not None:
        dense = dense & padding[:, None, None, :]
    return mask, dense


def _dense(query, key, value, allowed, *, scale, softcap=None, sinks=None):
    groups = query.shape[1] // key.shape[1]
    key, value = key.repeat_interleave(groups, 1), value.repeat_interleave(groups, 1)
    scores = query @ key.transpose(-1, -2) * scale
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    scores = scores.masked_fill(~allowed, -math.inf)
    if sinks is not None:
        scores = torch.cat([scores, sinks[None, :, None, None].expand(*scores.shape[:-1], 1)], -1)
    probs = torch.nan_to_num(scores.softmax(-1), nan=0.0)
    if sinks is not None:
        probs = probs[..., :-1]
    return probs @ value


def _tensors(batch, heads, kv_heads, queries, length, dim, dtype, seed=0):
    generator = torch.Generator().manual_seed(seed)
    make = lambda *shape: torch.randn(*shape, generator=generator, dtype=dtype).requires_grad_()  # noqa: E731
    return make(batch, heads, queries, dim), make(batch, kv_heads, length, dim), make(batch, kv_heads, length, dim)


CASES = {
    "causal": {},
    "packed": {"docs": _docs(2, 96, [[30, 61], [7]])},
    "window": {"window": 20},
    "packed_window": {"docs": _docs(2, 96, [[50], [13, 70]]), "window": 9},
    "padding_left_right": {
        "padding": torch.arange(96)[None, :].expand(2, -1).ge(torch.tensor([[17], [0]]))
        & torch.arange(96)[None, :].lt(torch.tensor([[96], [80]]))
    },
    "softcap": {"softcap": 1.5},
    "sinks": {"sinks": True},
    "softcap_sinks_packed": {"softcap": 2.0, "sinks": True, "docs": _docs(2, 96, [[40], [40, 41]])},
}


@pytest.mark.parametrize("name", CASES)
@pytest.mark.parametrize("kernel", ["explicit", "fused"])
def test_blockwise_matches_dense_attention(name: str, kernel: str, monkeypatch) -> None:
    """Outputs and gradients (queries, keys, values, sinks) of the tiles against dense attention on the same mask.
    fp64 on the explicit kernel (the bound: the sums' order), fp32 on the fused CPU kernel (fp32's)."""
    case = dict(CASES[name])
    softcap, sinks_on = case.pop("softcap", None), case.pop("sinks", False)
    if kernel == "fused" and softcap is not None:
        pytest.skip("softcapping always takes the explicit kernel")
    dtype = torch.float64 if kernel == "explicit" else torch.float32
    if kernel == "explicit":
        monkeypatch.setattr(blockwise, "fused_attention_kernels", lambda *args: None)
    mask, allowed = _setup(**case)
    query, key, value = _tensors(2, 4, 2, 48, 96, 8, dtype)
    sinks = (
        torch.randn(4, dtype=dtype, generator=torch.Generator().manual_seed(3)).requires_grad_() if sinks_on else None
    )
    scale = 8**-0.5
    out = blockwise_attention(query, key, value, mask, scores=Scores(scale=scale, softcap=softcap), sinks=sinks)
    grad = torch.randn_like(out)
    inputs = [t for t in (query, key, value, sinks) if t is not None]
    got = torch.autograd.grad(out, inputs, grad)
    expected_out = _dense(query, key, value, allowed, scale=scale, softcap=softcap, sinks=sinks)
    expected = torch.autograd.grad(expected_out, inputs, grad)
    # A row's output sums up to 96 products of unit-scale terms: rounding grows with the terms' count.
    bound = 96 * 8 * (FP64_EPS if dtype == torch.float64 else FP32_EPS) * 4
    torch.testing.assert_close(out, expected_out, atol=bound, rtol=0)
    for g, e in zip(got, expected, strict=True):
        torch.testing.assert_close(g, e, atol=bound * 8, rtol=0)


def test_rows_that_see_no_key_give_zeros() -> None:
    """Left padding: the first queries see no key. SDPA with a boolean mask gives them zeros; so do the tiles, and
    their gradient is zero too."""
    padding = torch.arange(96)[None, :].ge(torch.tensor([[30]]))
    mask, allowed = _setup(batch=1, padding=padding, rank=0)
    assert mask.empty is not None and mask.empty[0, :24].all()
    query, key, value = _tensors(1, 2, 2, 48, 96, 8, torch.float32)
    out = blockwise_attention(query, key, value, mask, scores=Scores(scale=0.3))
    assert torch.equal(out[0, :, :24], torch.zeros_like(out[0, :, :24]))
    out.sum().backward()
    assert torch.equal(query.grad[0, :, :24], torch.zeros_like(query.grad[0, :, :24]))


def test_dropout_gradient_is_the_dropped_forwards() -> None:
    """Dropout draws each call's masks from the forward's seed, again in the backward: the gradient is that of the
    forward computed (checked against finite differences of the same forward, fp64)."""
    mask, _ = _setup(batch=1, docs=_docs(1, 96, [[40]]))
    query, key, value = _tensors(1, 2, 1, 48, 96, 4, torch.float64)
    scores = Scores(scale=0.5, dropout=0.3, seed=1234)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(blockwise, "fused_attention_kernels", lambda *args: None)
        assert torch.autograd.gradcheck(
            lambda q, k, v: blockwise_attention(q, k, v, mask, scores=scores), (query, key, value), eps=1e-6, atol=1e-5
        )
        first = blockwise_attention(query, key, value, mask, scores=scores)
        other = blockwise_attention(query, key, value, mask, scores=Scores(scale=0.5, dropout=0.3, seed=99))
    assert not torch.equal(first, other)


def test_a_packed_row_skips_the_tiles_across_documents() -> None:
    """Six documents in a row of 1,536 tokens, one rank of cp 2 with tiles of 32: the tiles computed cost about the
    sum of the documents' own attention (plus at most one tile of keys per query at each boundary), not the whole
    causal triangle; whole tiles and diagonals run without a mask."""
    length, cp, tile = 1536, 2, 32
    cuts = [256 * i for i in range(1, 6)]
    docs = _docs(1, length, [cuts])
    positions = local_positions(length, cp, 0)
    function = _mask_function(docs, None)
    low = first_keys(function, positions, batch=1, key_length=length)
    piece = length // (2 * cp)
    pieces = [(0, 0, piece), (piece, 3 * piece, piece)]
    mask = range_mask(
        positions=positions, low=low, valid=None, pieces=pieces, key_length=length, piece_count=2 * cp, tile=tile
    )
    causal = range_mask(
        positions=positions,
        low=torch.zeros_like(low),
        valid=None,
        pieces=pieces,
        key_length=length,
        piece_count=2 * cp,
        tile=tile,
    )
    visible = mask.visible()
    assert visible <= mask.computed() <= visible + positions.numel() * tile
    assert mask.computed() < causal.computed() / 4
    kinds = {call.kind for t in mask.tiles for call in t.calls}
    assert kinds == {FULL, CAUSAL}  # documents start on tile boundaries here: no masked call at all
    # Plain causal: everything up to the diagonal, plus the upper half of each diagonal tile (the kernel skips it).
    assert causal.computed() == causal.visible() + sum(t.length * (t.length - 1) // 2 for t in causal.tiles)


def test_a_boundary_inside_a_tile_is_masked_there_only() -> None:
    docs = _docs(1, 64, [[20]])
    mask, _ = _setup(length=64, batch=1, docs=docs, rank=1, tile=8)  # pieces [16, 32) and [32, 48)
    kinds = [(t.start, c.start, c.kind) for t in mask.tiles for c in t.calls]
    assert (16, 16, MASKED) in kinds  # the tile holding the boundary, on its diagonal
    assert all(kind != MASKED for start, key, kind in kinds if start >= 24 and key >= 24)


@pytest.mark.parametrize(
    ("function", "problem"),
    [
        (lambda b, h, q, k: k <= q + 1, "later key"),
        (lambda b, h, q, k: (k <= q) & (k != q), "own key"),
    ],
)
def test_masks_that_are_not_intervals_ending_at_the_query_are_found(function, problem) -> None:
    positions = torch.arange(8, 16)
    low = first_keys(function, positions, batch=1, key_length=16)
    assert problem in interval_violations(function, positions, low, key_length=16)


def test_a_chunked_mask_is_an_interval_found_by_bisection() -> None:
    """Llama 4's chunked attention: each query sees the keys of its chunk up to itself."""
    positions = torch.arange(0, 40)
    function = lambda b, h, q, k: (k <= q) & (k // 16 == q // 16)  # noqa: E731
    low = first_keys(function, positions, batch=1, key_length=40)
    assert torch.equal(low[0], positions // 16 * 16)
    assert interval_violations(function, positions, low, key_length=40) is None


@pytest.mark.parametrize("kernel", ["explicit", "fused"])
def test_autocast_changes_nothing_inside_the_tiles(kernel: str, monkeypatch) -> None:
    """Under `bf16-mixed` (autocast) the tiles compute as without it: the backward recomputes the forward's scores
    exactly (under autocast the forward's products would run in bf16 and the backward's in fp32)."""
    if kernel == "explicit":
        monkeypatch.setattr(blockwise, "fused_attention_kernels", lambda *args: None)
    mask, _ = _setup(**CASES["packed"])
    query, key, value = (t.detach().bfloat16().requires_grad_() for t in _tensors(2, 4, 2, 48, 96, 8, torch.float32))
    scores = Scores(scale=8**-0.5, softcap=2.0 if kernel == "explicit" else None)
    results = []
    for autocast in (False, True):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            out = blockwise_attention(query, key, value, mask, scores=scores)
        results.append((out, *torch.autograd.grad(out.float().square().sum(), (query, key, value))))
    for a, b in zip(*results, strict=True):
        assert torch.equal(a, b)


class _FlashCalls(TorchDispatchMode):
    """The calls of CUDA's flash attention ops: each forward's outputs, each backward's arguments."""

    def __init__(self) -> None:
        super().__init__()
        self.forward: list[tuple] = []
        self.backward: list[tuple[tuple, dict]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if func is torch.ops.aten._scaled_dot_product_flash_attention.default:
            self.forward.append(out)
        elif func is torch.ops.aten._scaled_dot_product_flash_attention_backward.default:
            self.backward.append((args, kwargs))
        return out


def test_the_cuda_flash_backward_gets_what_torch_passes_it(monkeypatch) -> None:
    """CUDA's flash kernels (selected on CUDA for bf16 from compute capability 8.0) through the tiles' forward and
    backward, run on the meta device, whose kernels of the ops check their schemas and shapes without a GPU: each
    backward gets what torch's own callers pass it (the forward's autograd formula; the ring attention of
    ``torch.distributed.tensor.experimental``), the forward's outputs: ``cum_seq_q``/``cum_seq_k`` undefined
    (``None``; a defined one, even empty, takes ATen's variable-length path, which wants int32 offsets), the call's
    lengths, and a forward's philox seed and offset."""
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    selected = compat.fused_attention_kernels(torch.device("cuda"), torch.bfloat16, 16)
    assert selected is not None and not selected[2]
    assert selected[1].__qualname__.startswith(compat.cuda_flash_attention_kernels.__name__)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (7, 5))
    assert compat.fused_attention_kernels(torch.device("cuda"), torch.bfloat16, 16) is None
    monkeypatch.setattr(blockwise, "fused_attention_kernels", lambda *args: compat.cuda_flash_attention_kernels())

    mask, _ = _setup(**CASES["packed"], device="meta")
    fused = [c for t in mask.tiles for c in t.calls if c.kind != MASKED]  # masked calls take the explicit path
    assert fused and len(fused) < sum(len(t.calls) for t in mask.tiles)
    query, key, value = (
        torch.empty(2, heads, length, 16, device="meta", dtype=torch.bfloat16, requires_grad=True)
        for heads, length in ((4, 48), (2, 96), (2, 96))
    )
    with _FlashCalls() as calls:
        out = blockwise_attention(query, key, value, mask, scores=Scores(scale=0.25))
        out.backward(torch.empty_like(out))
    assert len(calls.forward) == len(calls.backward) == len(fused)
    for args, kwargs in calls.backward:
        grad, q, k, v, out_, lse, cum_seq_q, cum_seq_k, max_q, max_k, dropout, _causal, seed, offset = args
        assert cum_seq_q is None and cum_seq_k is None
        assert (max_q, max_k) == (q.shape[2], k.shape[2])
        assert any(seed is f[6] and offset is f[7] for f in calls.forward)
        assert dropout == 0.0 and kwargs == {"scale": 0.25}
        assert q.shape[1] == k.shape[1] == v.shape[1] == 4  # the key heads repeated to the query heads
        assert lse.dtype == torch.float32 and lse.shape == q.shape[:3] and out_.dtype == grad.dtype == q.dtype
    assert [t.grad.shape for t in (query, key, value)] == [t.shape for t in (query, key, value)]
