"""What context parallelism buys and costs: the activation memory each rank keeps for the backward against the
sequence length at cp 1, 2 and 4, the longest sequence that fits a fixed activation budget per rank, the step time, and
the collectives against the theory, in one 4-process launch.

    torchrun --standalone --nproc-per-node 4 benchmarks/context_parallel.py --out benchmarks/context_parallel.json

Long context (``--long``): the bytes saved per local token and the step time from 4k tokens up, on a row of
``--docs`` packed documents and on one document of the same length, at each cp size the world holds (``--cp-sizes``)
with each exchange (``--cp-comm all_gather ring``); and what the tiles of a packed row compute against a single
document's, on the busiest rank of cp 2, beside the theory (the sum of the documents' squared lengths over the row's):

    torchrun --standalone --nproc-per-node 2 benchmarks/context_parallel.py --long --hidden 64 --layers 2 --heads 4 \
        --kv-heads 2 --vocab 256 --lengths 4096 8192 16384 32768 65536 --steps 1 --cp-sizes 1 2 \
        --cp-comm all_gather ring --out benchmarks/context_parallel_long.json

The three layouts run on the same 4 processes, so FSDP2 shards the weights over 4 ranks in each and only the
activations differ: cp 1 is dp 4 (each rank trains a whole sequence: one process's activations), cp 2 is dp 2 x cp 2,
cp 4 splits one sequence over all 4 ranks. Each data-parallel replica trains one sequence of ``--lengths`` tokens.

- **Activation memory**: the bytes of the tensors autograd saves for the backward during one forward (unique storages,
  parameters left out; ``torch.autograd.graph.saved_tensors_hooks``), the largest of the ranks: what the forward
  leaves alive until the backward, exact and independent of the allocator and of the machine's load. The gathered
  keys and values are in it.
- **Longest sequence in the budget**: the length is doubled from 512 while the activations fit ``--budget-mib``, then
  bisected to 1/16 of the last doubling (every probe measured).
- **Step time**: forward, backward and SGD step, median of ``--steps`` after a warm-up, the slowest rank; tokens/s per
  rank is the tokens of all replicas over the step time and the 4 ranks. On this 2-core machine 4 processes share 2
  cores, so times are relative only.
- **Collectives**: counted by ``benchmarks/comm.py`` (bytes as nccl-tests count them), minus those of cp 1 at the same
  length (FSDP2's, the same in every layout). Theory, per step: each layer all-gathers its keys and values once
  (``2 x kv_heads x head_dim`` values per token of the whole sequence, gathered output) and reduce-scatters their
  gradients once, and the loss is summed over the group (one float).
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.comm import count_collectives  # noqa: E402
from benchmarks.kv_heads import build  # noqa: E402
from benchmarks.requirements import require  # noqa: E402


def saved_bytes(model: nn.Module, batch: dict[str, torch.Tensor]) -> tuple[int, torch.Tensor]:
    """The bytes autograd saves for the backward in one forward (unique storages; weights left out: a parameter or a
    view of one, such as the transposed weight a matmul saves, which FSDP2 frees after each block's forward and
    gathers again), and the loss, whose backward then runs (and frees them)."""
    storages: dict[int, int] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        if isinstance(tensor, nn.Parameter):
            return tensor
        try:
            storage = tensor.untyped_storage()
        except RuntimeError:  # a DTensor's wrapper (its local tensor is what is saved)
            return tensor
        # The weights gathered now (plain tensors; the sharded ones are DTensors).
        weights = {p.untyped_storage().data_ptr() for p in model.parameters() if not isinstance(p, DTensor)}
        if storage.data_ptr() not in weights:
            storages[storage.data_ptr()] = storage.nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        loss = model(**batch).loss
    return sum(storages.values()), loss


def predicted_mib(whole_mib: float, tokens: int, cp_size: int, *, layers: int, kv_heads: int, head_dim: int) -> float:
    """What a rank should keep at ``cp_size``: one process's activations over ``cp_size``, plus what the split adds:
    each layer's gathered keys and values (``2 x tokens x kv_heads x head_dim``, fp32), kept for the tiles' backward.
    The tiles keep no scores and no masks (their backward recomputes them)."""
    gathered = layers * 2 * tokens * kv_heads * head_dim * 4
    return whole_mib / cp_size + gathered / 2**20


def largest(value: float) -> float:
    out = torch.tensor(float(value))
    dist.all_reduce(out, op=dist.ReduceOp.MAX)
    return out.item()


class Layout:
    """One cp size on the 4 ranks: its sharded model, optimizer and the sequences of its data-parallel replica."""

    def __init__(self, base: nn.Module, cp_size: int, *, vocab: int) -> None:
        import lightning_tp

        self.cp_size = cp_size
        self.dp_size = dist.get_world_size() // cp_size
        self.model = lightning_tp.parallelize(copy.deepcopy(base), tp_size=1, cp_size=cp_size)
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=1e-4)
        self.replica = dist.get_rank() // cp_size  # the ranks of a CP group are consecutive (cp inside dp)
        self.vocab = vocab

    def batch(self, length: int) -> dict[str, torch.Tensor]:
        generator = torch.Generator().manual_seed(1000 + self.replica)
        ids = torch.randint(0, self.vocab, (1, length), generator=generator)
        return {"input_ids": ids, "labels": ids}

    def activations(self, length: int) -> int:
        batch = self.batch(length)
        nbytes, loss = saved_bytes(self.model, batch)
        loss.backward()
        self.optimizer.zero_grad()
        return int(largest(nbytes))

    def step(self, batch: dict[str, torch.Tensor]) -> None:
        self.model(**batch).loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad()

    def step_time(self, length: int, *, steps: int) -> float:
        batch = self.batch(length)
        self.step(batch)  # warm-up
        times = []
        for _ in range(steps):
            dist.barrier()
            start = time.perf_counter()
            self.step(batch)
            times.append(largest(time.perf_counter() - start))
        return statistics.median(times)

    def longest_in(self, budget: int, *, start: int = 512, limit: int = 1 << 16) -> dict[str, int]:
        """The longest length (a multiple of ``2 x cp``) whose activations fit ``budget`` bytes, measured."""
        fits, length = 0, start
        while length <= limit and self.activations(length) <= budget:
            fits, length = length, length * 2
        if fits == 0:
            return {"tokens": 0, "probes_up_to": start}
        low, high = fits, min(length, limit * 2)
        step = max((high - low) // 16, 2 * self.cp_size)
        while high - low > step:
            middle = (low + high) // 2 // (2 * self.cp_size) * (2 * self.cp_size)
            if self.activations(middle) <= budget:
                low = middle
            else:
                high = middle
        return {"tokens": low, "resolution": step}


def plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    whole = {row["tokens"]: row["activation_mib"] for row in report["memory"]["1"]}
    for cp, rows in report["memory"].items():
        lengths = [row["tokens"] for row in rows]
        (line,) = ax.plot(lengths, [row["activation_mib"] for row in rows], marker="o", label=f"cp {cp}")
        if cp != "1":  # the goal: one process's activations over cp
            ideal = [whole[n] / int(cp) for n in lengths]
            ax.plot(lengths, ideal, linestyle=":", color=line.get_color(), label=f"cp 1 / {cp}")
    ax.axhline(report["config"]["budget_mib"], color="grey", linestyle="--", linewidth=1, label="budget")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log", base=2)
    ax.set_xlabel("sequence length (tokens)")
    ax.set_ylabel("activations kept for the backward, per rank (MiB)")
    ax.set_title(report["config"]["model"].split(";")[0], fontsize=9)
    ax.grid(True, which="both", linewidth=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


# ---------------------------------------------------------------------------------------------------------------------
# Long context (--long): packed rows against plain ones, 4k tokens and up, on 2 or 4 processes


def documents(length: int, count: int) -> torch.Tensor:
    """Position ids of one row of ``count`` packed documents of (nearly) equal length, restarting at each."""
    bounds = [length * i // count for i in range(count + 1)]
    return torch.cat([torch.arange(b - a) for a, b in zip(bounds, bounds[1:], strict=False)]).unsqueeze(0)


def long_batch(length: int, *, docs: int, vocab: int, seed: int) -> dict[str, Any]:
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (1, length), generator=generator)
    batch: dict[str, Any] = {"input_ids": ids, "labels": ids, "use_cache": False}
    if docs > 1:
        batch["position_ids"] = documents(length, docs)
    return batch


def skipped_compute(length: int, *, docs: int, cp_size: int) -> dict[str, float]:
    """What the tiles of a packed row compute against a single document's, on the busiest rank, and the theory:
    the sum of the documents' squared lengths over the whole row's squared length."""
    from lightning_tp.parallel.blockwise import first_keys, range_mask
    from lightning_tp.parallel.cp_split import local_positions, piece_starts

    positions = documents(length, docs)[0]
    starts = positions.eq(0).cumsum(0)
    ratios = []
    for rank in range(cp_size):
        local = local_positions(length, cp_size, rank)
        piece = length // (2 * cp_size)
        pieces = [(i * piece, start, piece) for i, start in enumerate(piece_starts(length, cp_size, rank))]
        costs = []
        for doc_ids in (starts, torch.zeros_like(starts)):
            low = first_keys(lambda b, h, q, k, d=doc_ids: (k <= q) & (d[q] == d[k]), local, batch=1, key_length=length)
            mask = range_mask(
                positions=local, low=low, valid=None, pieces=pieces, key_length=length, piece_count=2 * cp_size
            )
            costs.append(mask.computed())
        ratios.append(costs[0] / costs[1])
    bounds = [length * i // docs for i in range(docs + 1)]
    theory = sum((b - a) ** 2 for a, b in zip(bounds, bounds[1:], strict=False)) / length**2
    return {"computed_over_single_document": max(ratios), "theory": theory}


def long_context(args: argparse.Namespace) -> dict[str, Any]:
    """Saved bytes per token and step time against the length at each cp size the world holds, for a row of
    ``--docs`` packed documents and for one document of the same length."""
    import lightning_tp

    world, rank = dist.get_world_size(), dist.get_rank()
    base = build(
        args.kv_heads, hidden=args.hidden, layers=args.layers, heads=args.heads, vocab=args.vocab, max_positions=1 << 17
    )
    rows: list[dict[str, Any]] = []
    from lightning_tp.parallel_options import ParallelOptions

    layouts = [(cp, comm) for cp in args.cp_sizes if world % cp == 0 for comm in (args.cp_comm if cp > 1 else ["-"])]
    for cp, comm in layouts:
        options = ParallelOptions(cp_comm=comm if cp > 1 else "all_gather")
        model = lightning_tp.parallelize(copy.deepcopy(base), tp_size=1, cp_size=cp, options=options)
        optimizer = torch.optim.SGD(model.parameters(), lr=1e-4)
        for length in args.lengths:
            if cp == 1 and length > args.cp1_max:
                continue
            for docs in (args.docs, 1):
                batch = long_batch(length, docs=docs, vocab=args.vocab, seed=rank // cp)
                nbytes, loss = saved_bytes(model, batch)
                loss.backward()
                optimizer.zero_grad()
                times = []
                for _ in range(args.steps):
                    dist.barrier()
                    start = time.perf_counter()
                    model(**batch).loss.backward()
                    optimizer.step()
                    optimizer.zero_grad()
                    times.append(largest(time.perf_counter() - start))
                saved = largest(nbytes)
                rows.append(
                    {
                        "cp": cp,
                        "comm": comm,
                        "tokens": length,
                        "documents": docs,
                        "saved_mib": saved / 2**20,
                        "saved_kib_per_token": saved / 1024 / (length / cp),
                        "step_s": statistics.median(times),
                    }
                )
                if rank == 0:
                    print(json.dumps(rows[-1]), flush=True)
        del model, optimizer
    return {
        "config": {
            "model": f"Llama hidden {args.hidden}, {args.layers} layers, {args.heads} query / {args.kv_heads} KV "
            f"heads, vocab {args.vocab}, sdpa, fp32; one row per data-parallel replica, use_cache=False; gloo, {world} "
            "processes, one thread each",
            "documents": args.docs,
            "steps": args.steps,
        },
        "rows": rows,
        "skipped_compute": {
            str(length): skipped_compute(length, docs=args.docs, cp_size=2) for length in args.lengths if rank == 0
        },
    }


def plot_long(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    keys = sorted({(row["cp"], row.get("comm", "-"), row["documents"]) for row in report["rows"]})
    for cp, comm, docs in keys:
        rows = [
            row for row in report["rows"] if (row["cp"], row.get("comm", "-"), row["documents"]) == (cp, comm, docs)
        ]
        ring = ", ring" if comm == "ring" else ""
        label = f"cp {cp}{ring}, {'one document' if docs == 1 else f'{docs} packed documents'}"
        style = "-" if docs == 1 else "--"
        left.plot([r["tokens"] for r in rows], [r["saved_kib_per_token"] for r in rows], style, marker="o", label=label)
        right.plot([r["tokens"] for r in rows], [r["step_s"] for r in rows], style, marker="o", label=label)
    before = report.get("main_before_issue_36", {}).get("rows", [])
    for docs in sorted({row["documents"] for row in before}):
        rows = [row for row in before if row["documents"] == docs]
        label = f"before (masks as tensors), cp 2, {'one document' if docs == 1 else f'{docs} packed documents'}"
        style = "k-" if docs == 1 else "k--"
        left.plot([r["tokens"] for r in rows], [r["saved_kib_per_token"] for r in rows], style, marker="x", label=label)
        right.plot([r["tokens"] for r in rows], [r["step_s"] for r in rows], style, marker="x", label=label)
    for ax, ylabel in ((left, "saved for the backward per local token (KiB)"), (right, "step time (s)")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("sequence length (tokens)")
        ax.set_ylabel(ylabel)
        ax.grid(True, which="both", linewidth=0.3)
    right.set_yscale("log", base=2)
    left.set_ylim(bottom=0)
    left.legend(fontsize=7)
    fig.suptitle(report["config"]["model"].split(";")[0], fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--vocab", type=int, default=2048)
    parser.add_argument("--lengths", type=int, nargs="+", default=[1024, 2048, 4096, 8192])
    parser.add_argument("--timed-lengths", type=int, nargs="+", default=[2048, 8192])
    parser.add_argument("--budget-mib", type=float, default=256.0)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--plot-only", action="store_true", help="redraw --out's PNG from its JSON, run nothing")
    parser.add_argument("--long", action="store_true", help="long context: packed rows against one document")
    parser.add_argument("--docs", type=int, default=6, help="--long: documents packed in a row")
    parser.add_argument("--cp-sizes", type=int, nargs="+", default=[1, 2, 4], help="--long: those the world holds")
    parser.add_argument("--cp1-max", type=int, default=16384, help="--long: the longest row cp 1 runs")
    parser.add_argument("--cp-comm", nargs="+", default=["all_gather"], help="--long: all_gather and/or ring")
    args = parser.parse_args()
    draw = plot_long if args.long else plot
    if args.out is not None:  # the plot is drawn next to it, once everything is measured
        require("matplotlib", why="the plot next to --out")
    if args.plot_only:
        draw(json.loads(args.out.read_text()), args.out.with_suffix(".png"))
        return
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=timedelta(seconds=1800 if args.long else 900))
    if args.long:
        report = long_context(args)
        if dist.get_rank() == 0 and args.out is not None:
            args.out.write_text(json.dumps(report, indent=2) + "\n")
            draw(report, args.out.with_suffix(".png"))
        dist.destroy_process_group()
        return
    assert dist.get_world_size() == 4, "launch with --nproc-per-node 4 (cp 1, 2 and 4 on the same ranks)"
    base = build(
        args.kv_heads, hidden=args.hidden, layers=args.layers, heads=args.heads, vocab=args.vocab, max_positions=1 << 17
    )
    head_dim = args.hidden // args.heads
    layouts = {cp: Layout(base, cp, vocab=args.vocab) for cp in (1, 2, 4)}
    memory: dict[int, list[dict]] = {}
    for cp, layout in layouts.items():
        memory[cp] = [
            {"tokens": n, "activation_mib": layout.activations(n) / 2**20} for n in args.lengths if n % (2 * cp) == 0
        ]
    for cp in (2, 4):  # the ratio to one process's (cp 1) at each length, and what the theory predicts
        for row, whole in zip(memory[cp], memory[1], strict=True):
            row["over_cp1"] = row["activation_mib"] / whole["activation_mib"]
            row["predicted_mib"] = predicted_mib(
                whole["activation_mib"],
                row["tokens"],
                cp,
                layers=args.layers,
                kv_heads=args.kv_heads,
                head_dim=head_dim,
            )
    budget = int(args.budget_mib * 2**20)
    longest = {cp: layout.longest_in(budget) for cp, layout in layouts.items()}
    timing: dict[int, list[dict]] = {}
    collectives: dict[int, list[dict]] = {}
    for n in args.timed_lengths:
        base_counts = count_collectives(lambda n=n: layouts[1].step(layouts[1].batch(n)))
        for cp, layout in layouts.items():
            seconds = layout.step_time(n, steps=args.steps)
            tokens = layout.dp_size * n
            timing.setdefault(cp, []).append(
                {"tokens": n, "step_s": seconds, "tokens_per_s_per_rank": tokens / seconds / dist.get_world_size()}
            )
            if cp == 1:
                continue
            counts = count_collectives(lambda n=n, layout=layout: layout.step(layout.batch(n)))
            added = {
                kind: {
                    "count": value["count"] - base_counts.get("total", base_counts).get(kind, {}).get("count", 0),
                    "bytes": value["bytes"] - base_counts.get("total", base_counts).get(kind, {}).get("bytes", 0),
                }
                for kind, value in counts.get("total", counts).items()
            }
            kv_bytes = 2 * args.kv_heads * head_dim * n * 4  # K and V of the whole sequence, fp32, per layer
            collectives.setdefault(cp, []).append(
                {
                    "tokens": n,
                    "added": {kind: value for kind, value in added.items() if value["count"] or value["bytes"]},
                    "theory": {
                        "all_gather": {"count": args.layers, "bytes": args.layers * kv_bytes},
                        "reduce_scatter": {"count": args.layers, "bytes": args.layers * kv_bytes},
                        "all_reduce": {"count": 1, "bytes": 4},
                    },
                }
            )
    report = {
        "config": {
            "model": f"Llama hidden {args.hidden}, {args.layers} layers, {args.heads} query / {args.kv_heads} KV "
            f"heads, vocab {args.vocab}, sdpa, fp32; batch 1 per replica; gloo, 4 processes, one thread each",
            "budget_mib": args.budget_mib,
            "lengths": args.lengths,
        },
        "memory": memory,
        "longest_sequence_in_budget": longest,
        "longest_over_cp1": {cp: longest[cp]["tokens"] / max(longest[1]["tokens"], 1) for cp in (2, 4)},
        "timing": timing,
        "collectives_added_by_cp": collectives,
    }
    if dist.get_rank() == 0:
        text = json.dumps(report, indent=2)
        print(text)
        if args.out is not None:
            args.out.write_text(text + "\n")
            plot(json.loads(text), args.out.with_suffix(".png"))  # the file's form: lengths as string keys
    dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
