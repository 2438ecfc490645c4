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
- **Bubble**: ``1 - T1 / (p x Tpp)``, where ``T1`` is one process's step time and ``Tpp`` the pipeline's: the share of
  the ``p`` ranks' time not spent on one process's work (the schedule's idle time, plus the point-to-point sends and
  the per-micro-batch overheads). Theory for ``v`` stages per rank: ``(p - 1) / (v m + p - 1)`` of the step.
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


def run(layout: dict, *, size: str, args: argparse.Namespace, batch: dict) -> dict:
    import torch
    import torch.distributed as dist

    import lightning_tp
    from lightning_tp.parallelize import ParallelOptions

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
    times = []
    if not single or rank == 0:
        for step in range(args.steps + 1):
            start = time.perf_counter()
            model(**batch).loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            if step:
                times.append(time.perf_counter() - start)
    held = state_bytes(model) if (not single or rank == 0) else 0
    result = torch.tensor([statistics.median(times) if times else 0.0, float(held)])
    gathered = [torch.zeros(2, dtype=torch.float64) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, result.double())
    del model, optimizer
    values = gathered[:1] if single else gathered
    return {
        "step_s": max(v[0].item() for v in values),
        "state_mib_per_rank": max(v[1].item() for v in values) / 2**20,
        "rows": rows,
    }


def layouts(args: argparse.Namespace) -> list[dict]:
    out = [
        {"name": "one process"},
        {"name": "tp 2", "tp_size": 2},
        {"name": "fsdp2 over 2", "tp_size": 1, "dp_shard_size": 2},
    ]
    for m in args.microbatches:
        out.append({"name": f"pp 2, 1F1B, m={m}", "tp_size": 1, "pp_size": 2, "options": {"pp_microbatches": m}})
    for m in [m for m in args.microbatches if m % 2 == 0 and m >= 4]:
        options = {"pp_microbatches": m, "pp_stages_per_rank": 2}
        out.append({"name": f"pp 2, Interleaved1F1B, v=2, m={m}", "tp_size": 1, "pp_size": 2, "options": options})
    return out


def theory(layout: dict) -> float | None:
    options = layout.get("options", {})
    if "pp_microbatches" not in options:
        return None
    p, m, v = layout["pp_size"], options["pp_microbatches"], options.get("pp_stages_per_rank", 1)
    return (p - 1) / (v * m + p - 1)


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
    args = parser.parse_args()
    if args.out is not None:
        require("matplotlib", why="the plot next to --out")
    if args.plot_only:
        plot(json.loads(args.out.read_text()), args.out.with_suffix(".png"))
        return

    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo", timeout=timedelta(minutes=5))
    assert dist.get_world_size() == 2, "run with torchrun --nproc-per-node 2"
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(0, args.vocab, (args.batch, args.seq), generator=generator)
    batch = {"input_ids": ids, "labels": ids.clone()}
    results: dict[str, dict] = {}
    for size in args.sizes:
        rows = {}
        for layout in layouts(args):
            row = run(layout, size=size, args=args, batch=batch)
            expected = theory(layout)
            if expected is not None:
                row["schedule"] = "Interleaved1F1B" if "Interleaved" in layout["name"] else "1F1B"
                row["microbatches"] = layout["options"]["pp_microbatches"]
                row["bubble_theory"] = expected
            rows[layout["name"]] = row
            if dist.get_rank() == 0:
                print(f"{size:6s} {layout['name']:34s} {row['step_s']:.3f} s  {row['state_mib_per_rank']:.1f} MiB")
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
        plot(report, args.out.with_suffix(".png"))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
