"""What pipeline parallelism buys and costs on 2 ranks, side by side in one launch: pp 2 (1F1B at 2, 4 and 8
micro-batches, and Interleaved1F1B with 2 stages per rank at 4 and 8) against TP 2, FSDP2 over 2 ranks and one process,
at two model sizes: step time, the model state each rank holds, and the measured bubble against the schedule's theory.

    torchrun --standalone --nproc-per-node 2 benchmarks/pipeline.py --out benchmarks/pipeline.json

- **Step time**: forward, backward and SGD step of one global batch (``--batch`` rows of ``--seq`` tokens, every
  layout the same batch: pp and TP ranks read it whole, FSDP2's data-parallel ranks half each), median of ``--steps``
  after a warm-up, the slowest rank. One process runs on rank 0 while rank 1 waits. Each process has one thread
  (torchrun's ``OMP_NUM_THREADS=1``), so one process computes at one core's speed and 2 ranks at two.
- **Model state per rank**: the bytes of the parameters, their gradients and SGD's momentum one rank holds (exact,
  from the tensors; the activations are left out: with 1F1B a stage keeps at most ``p`` micro-batches' in flight).
- **Bubble from step times**: ``1 - T1 / (p x Tpp)``, where ``T1`` is one process's step time and ``Tpp`` the
  pipeline's: the share of the ``p`` ranks' time not spent on one process's work (the schedule's idle time, plus the
  point-to-point sends and the per-micro-batch overheads, and micro-batches' lower efficiency). Theory for ``v`` stages
  per rank: ``(p - 1) / (v m + p - 1)`` of the step.
- **Bubble measured as idle time** (``bubble_idle``): each rank's schedule actions are timed (torch's stage methods
  ``forward_one_chunk``, ``backward_one_chunk`` and ``backward_weight_one_chunk``, wrapped for the run); a step's
  window runs from the first action of any rank to the last action of any rank, and a rank's idle share is the window
  less the time inside its actions (waiting on a receive counts as idle, the sends it posts as busy), over the window,
  averaged over the ranks and the timed steps. ``stage_imbalance``: the busiest rank's action time over the ranks'
  mean (the theory assumes 1).
  ``--bubble`` runs this alone, for 1F1B, Interleaved1F1B and the zero-bubble schedules at each ``--microbatches``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from datetime import timedelta
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.requirements import require  # noqa: E402

SIZES = {"small": {"hidden": 256, "intermediate": 704}, "large": {"hidden": 512, "intermediate": 1408}}


def build(size: str, *, layers: int, vocab: int):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=SIZES[size]["hidden"],
        intermediate_size=SIZES[size]["intermediate"],
        num_hidden_layers=layers,
        num_attention_heads=8,
        num_key_value_heads=4,
        max_position_embeddings=4096,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    return LlamaForCausalLM(config)


def state_bytes(model) -> int:
    """Parameters, gradients and SGD momentum this rank holds (local shards)."""
    from torch.distributed.tensor import DTensor

    total = 0
    for p in model.parameters():
        local = p.to_local() if isinstance(p, DTensor) else p
        total += 3 * local.numel() * local.element_size()
    return total


class ActionTimer:
    """Times each rank's pipeline actions: torch's ``PipelineStage`` compute methods wrapped while the context is
    open (class attributes, put back on exit), each call's ``(start, end)`` kept for the current step."""

    METHODS = ("forward_one_chunk", "backward_one_chunk", "backward_weight_one_chunk")

    def __init__(self) -> None:
        self.spans: list[tuple[float, float]] = []
        self.saved: dict[str, object] = {}

    def __enter__(self) -> ActionTimer:
        from torch.distributed.pipelining.stage import _PipelineStageBase as Stage  # noqa: PLC2701 (a benchmark)

        def timed(method):
            def call(stage, *args, **kwargs):
                start = time.perf_counter()
                try:
                    return method(stage, *args, **kwargs)
                finally:
                    self.spans.append((start, time.perf_counter()))

            return call

        for name in self.METHODS:
            self.saved[name] = getattr(Stage, name)
            setattr(Stage, name, timed(self.saved[name]))
        return self

    def __exit__(self, *exc: object) -> None:
        from torch.distributed.pipelining.stage import _PipelineStageBase as Stage  # noqa: PLC2701

        for name, method in self.saved.items():
            setattr(Stage, name, method)

    def step(self) -> tuple[float, float, float]:
        """This step's first action's start, last action's end and the time inside its actions (``perf_counter``:
        one monotonic clock for the processes of one machine); clears the spans."""
        spans, self.spans = self.spans, []
        if not spans:
            return 0.0, 0.0, 0.0
        return min(start for start, _ in spans), max(end for _, end in spans), sum(end - start for start, end in spans)


