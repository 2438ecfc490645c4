"""How TP 2 scales with the model: one process against ``TensorParallelStrategy(tp_size=2)`` and the hand-written plan,
and ``dp_shard 2 x tp 2`` on 4 processes, over model sizes (hidden 256 -> 2048) and sequence lengths, every point
measured by ``benchmarks/run.py`` (its method: one thread per rank, ``--rounds`` interleaved launches, the median step
over them; its collective counts against the theory; the time in collectives, each call and its wait).

    python benchmarks/scaling.py --out benchmarks/scaling.json      # writes scaling.json, scaling.md, scaling.png

Per point: tokens/s, the step time and its forward / backward / optimizer split, the step split into compute and
collectives, peak memory per rank, the collectives per step, the TP 2 speedup (one-process step time / TP 2 step time)
and the strong-scaling efficiency (one-process time / (ranks x TP 2 time)); for 2 x 2 the efficiency is its tokens/s
over 4 x one process's. The JSON's top level holds ``tp2_speedup_at_largest`` (the largest model at the first length)
and ``tp2_over_hand_tp2`` per point. On this machine two ranks share two cores, so 2.0 is TP 2's limit; the 4
processes of 2 x 2 share the same 2 cores, so its efficiency is at most 0.5 here (its figures show FSDP2's cost on top
of TP, not a speedup).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.requirements import require  # noqa: E402

RUNS = ("single", "tp2", "hand_tp2")
TWO_D = "tp2_dp2"


def measure(hidden: int, seq: int, args: argparse.Namespace, *, runs: tuple[str, ...], rounds: int) -> dict:
    """One ``benchmarks/run.py`` launch set at this size: its runs by name."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "point.json"
        command = [
            sys.executable,
            str(ROOT / "benchmarks" / "run.py"),
            "--device",
            "cpu",
            "--variants",
            ",".join(runs),
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
            str(rounds),
            "--out",
            str(out),
        ]
        subprocess.run(command, check=True, cwd=ROOT, stdout=subprocess.DEVNULL)
        report = json.loads(out.read_text())
    return {run["name"]: run for run in report["runs"]}


def point(hidden: int, seq: int, runs: dict) -> dict:
    single, tp2, hand = runs["single"], runs["tp2"], runs["hand_tp2"]
    names = [name for name in (*RUNS, TWO_D) if name in runs]
    speedup = single["step_time_s"] / tp2["step_time_s"]
    out = {
        "hidden": hidden,
        "seq_len": seq,
        "step_time_s": {name: runs[name]["step_time_s"] for name in names},
        "step_time_per_round_s": {name: runs[name]["step_time_per_round_s"] for name in names},
        "phase_time_s": {name: runs[name]["phase_time_s"] for name in names},
        "collective_time_s": {name: runs[name]["collective_time_s"] for name in names},
        "compute_time_s": {name: runs[name]["compute_time_s"] for name in names},
        "tokens_per_s": {name: runs[name]["tokens_per_s"] for name in names},
        "peak_mem_mb": {name: max(runs[name]["peak_mem_mb"]) for name in names},
        "collectives": {name: runs[name]["collectives"] for name in names if name != "single"},
        "tp2_speedup": speedup,
        "strong_scaling_efficiency": speedup / 2,
        "tp2_over_hand_tp2": tp2["step_time_s"] / hand["step_time_s"],
        # Where TP 2's step goes beyond a perfect split of one process's: the collectives, and compute above half.
        "tp2_collective_share": tp2["collective_time_s"] / tp2["step_time_s"],
        "tp2_compute_over_half_single": tp2["compute_time_s"] / (single["step_time_s"] / 2),
    }
    if TWO_D in runs:
        out["tp2_dp2_efficiency"] = runs[TWO_D]["tokens_per_s"] / (4 * single["tokens_per_s"])
    return out


