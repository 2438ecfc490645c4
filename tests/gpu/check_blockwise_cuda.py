"""Context parallelism's kernels on CUDA, on one GPU: ``python tests/gpu/check_blockwise_cuda.py`` (the first script
``tests/gpu/run_all.py`` runs). One JSON line per check, each naming the device; exit code 1 if a check fails.

- ``parity_bf16``, ``parity_fp32``: the tiles (bf16: CUDA's flash kernel for whole and diagonal tiles, forward and
  backward, the explicit path for masked ones; fp32: the explicit path) against attention computed in fp64 on the same
  mask (three packed documents, grouped-query heads), outputs and the gradients of queries, keys and values. The
  bound is torch's own kernel at the same precision: SDPA on the whole sequence and mask, against the same fp64
  reference; the tiles' relative error must be of its order (at most 4 times it, plus 4 unit roundoffs). A wrong
  mask, merge or gradient errs by far more. ``flash_calls`` counts the flash kernel's forward and backward calls
  (bf16 on CUDA: the fused path ran) and checks that each backward got what torch's own callers pass it (undefined
  ``cum_seq_q``/``cum_seq_k``; the forward's philox seed and offset).
- ``cp_step_syncs``: a training step of a split model (a tiny Qwen3 with full and sliding-window layers, bf16, on a
  one-rank NCCL group) after its first, under ``torch.cuda.set_sync_debug_mode("warn")``: the host synchronisations
  counted, with a padding mask (1: the batch's one copy to the host) and without one (0), and where they happened.
- ``timing_32k_bf16``: the time and peak memory of one forward and backward at 32k tokens, one document and six
  packed, beside one call of SDPA's flash kernel on the whole causal sequence.

``--cpu`` runs the same on the CPU's kernels at small sizes, without the sync count and the timing: the test suite
runs it so that the script keeps working (tests/distributed/test_gpu_script.py).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
import traceback
import warnings
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

from lightning_tp.parallel.blockwise import Scores, blockwise_attention, first_keys, range_mask  # noqa: E402

DEVICE_NAME = "cpu"
RESULTS: list[dict[str, Any]] = []


def report(name: str, ok: bool, **values: Any) -> None:
    record = {"check": name, "ok": bool(ok), "device": DEVICE_NAME, **values}
    RESULTS.append(record)
    print(json.dumps(record, default=str), flush=True)


def ranges(length: int, docs: int, device: torch.device, *, tile: int | None = None):
    """One process's view (cp 1: two pieces) of a row of ``docs`` documents of equal length: the tiles' mask (cut on
    the host, as a split forward cuts it) and the dense boolean mask on ``device``."""
    ids = torch.arange(length) * docs // length
    positions = torch.arange(length)
    low = first_keys(lambda b, h, q, k: (k <= q) & (ids[q] == ids[k]), positions, batch=1, key_length=length)
    half = length // 2
    mask = range_mask(
        positions=positions,
        low=low,
        valid=None,
        pieces=[(0, 0, half), (half, half, half)],
        key_length=length,
        piece_count=2,
        tile=tile,
        device=device,
    )
    allowed = (positions[None, :] <= positions[:, None]) & (ids[None, :] == ids[:, None])
    return mask, allowed.to(device)


class FlashCalls(TorchDispatchMode):
    """The calls of CUDA's flash attention ops: each forward's outputs, each backward's arguments."""

    def __init__(self) -> None:
        super().__init__()
        self.forward: list[Any] = []
        self.backward: list[tuple] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func is torch.ops.aten._scaled_dot_product_flash_attention.default:
            self.forward.append(out)
        elif func is torch.ops.aten._scaled_dot_product_flash_attention_backward.default:
            self.backward.append(args)
        return out


def relative_errors(got: tuple[torch.Tensor, ...], want: tuple[torch.Tensor, ...]) -> dict[str, float]:
    names = ("out", "dq", "dk", "dv")
    return {
        name: ((a.double() - b).abs().max() / b.abs().max()).item() for name, a, b in zip(names, got, want, strict=True)
    }


