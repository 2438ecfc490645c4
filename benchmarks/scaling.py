"""How TP 2 scales with the model: one process against ``TensorParallelStrategy(tp_size=2)`` and the hand-written plan,
over model sizes (hidden 256 -> 2048) and sequence lengths, every point measured by ``benchmarks/run.py`` (its method:
one thread per rank, ``--rounds`` interleaved launches (1 in the committed run), the median step; its collective
counts against the theory).

    python benchmarks/scaling.py --out benchmarks/scaling.json      # writes scaling.json, scaling.md, scaling.png

Per point: tokens/s, the step time and its forward / backward / optimizer split, peak memory per rank, the collectives
per step, the TP 2 speedup (one-process step time / TP 2 step time) and the strong-scaling efficiency (one-process time
/ (ranks x TP 2 time)); the JSON's top level holds ``tp2_speedup_at_largest`` (the largest model at the first length)
and ``tp2_over_hand_tp2`` per point. On this machine two ranks share two cores, so 2.0 is the limit.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RUNS = ("single", "tp2", "hand_tp2")


def measure(hidden: int, seq: int, args: argparse.Namespace) -> dict:
    """One ``benchmarks/run.py`` launch set at this size: its runs by name."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "point.json"
        command = [
            sys.executable,
            str(ROOT / "benchmarks" / "run.py"),
            "--device",
            "cpu",
            "--variants",
            ",".join(RUNS),
            "--hidden",
            str(hidden),
            "--heads",
            str(max(4, hidden // 64)),
            "--layers",
            str(args.layers),
            "--vocab",
            str(args.vocab),
            "--seq-len",
            str(seq),
            "--batch-size",
            str(args.batch_size),
            "--steps",
            str(args.steps),
            "--warmup",
            "1",
            "--rounds",
            str(args.rounds),
            "--out",
            str(out),
        ]
        subprocess.run(command, check=True, cwd=ROOT, stdout=subprocess.DEVNULL)
        report = json.loads(out.read_text())
    return {run["name"]: run for run in report["runs"]}


def point(hidden: int, seq: int, runs: dict) -> dict:
    single, tp2, hand = runs["single"], runs["tp2"], runs["hand_tp2"]
    speedup = single["step_time_s"] / tp2["step_time_s"]
    return {
        "hidden": hidden,
        "seq_len": seq,
        "step_time_s": {name: runs[name]["step_time_s"] for name in RUNS},
        "phase_time_s": {name: runs[name]["phase_time_s"] for name in RUNS},
        "tokens_per_s": {name: runs[name]["tokens_per_s"] for name in RUNS},
        "peak_mem_mb": {name: max(runs[name]["peak_mem_mb"]) for name in RUNS},
        "collectives": {name: runs[name]["collectives"] for name in ("tp2", "hand_tp2")},
        "tp2_speedup": speedup,
        "strong_scaling_efficiency": speedup / 2,
        "tp2_over_hand_tp2": tp2["step_time_s"] / hand["step_time_s"],
    }


def plot(points: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for seq in sorted({p["seq_len"] for p in points}):
        row = [p for p in points if p["seq_len"] == seq]
        speedups = [p["tp2_speedup"] for p in row]
        ax.plot([p["hidden"] for p in row], speedups, marker="o", label=f"sequences of {seq} tokens")
    ax.axhline(2.0, color="grey", linestyle=":", label="limit (2 ranks)")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("hidden size")
    ax.set_ylabel("TP 2 speedup over one process")
    ax.set_title("TP 2 on 2 CPU cores (gloo, one thread per rank)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def table(points: list[dict]) -> str:
    lines = [
        "| hidden | sequence length | one process (ms) | TP 2 (ms) | hand plan (ms) | TP 2 speedup | efficiency "
        "| TP 2 / hand | peak MiB per rank (1 / TP 2) |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for p in points:
        t, m = p["step_time_s"], p["peak_mem_mb"]
        lines.append(
            f"| {p['hidden']} | {p['seq_len']} | {t['single'] * 1e3:.0f} | {t['tp2'] * 1e3:.0f} | "
            f"{t['hand_tp2'] * 1e3:.0f} | {p['tp2_speedup']:.2f}x | {p['strong_scaling_efficiency']:.2f} | "
            f"{p['tp2_over_hand_tp2']:.2f} | {m['single']:.0f} / {m['tp2']:.0f} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hidden", type=int, nargs="+", default=[256, 512, 1024, 2048])
    parser.add_argument("--seq-lens", type=int, nargs="+", default=[256, 1024])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=4096)
    parser.add_argument("--batch-size", type=int, default=2)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "scaling.json")
    parser.add_argument("--plot-only", action="store_true", help="redraw --out's table and plot from its JSON")
    args = parser.parse_args()
    if args.plot_only:
        points = json.loads(args.out.read_text())["points"]
        args.out.with_suffix(".md").write_text(table(points) + "\n")
        plot(points, args.out.with_suffix(".png"))
        return
    points = []
    for seq in args.seq_lens:
        for hidden in args.hidden:
            print(f"hidden {hidden}, sequences of {seq} tokens", flush=True)
            points.append(point(hidden, seq, measure(hidden, seq, args)))
    largest = next(p for p in points if p["hidden"] == max(args.hidden) and p["seq_len"] == args.seq_lens[0])
    report = {
        "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "tp2_speedup_at_largest": largest["tp2_speedup"],
        "points": points,
    }
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    args.out.with_suffix(".md").write_text(table(points) + "\n")
    plot(points, args.out.with_suffix(".png"))
    print(table(points))


if __name__ == "__main__":
    main()