def plot(points: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (speed, split) = plt.subplots(1, 2, figsize=(11, 4))
    for seq in sorted({p["seq_len"] for p in points}):
        row = [p for p in points if p["seq_len"] == seq]
        hidden = [p["hidden"] for p in row]
        (line,) = speed.plot(hidden, [p["tp2_speedup"] for p in row], marker="o", label=f"TP 2, {seq} tokens")
        hand = [p["step_time_s"]["single"] / p["step_time_s"]["hand_tp2"] for p in row]
        speed.plot(hidden, hand, marker="x", linestyle=":", color=line.get_color(), label=f"hand plan, {seq} tokens")
        split.plot(hidden, [p["tp2_collective_share"] for p in row], marker="o", label=f"collectives, {seq} tokens")
        split.plot(
            hidden,
            [p["tp2_compute_over_half_single"] - 1 for p in row],
            marker="s",
            linestyle="--",
            color=split.lines[-1].get_color(),
            label=f"compute above half of one process's step, {seq} tokens",
        )
    speed.axhline(2.0, color="grey", linestyle=":", label="limit (2 ranks)")
    for ax in (speed, split):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("hidden size")
    speed.set_ylabel("speedup over one process")
    speed.set_title("TP 2 on 2 CPU cores (gloo, one thread per rank)")
    speed.legend(fontsize=8)
    split.set_ylabel("fraction of the TP 2 step time / of half a step")
    split.set_title("Where TP 2's time goes beyond a perfect split")
    split.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def table(points: list[dict]) -> str:
    lines = [
        "| hidden | sequence length | one process (ms) | TP 2 (ms) | hand plan (ms) | TP 2 speedup | efficiency "
        "| TP 2 / hand | TP 2 compute / collectives (ms) | 2 x 2 tokens/s vs one process | peak MiB per rank "
        "(1 / TP 2) |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for p in points:
        t, m = p["step_time_s"], p["peak_mem_mb"]
        two_d = f"{4 * p['tp2_dp2_efficiency']:.2f}x" if "tp2_dp2_efficiency" in p else "-"
        lines.append(
            f"| {p['hidden']} | {p['seq_len']} | {t['single'] * 1e3:.0f} | {t['tp2'] * 1e3:.0f} | "
            f"{t['hand_tp2'] * 1e3:.0f} | {p['tp2_speedup']:.2f}x | {p['strong_scaling_efficiency']:.2f} | "
            f"{p['tp2_over_hand_tp2']:.2f} | {p['compute_time_s']['tp2'] * 1e3:.0f} / "
            f"{p['collective_time_s']['tp2'] * 1e3:.0f} | {two_d} | {m['single']:.0f} / {m['tp2']:.0f} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hidden", type=int, nargs="+", default=[256, 512, 1024, 2048])
    parser.add_argument("--seq-lens", type=int, nargs="+", default=[256, 512])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=4096)
    parser.add_argument("--batch-size", type=int, default=2)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=2, help="interleaved rounds of the 2-process runs")
    parser.add_argument(
        "--two-d-rounds", type=int, default=1, help="rounds of dp_shard 2 x tp 2 on 4 processes (0: left out)"
    )
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "scaling.json")
    parser.add_argument("--plot-only", action="store_true", help="redraw --out's table and plot from its JSON")
    args = parser.parse_args()
    require("matplotlib", why="the plot")
    if args.plot_only:
        points = json.loads(args.out.read_text())["points"]
        args.out.with_suffix(".md").write_text(table(points) + "\n")
        plot(points, args.out.with_suffix(".png"))
        return
    points = []
    for seq in args.seq_lens:
        for hidden in args.hidden:
            print(f"hidden {hidden}, sequences of {seq} tokens", flush=True)
            runs = measure(hidden, seq, args, runs=RUNS, rounds=args.rounds)
            if args.two_d_rounds:
                runs.update(measure(hidden, seq, args, runs=(TWO_D,), rounds=args.two_d_rounds))
            points.append(point(hidden, seq, runs))
    largest = next(p for p in points if p["hidden"] == max(args.hidden) and p["seq_len"] == args.seq_lens[0])
    report = {
        "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "tp2_speedup_at_largest": largest["tp2_speedup"],
        "tp2_over_hand_tp2_worst": max(p["tp2_over_hand_tp2"] for p in points),
        "points": points,
    }
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    args.out.with_suffix(".md").write_text(table(points) + "\n")
    plot(points, args.out.with_suffix(".png"))
    print(table(points))


if __name__ == "__main__":
    main()