def run(layout: dict, *, size: str, args: argparse.Namespace, batch: dict) -> dict:
    import torch
    import torch.distributed as dist

    import lightning_tp
    from lightning_tp.parallel_options import ParallelOptions

    rank = dist.get_rank()
    single = layout["name"] == "one process"
    model = build(size, layers=args.layers, vocab=args.vocab)
    if not single:
        options = ParallelOptions(**layout.get("options", {}))
        sizes = {k: v for k, v in layout.items() if k.endswith("_size")}
        model = lightning_tp.parallelize(model, options=options, **sizes)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)
    rows = batch["input_ids"].shape[0]
    dp = layout.get("dp_shard_size", 1) or 1
    if dp > 1:
        batch = {k: v.chunk(dp)[rank % dp] for k, v in batch.items()}
    times, actions = [], torch.zeros(args.steps, 3, dtype=torch.float64)
    if not single or rank == 0:
        with ActionTimer() as timer:
            for step in range(args.steps + 1):
                start = time.perf_counter()
                model(**batch).loss.backward()
                optimizer.step()
                optimizer.zero_grad()
                first, last, busy = timer.step()
                if step:
                    times.append(time.perf_counter() - start)
                    actions[step - 1] = torch.tensor([first, last, busy], dtype=torch.float64)
    held = state_bytes(model) if (not single or rank == 0) else 0
    result = torch.tensor([statistics.median(times) if times else 0.0, float(held)])
    gathered = [torch.zeros(2, dtype=torch.float64) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, result.double())
    every = [torch.zeros_like(actions) for _ in range(dist.get_world_size())]
    dist.all_gather(every, actions)
    del model, optimizer
    values = gathered[:1] if single else gathered
    out = {
        "step_s": max(v[0].item() for v in values),
        "state_mib_per_rank": max(v[1].item() for v in values) / 2**20,
        "rows": rows,
    }
    if layout.get("pp_size", 1) > 1:
        # Each step's window: from the first action of any rank to the last action of any rank (the pipeline's fill
        # and drain are idle time of the ranks that wait in them); a rank's idle share is the window less its busy time.
        stacked = torch.stack(every)  # (ranks, steps, 3)
        window = stacked[..., 1].max(dim=0).values - stacked[..., 0].min(dim=0).values
        out["bubble_idle"] = (1 - stacked[..., 2] / window).mean().item()
        # How uneven the stages are (the theory assumes equal ones): the busiest rank's time over the mean.
        busy = stacked[..., 2].mean(dim=1)
        out["stage_imbalance"] = (busy.max() / busy.mean()).item()
    return out


#: The schedules of ``--bubble`` with their stages per rank.
BUBBLE_SCHEDULES = {"1F1B": 1, "Interleaved1F1B": 2, "ZBVZeroBubble": 2, "InterleavedZeroBubble": 2}