def parity(dtype: torch.dtype, device: torch.device, *, length: int, tile: int | None) -> None:
    heads, kv_heads, dim = 8, 2, 64
    groups = heads // kv_heads
    mask, allowed = ranges(length, 3, device, tile=tile)
    generator = torch.Generator(device=device).manual_seed(0)
    q, k, v = (
        torch.randn(1, h, length, dim, device=device, generator=generator, dtype=dtype).requires_grad_()
        for h in (heads, kv_heads, kv_heads)
    )
    grad = torch.randn(1, heads, length, dim, device=device, generator=generator, dtype=dtype)
    with FlashCalls() as calls:
        out = blockwise_attention(q, k, v, mask, scores=Scores(scale=dim**-0.5))
        tiles = (out, *torch.autograd.grad(out, (q, k, v), grad))
    # The reference: the same (rounded) inputs in fp64.
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    scores = (q64 @ k64.repeat_interleave(groups, 1).transpose(-1, -2)) * dim**-0.5
    ref = scores.masked_fill(~allowed, -math.inf).softmax(-1) @ v64.repeat_interleave(groups, 1)
    reference = (ref, *torch.autograd.grad(ref, (q64, k64, v64), grad.double()))
    # torch's own kernel at this precision, on the whole sequence and mask.
    sdpa = torch.nn.functional.scaled_dot_product_attention(
        q, k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1), attn_mask=allowed, scale=dim**-0.5
    )
    torch_kernel = (sdpa, *torch.autograd.grad(sdpa, (q, k, v), grad))
    errors, sdpa_errors = relative_errors(tiles, reference), relative_errors(torch_kernel, reference)
    u = torch.finfo(dtype).eps / 2
    limits = {name: 4 * sdpa_errors[name] + 4 * u for name in errors}
    ok = all(errors[name] <= limits[name] for name in errors)
    label = str(dtype).replace("torch.", "")
    report(f"parity_{label}", ok, length=length, relative_errors=errors, sdpa_errors=sdpa_errors, limits=limits)
    if device.type == "cuda" and dtype == torch.bfloat16:
        fused = sum(1 for t in mask.tiles for c in t.calls if c.kind != "masked")
        arguments = [
            a[6] is None and a[7] is None and any(a[12] is f[6] and a[13] is f[7] for f in calls.forward)
            for a in calls.backward
        ]
        ok = len(calls.forward) == len(calls.backward) == fused > 0 and all(arguments)
        report("flash_calls", ok, forward=len(calls.forward), backward=len(calls.backward), unmasked_calls=fused)


def tiny_split_model(device: torch.device, dtype: torch.dtype):
    """A tiny Qwen3 with full and sliding-window layers, split over a one-rank group of the device's backend."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from lightning_tp.parallel.context_parallel import install_context_parallel
    from lightning_tp.plans.structure import block_classes
    from tests.helpers.models import build_causal_lm, tiny_config

    if not dist.is_initialized():
        backend = "nccl" if device.type == "cuda" else "gloo"
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    mesh = init_device_mesh(device.type, (1,))
    config = tiny_config("qwen3", num_hidden_layers=4, use_sliding_window=True, sliding_window=5)
    config.layer_types = ["full_attention", "sliding_attention"] * 2
    model = build_causal_lm(config).to(device=device, dtype=dtype)
    install_context_parallel(model, mesh, multiple=2, blocks=block_classes(model))
    return model


def cp_step_syncs(device: torch.device) -> None:
    """Host synchronisations in a steady-state split step (the second), with and without a padding mask."""
    from tests.helpers.models import padded_lm_batches

    model = tiny_split_model(device, torch.bfloat16)
    padded = {k: v.to(device) for k, v in padded_lm_batches(1, seq=64)[0].items()}
    plain = {"input_ids": padded["input_ids"], "labels": padded["input_ids"]}
    found: dict[str, Any] = {}
    for name, batch in (("padding_mask", padded), ("no_mask", plain)):
        model(**batch).loss.backward()  # the first split forward (its checks read the device)
        if device.type == "cuda":
            torch.cuda.synchronize()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            if device.type == "cuda":
                torch.cuda.set_sync_debug_mode("warn")
            try:
                loss = model(**batch).loss
                loss.backward()
            finally:
                if device.type == "cuda":
                    torch.cuda.set_sync_debug_mode("default")
        syncs = [f"{Path(w.filename).name}:{w.lineno}" for w in caught if "synchroniz" in str(w.message)]
        found[name] = {"syncs": len(syncs), "where": syncs[:8], "loss": loss.item()}
    expected = {"padding_mask": 1, "no_mask": 0}
    if device.type == "cuda":
        ok = all(found[name]["syncs"] <= expected[name] for name in expected)
    else:  # no sync to count on the CPU: the step runs
        ok = all(math.isfinite(found[name]["loss"]) for name in found)
    report("cp_step_syncs", ok, expected_at_most=expected, **found)


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
    report("timing_32k_bf16", True, **results)


def run(name: str, check: Any, *args: Any, **kwargs: Any) -> None:
    """One check; an exception is a failure, reported with its traceback."""
    started = time.perf_counter()
    try:
        check(*args, **kwargs)
    except Exception:
        report(name, False, error=traceback.format_exc()[-3000:])
    RESULTS[-1]["seconds"] = round(time.perf_counter() - started, 1)


def main() -> None:
    global DEVICE_NAME
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cpu", action="store_true", help="the CPU's kernels at small sizes (checks the script)")
    args = parser.parse_args()
    if not args.cpu and not torch.cuda.is_available():
        raise SystemExit("No CUDA device: pass --cpu to run the checks on the CPU's kernels.")
    device = torch.device("cpu") if args.cpu else torch.device("cuda", 0)
    DEVICE_NAME = "cpu" if args.cpu else torch.cuda.get_device_name(device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    length, tile = (256, 64) if args.cpu else (2048, None)
    run("parity_bfloat16", parity, torch.bfloat16, device, length=length, tile=tile)
    run("parity_float32", parity, torch.float32, device, length=length, tile=tile)
    run("cp_step_syncs", cp_step_syncs, device)
    if not args.cpu:
        run("timing_32k_bf16", timing, device)
    failed = [r["check"] for r in RESULTS if not r["ok"]]
    print(json.dumps({"summary": f"{len(RESULTS) - len(failed)}/{len(RESULTS)} passed", "failed": failed}))
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
