"""Context parallelism's tiles on CUDA, run by hand on one GPU: ``python tests/gpu/check_blockwise_cuda.py``.

The CPU suite checks the tiles against dense attention on the CPU's kernels. This checks CUDA's: bf16 through the
flash kernel (whole and diagonal tiles; masked tiles take the explicit path), fp32 through the explicit one, against
dense attention in fp64 on the same mask (packed documents, grouped-query heads), outputs and gradients. Then the
time and peak memory of one forward and backward at 32k tokens, one document against six packed, beside one call of
SDPA's flash kernel on the whole causal sequence. Prints one JSON line per check; exits 1 if a check fails.
"""

from __future__ import annotations

import json
import math
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402

from lightning_tp.parallel.blockwise import Scores, blockwise_attention, first_keys, range_mask  # noqa: E402


def report(name: str, **values) -> None:
    print(json.dumps({"check": name, **values}), flush=True)


def ranges(length: int, docs: int, device: torch.device):
    """One process's view (cp 1: two pieces), documents of equal length."""
    ids = torch.arange(length, device=device) * docs // length
    positions = torch.arange(length, device=device)
    low = first_keys(lambda b, h, q, k: (k <= q) & (ids[q] == ids[k]), positions, batch=1)
    half = length // 2
    mask = range_mask(
        positions=positions,
        low=low,
        valid=None,
        pieces=[(0, 0, half), (half, half, half)],
        key_length=length,
        piece_count=2,
    )
    allowed = (positions[None, :] <= positions[:, None]) & (ids[None, :] == ids[:, None])
    return mask, allowed


def parity(dtype: torch.dtype, device: torch.device) -> bool:
    length, heads, kv_heads, dim = 2048, 8, 2, 64
    mask, allowed = ranges(length, 3, device)
    generator = torch.Generator(device=device).manual_seed(0)
    q, k, v = (
        torch.randn(1, h, length, dim, device=device, generator=generator, dtype=dtype).requires_grad_()
        for h in (heads, kv_heads, kv_heads)
    )
    out = blockwise_attention(q, k, v, mask, scores=Scores(scale=dim**-0.5))
    grad = torch.randn_like(out)
    got = torch.autograd.grad(out, (q, k, v), grad)
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    scores = (q64 @ k64.repeat_interleave(heads // kv_heads, 1).transpose(-1, -2)) * dim**-0.5
    probs = scores.masked_fill(~allowed, -math.inf).softmax(-1)
    ref = probs @ v64.repeat_interleave(heads // kv_heads, 1)
    expected = torch.autograd.grad(ref, (q64, k64, v64), grad.double())
    eps = torch.finfo(dtype).eps
    # The inputs rounded to the dtype, the kernel's products and the merge: a few units of the dtype's roundoff
    # relative to each tensor's scale, times the terms of a row's softmax (bounded by sqrt(n) on random data).
    errors = {
        name: ((a.double() - b).abs().max() / b.abs().max()).item()
        for name, a, b in zip(("out", "dq", "dk", "dv"), (out, *got), (ref, *expected), strict=True)
    }
    bound = 8 * eps * math.sqrt(length) if dtype != torch.float32 else 64 * eps * math.sqrt(length)
    ok = all(e <= bound for e in errors.values())
    report(f"parity_{dtype}".replace("torch.", ""), ok=ok, relative_errors=errors, bound=bound)
    return ok


def timing(device: torch.device) -> None:
    length, heads, kv_heads, dim = 32768, 16, 4, 128
    generator = torch.Generator(device=device).manual_seed(0)
    q, k, v = (
        torch.randn(1, h, length, dim, device=device, generator=generator, dtype=torch.bfloat16).requires_grad_()
        for h in (heads, kv_heads, kv_heads)
    )
    results = {}
    one, six = ranges(length, 1, device)[0], ranges(length, 6, device)[0]
    runs = {
        "sdpa_flash_whole": lambda: torch.nn.functional.scaled_dot_product_attention(
            q, k, v, is_causal=True, enable_gqa=True
        ),
        "tiles_one_document": lambda: blockwise_attention(q, k, v, one, scores=Scores(dim**-0.5)),
        "tiles_six_documents": lambda: blockwise_attention(q, k, v, six, scores=Scores(dim**-0.5)),
    }
    for label, run in runs.items():
        run().sum().backward()  # warm-up
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        start = time.perf_counter()
        for _ in range(3):
            run().sum().backward()
        torch.cuda.synchronize()
        results[label] = {
            "ms": (time.perf_counter() - start) / 3 * 1000,
            "peak_gib": torch.cuda.max_memory_allocated() / 2**30,
        }
    report("timing_32k_bf16", device=torch.cuda.get_device_name(), **results)


def main() -> None:
    assert torch.cuda.is_available(), "a CUDA device is needed"
    device = torch.device("cuda")
    ok = parity(torch.bfloat16, device) & parity(torch.float32, device)
    timing(device)
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