def rebuild_cost(args: argparse.Namespace, *, size: str) -> dict:
    """What a new batch shape costs under pp 2 (1F1B, 4 micro-batches): torch's stages fix their buffers' shapes, so
    the first step of each shape builds a new set of stages and schedule and runs an extra forward to infer the
    shapes. The first step at ``--seq`` (warm-up), then the first and the second step at three quarters of it."""
    import torch
    import torch.distributed as dist

    import lightning_tp
    from lightning_tp.parallel_options import ParallelOptions

    model = build(size, layers=args.layers, vocab=args.vocab)
    lightning_tp.parallelize(model, tp_size=1, pp_size=2, options=ParallelOptions(pp_microbatches=4))
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)
    generator = torch.Generator().manual_seed(1)
    times = []
    for seq in (args.seq, args.seq, args.seq * 3 // 4, args.seq * 3 // 4):
        ids = torch.randint(0, args.vocab, (args.batch, seq), generator=generator)
        dist.barrier()
        start = time.perf_counter()
        model(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        times.append(time.perf_counter() - start)
    first_new, steady = times[2], times[3]
    return {"first_step_new_shape_s": first_new, "steady_step_s": steady, "ratio": first_new / steady}


def lengths_growth(args: argparse.Namespace, *, size: str) -> dict:
    """What dynamic padding costs in memory under pp 2 (1F1B, 4 micro-batches): live memory
    (``tests.helpers.models.live_mib``: the resident set after a garbage collection and glibc's ``malloc_trim``)
    after each of 12 steps of 12 lengths (``--seq`` to 2.2 x ``--seq``, shuffled), its growth from the second step to
    the last, against 12 steps of the longest length; with the stages kept as shipped (the last ``KEPT_SHAPES``
    shapes), kept for every shape (what the package did before), and with ``pp_pad_to_multiple_of=64``."""
    import random

    import torch
    import torch.distributed as dist

    import lightning_tp
    import lightning_tp.parallel.pipeline as pipeline
    from lightning_tp.parallel_options import ParallelOptions
    from tests.helpers.models import live_mib

    shipped = pipeline.KEPT_SHAPES
    lengths = [args.seq + step * args.seq // 10 for step in range(12)]
    random.Random(0).shuffle(lengths)
    runs = {
        "one length (the longest)": (shipped, None, [max(lengths)] * 12),
        "12 lengths, every shape kept (before)": (10**6, None, lengths),
        f"12 lengths, the last {shipped} shapes kept": (shipped, None, lengths),
        f"12 lengths, the last {shipped} kept, padded to multiples of 64": (shipped, 64, lengths),
    }
    out = {}
    for name, (kept, multiple, seqs) in runs.items():
        pipeline.KEPT_SHAPES = kept
        model = build(size, layers=args.layers, vocab=args.vocab)
        options = ParallelOptions(pp_microbatches=4, pp_pad_to_multiple_of=multiple)
        lightning_tp.parallelize(model, tp_size=1, pp_size=2, options=options)
        optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
        generator = torch.Generator().manual_seed(1)
        live = []
        for seq in seqs:
            ids = torch.randint(0, args.vocab, (args.batch, seq), generator=generator)
            model(input_ids=ids, labels=ids).loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            live.append(live_mib())
        growth = torch.tensor([live[-1] - live[1]])
        dist.all_reduce(growth, op=dist.ReduceOp.MAX)
        shapes = len(pipeline.pipeline_runner(model)._schedules)
        out[name] = {"live_growth_mib": round(float(growth), 1), "kept_shapes": shapes}
        del model, optimizer
    pipeline.KEPT_SHAPES = shipped
    return out


def layouts(args: argparse.Namespace) -> list[dict]:
    out = (
        []
        if args.bubble
        else [
            {"name": "one process"},
            {"name": "tp 2", "tp_size": 2},
            {"name": "fsdp2 over 2", "tp_size": 1, "dp_shard_size": 2},
        ]
    )
    schedules = BUBBLE_SCHEDULES if args.bubble else {"1F1B": 1, "Interleaved1F1B": 2}
    schedules = {name: v for name, v in schedules.items() if args.schedules is None or name in args.schedules}
    for schedule, v in schedules.items():
        for m in args.microbatches:
            if v > 1 and (m % 2 or m < 4):
                continue
            options = {"pp_microbatches": m, "pp_stages_per_rank": v, "pp_schedule": schedule}
            name = f"pp 2, {schedule}, m={m}" if v == 1 else f"pp 2, {schedule}, v={v}, m={m}"
            out.append({"name": name, "tp_size": 1, "pp_size": 2, "options": options})
    return out


def theory(layout: dict) -> float | None:
    """The idle share of 1F1B and interleaved 1F1B, ``(p - 1) / (v m + p - 1)``; ``None`` for the zero-bubble
    schedules (theirs depends on the ratio of the forward, input-gradient and weight-gradient times) and the others."""
    options = layout.get("options", {})
    if "pp_microbatches" not in options or "ZeroBubble" in options["pp_schedule"]:
        return None
    p, m, v = layout["pp_size"], options["pp_microbatches"], options.get("pp_stages_per_rank", 1)
    return (p - 1) / (v * m + p - 1)


def plot_bubble(report: dict, path: Path) -> None:
    """The measured idle share against the micro-batches, per schedule, beside the theory of 1F1B and interleaved."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axis = plt.subplots(figsize=(6, 4))
    for size, rows in report["results"].items():
        for schedule in BUBBLE_SCHEDULES:
            points = sorted((r["microbatches"], r["bubble_idle"]) for r in rows.values() if r["schedule"] == schedule)
            if points:
                axis.plot(*zip(*points, strict=True), marker="o", label=f"{size}, {schedule}, measured idle")
    ms = sorted({r["microbatches"] for rows in report["results"].values() for r in rows.values()})
    axis.plot(ms, [1 / (m + 1) for m in ms], "k--", label="theory, 1F1B: (p-1)/(m+p-1)")
    axis.plot(ms, [1 / (2 * m + 1) for m in ms], "k:", label="theory, interleaved v=2")
    axis.set_xlabel("micro-batches m")
    axis.set_ylabel("idle share of each rank's step")
    axis.set_xscale("log", base=2)
    axis.legend(fontsize=7)
    axis.set_title("pp 2: idle time between the schedule's actions")
    figure.tight_layout()
    figure.savefig(path, dpi=120)


def plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(1, 2, figsize=(11, 4))
    for size, rows in report["results"].items():
        one = rows["one process"]["step_s"]
        for schedule, marker in (("1F1B", "o"), ("Interleaved1F1B", "s")):
            points = [(r["microbatches"], r["bubble"]) for r in rows.values() if r.get("schedule") == schedule]
            if points:
                axes[0].plot(*zip(*points, strict=True), marker=marker, label=f"{size}, {schedule}, measured")
        names = list(rows)
        axes[1].bar([f"{size}\n{n}" for n in names], [one / rows[n]["step_s"] for n in names], label=size, alpha=0.7)
    ms = sorted(
        {r["microbatches"] for rows in report["results"].values() for r in rows.values() if "microbatches" in r}
    )
    axes[0].plot(ms, [1 / (m + 1) for m in ms], "k--", label="theory, 1F1B: (p-1)/(m+p-1)")
    axes[0].plot(ms, [1 / (2 * m + 1) for m in ms], "k:", label="theory, interleaved v=2")
    axes[0].set_xlabel("micro-batches m")
    axes[0].set_ylabel("bubble (share of the ranks' time)")
    axes[0].set_xscale("log", base=2)
    axes[0].legend(fontsize=7)
    axes[0].set_title("pp 2: measured bubble against theory")
    axes[1].set_ylabel("speed-up over one process (step time ratio)")
    axes[1].tick_params(axis="x", labelrotation=90, labelsize=6)
    axes[1].set_title("step time, 2 ranks of one thread each")
    figure.tight_layout()
    figure.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=4096)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--microbatches", type=int, nargs="+", default=[2, 4, 8])
    parser.add_argument("--sizes", nargs="+", default=list(SIZES))
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--plot-only", action="store_true", help="redraw --out's PNG from its JSON, run nothing")
    parser.add_argument("--bubble", action="store_true", help="only the pipelines' idle time, for every schedule")
    parser.add_argument("--schedules", nargs="+", default=None, help="only these pipeline schedules")
    parser.add_argument("--rebuild", action="store_true", help="only the cost of a new batch shape (pp 2, 1F1B)")
    parser.add_argument("--lengths", action="store_true", help="only the memory of 12 batch lengths (pp 2, 1F1B)")
    args = parser.parse_args()
    if args.out is not None:
        require("matplotlib", why="the plot next to --out")
    if args.plot_only:
        (plot_bubble if args.bubble else plot)(json.loads(args.out.read_text()), args.out.with_suffix(".png"))
        return

    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo", timeout=timedelta(minutes=5))
    assert dist.get_world_size() == 2, "run with torchrun --nproc-per-node 2"
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(0, args.vocab, (args.batch, args.seq), generator=generator)
    batch = {"input_ids": ids, "labels": ids.clone()}
    single = lengths_growth if args.lengths else rebuild_cost if args.rebuild else None
    if single is not None:  # one measurement alone, printed per size
        for size in args.sizes:
            measured = single(args, size=size)
            if dist.get_rank() == 0:
                print(f"{size}: {json.dumps(measured)}")
        dist.destroy_process_group()
        return
    results: dict[str, dict] = {}
    for size in args.sizes:
        rows = {}
        for layout in layouts(args):
            row = run(layout, size=size, args=args, batch=batch)
            expected = theory(layout)
            if "options" in layout:
                row["schedule"] = layout["options"]["pp_schedule"]
                row["microbatches"] = layout["options"]["pp_microbatches"]
                row["bubble_theory"] = expected
            rows[layout["name"]] = row
            if dist.get_rank() == 0:
                idle = (
                    f"  idle {row['bubble_idle']:.3f} imbalance {row['stage_imbalance']:.2f}"
                    if "bubble_idle" in row
                    else ""
                )
                idle += f" (theory {expected:.3f})" if expected is not None else ""
                print(
                    f"{size:6s} {layout['name']:44s} {row['step_s']:.3f} s  {row['state_mib_per_rank']:.1f} MiB{idle}"
                )
        if "one process" in rows:
            one = rows["one process"]["step_s"]
            for row in rows.values():
                if "microbatches" in row:
                    row["bubble"] = 1 - one / (2 * row["step_s"])
        results[size] = rows
    if dist.get_rank() == 0 and args.out is not None:
        report = {
            "command": "torchrun --standalone --nproc-per-node 2 benchmarks/pipeline.py " + " ".join(sys.argv[1:]),
            "machine": f"{os.cpu_count()} cores, torch {torch.__version__}",
            "settings": {k: v for k, v in vars(args).items() if k not in ("out", "plot_only")},
            "results": results,
        }
        args.out.write_text(json.dumps(report, indent=1, default=str))
        (plot_bubble if args.bubble else plot)(report, args.out.with_suffix(".png"))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
