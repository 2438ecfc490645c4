"""Per-rank memory of one process, TP 2 and 2-D (dp_shard 2 x tp 2) on the same model, and peak memory while loading
a checkpoint sharded (``lightning_tp.from_pretrained``) versus fully (``AutoModelForCausalLM.from_pretrained`` on every
rank, then sharded). One invocation runs every configuration, each in fresh processes (peak RSS is per process).

    python benchmarks/memory.py --out benchmarks/memory.json      # Llama-style, ~166M parameters, CPU/gloo
    python benchmarks/memory.py --quick                           # a small model, for a smoke run

Reported as ratios to the single process; bytes are what each rank holds locally (its shards). Also gradient
accumulation on 2-D (4 micro-batches a step) with ``accumulate_grads="sharded"`` (reduce-scatter every micro-batch,
the default) against ``"unsharded"`` (whole gradients kept until the step's last micro-batch): the peak above the
start of training, per rank.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SIZES = {
    "full": dict(hidden_size=1024, intermediate_size=2816, num_hidden_layers=8, vocab_size=32000),
    "quick": dict(hidden_size=256, intermediate_size=704, num_hidden_layers=2, vocab_size=4096),
}


def config(size: str):
    from transformers import LlamaConfig

    return LlamaConfig(
        **SIZES[size],
        num_attention_heads=8,
        num_key_value_heads=4,
        max_position_embeddings=256,
        tie_word_embeddings=False,
    )


def rss_peak_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def status_mb() -> dict[str, float]:
    """Resident memory split as the kernel reports it: anonymous (allocations) and file-backed (mapped files, such
    as safetensors pages read through mmap: shared between the ranks of a node and reclaimable)."""
    values = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        key, _, rest = line.partition(":")
        if key in ("RssAnon", "RssFile", "RssShmem"):
            values[key] = int(rest.split()[0]) / 1024
    return values


class PeakSampler:
    """Samples /proc/self/status every few milliseconds in a thread; ``peaks`` holds the maxima."""

    def __init__(self, interval: float = 0.002) -> None:
        import threading

        self.peaks: dict[str, float] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(interval,), daemon=True)

    def _run(self, interval: float) -> None:
        while not self._stop.is_set():
            for key, value in status_mb().items():
                self.peaks[key] = max(self.peaks.get(key, 0.0), value)
            self._stop.wait(interval)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> dict[str, float]:
        self._stop.set()
        self._thread.join()
        return self.peaks


def local_bytes(tensors) -> int:
    from torch.distributed.tensor import DTensor

    total = 0
    for t in tensors:
        if t is None:
            continue
        t = t.to_local() if isinstance(t, DTensor) else t
        total += t.numel() * t.element_size()
    return total


def worker(args: argparse.Namespace) -> None:
    import lightning as L
    import torch
    from torch.utils.data import DataLoader

    from lightning_tp import TensorParallelStrategy, from_pretrained

    record: dict = {"layout": args.layout, "mode": args.mode}
    ckpt = args.checkpoint
    sampler = PeakSampler()
    train_sampler = PeakSampler()

    class Module(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = None

        def configure_model(self) -> None:
            if self.model is not None:
                return
            from transformers import AutoModelForCausalLM

            record["before_load_mb"] = status_mb()
            sampler.start()
            if args.mode == "sharded":
                self.model = from_pretrained(ckpt, dtype=torch.float32)
            else:
                self.model = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32)

        def on_fit_start(self) -> None:
            # The strategy's setup (sharding, materialising, reading the checkpoint) has run by now.
            record["load_peak_mb"] = sampler.stop()

        def on_train_start(self) -> None:
            record["train_start_mb"] = status_mb()
            train_sampler.start()

        def on_train_end(self) -> None:
            record["train_peak_mb"] = train_sampler.stop()

        def training_step(self, batch, batch_idx):
            return self.model(input_ids=batch, labels=batch).loss

        def on_after_backward(self) -> None:
            # Accumulating: the 7th of 8 micro-batches (second step, before its last), what is held between them.
            self.backwards = getattr(self, "backwards", 0) + 1
            if args.phase == "accumulate" and self.backwards == 7:
                record["held_mb"] = status_mb()["RssAnon"] - record["train_start_mb"]["RssAnon"]

        def validation_step(self, batch, batch_idx):
            self.model(input_ids=batch)

        def on_before_optimizer_step(self, optimizer) -> None:
            if self.global_step == 1:  # grads and AdamW states (from step 0) both exist now
                record["param_bytes"] = local_bytes(self.parameters())
                record["grad_bytes"] = local_bytes(p.grad for p in self.parameters())
                record["optimizer_bytes"] = local_bytes(
                    v for state in optimizer.state.values() for v in state.values() if isinstance(v, torch.Tensor)
                )

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-4)

    accumulate = 4 if args.phase == "accumulate" else 1
    data = DataLoader([torch.randint(0, 1000, (4, 128)) for _ in range(2 * accumulate)], batch_size=None)
    if args.layout == "single":
        strategy, devices = "auto", 1
    else:
        strategy = TensorParallelStrategy(2, accumulate_grads=args.accumulate_grads)
        devices = int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    trainer = L.Trainer(
        accelerator="cpu",
        devices=devices,
        strategy=strategy,
        max_steps=2,
        accumulate_grad_batches=accumulate,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        use_distributed_sampler=False,
    )
    module = Module()
    if args.phase == "load":  # fit, not validate: validate would gather the weights for inference inside the window
        data = DataLoader([torch.randint(0, 1000, (1, 16))], batch_size=None)
    trainer.fit(module, data)
    record["peak_rss_mb"] = rss_peak_mb()
    rank = int(os.environ.get("RANK", 0))
    Path(args.result).with_suffix(f".rank{rank}.json").write_text(json.dumps(record))


def launch(nprocs: int, result: Path, *extra: str) -> list[dict]:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    script = [str(Path(__file__).resolve()), "--result", str(result), *extra]
    cmd = (
        [sys.executable, *script]
        if nprocs == 1
        else [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nprocs}", *script]
    )
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")
    return [json.loads(result.with_suffix(f".rank{r}.json").read_text()) for r in range(nprocs)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=None, help="write the results as JSON here")
    parser.add_argument("--quick", action="store_true")
    # worker arguments
    parser.add_argument("--result", type=Path)
    parser.add_argument("--layout", choices=["single", "tp2", "2d"])
    parser.add_argument("--phase", choices=["train", "load", "accumulate"], default="train")
    parser.add_argument("--accumulate-grads", choices=["sharded", "unsharded"], default="sharded")
    parser.add_argument("--mode", choices=["sharded", "full"], default="full")
    parser.add_argument("--checkpoint")
    args = parser.parse_args()
    if args.result is not None:
        worker(args)
        return

    from transformers import AutoModelForCausalLM

    with tempfile.TemporaryDirectory() as tmp:
        tmp_path = Path(tmp)
        checkpoint = tmp_path / "model"
        AutoModelForCausalLM.from_config(config("quick" if args.quick else "full")).save_pretrained(checkpoint)
        size_mb = sum(f.stat().st_size for f in checkpoint.glob("*.safetensors")) / 2**20
        runs = {}
        for name, nprocs, layout in (("1 process", 1, "single"), ("TP 2", 2, "tp2"), ("2-D 2x2", 4, "2d")):
            # Sharded layouts load the lean way; one process has nothing to shard.
            mode = "full" if layout == "single" else "sharded"
            runs[name] = launch(
                nprocs,
                tmp_path / name.replace(" ", "_"),
                "--layout",
                layout,
                "--mode",
                mode,
                "--checkpoint",
                str(checkpoint),
            )
        loads = {
            mode: launch(
                4,
                tmp_path / f"load_{mode}",
                "--layout",
                "2d",
                "--phase",
                "load",
                "--mode",
                mode,
                "--checkpoint",
                str(checkpoint),
            )
            for mode in ("full", "sharded")
        }
        accumulation = {
            mode: launch(
                4,
                tmp_path / f"accumulate_{mode}",
                "--layout",
                "2d",
                "--phase",
                "accumulate",
                "--accumulate-grads",
                mode,
                "--mode",
                "sharded",
                "--checkpoint",
                str(checkpoint),
            )
            for mode in ("sharded", "unsharded")
        }
    report(runs, loads, size_mb, args.out, accumulation=accumulation)


def accumulation_lines(accumulation: dict) -> list[str]:
    """The peak above the start of training on 2-D 2x2 with 4 micro-batches a step, by ``accumulate_grads``."""
    lines = [
        "",
        "Gradient accumulation on 2-D 2x2 (4 micro-batches of 4 x 128 tokens per rank and step, AdamW): peak "
        "anonymous memory per rank above the start of training, after the 7th of 8 micro-batches (what is held between "
        "them) and at its peak. `4 P / tp` is what the whole fp32 gradients of a rank's TP shard take, `4 P / (tp dp)` "
        "their FSDP2 shard.",
        "",
        "| accumulate_grads | reduce-scatters per step | held between micro-batches (MiB) | peak above start (MiB) "
        "| 4 P / tp (MiB) | 4 P / (tp dp) (MiB) |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for mode, records in accumulation.items():
        peak = max(r["train_peak_mb"]["RssAnon"] - r["train_start_mb"]["RssAnon"] for r in records)
        held = max(r["held_mb"] for r in records)
        sharded = max(r["param_bytes"] for r in records) / 2**20  # fp32 parameters / rank: 4 P / (tp * dp), dp = 2
        lines.append(
            f"| `{mode}` | {4 if mode == 'sharded' else 1} | {held:.0f} | {peak:.0f} | {2 * sharded:.0f} | "
            f"{sharded:.0f} |"
        )
    return lines


def report(runs: dict, loads: dict, size_mb: float, out: Path | None, *, accumulation: dict) -> None:
    base = runs["1 process"][0]
    lines = [
        "| layout | params / rank | grads / rank | AdamW states / rank | sum, ratio to 1 process "
        "| peak RSS / rank (MiB) |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    base_total = base["param_bytes"] + base["grad_bytes"] + base["optimizer_bytes"]
    for name, records in runs.items():
        r = max(records, key=lambda rec: rec["param_bytes"] + rec["grad_bytes"] + rec["optimizer_bytes"])
        total = r["param_bytes"] + r["grad_bytes"] + r["optimizer_bytes"]
        mb = lambda b: f"{b / 2**20:.1f} MiB"  # noqa: E731
        lines.append(
            f"| {name} | {mb(r['param_bytes'])} | {mb(r['grad_bytes'])} | {mb(r['optimizer_bytes'])} | "
            f"{total / base_total:.3f} | {max(rec['peak_rss_mb'] for rec in records):.0f} |"
        )
    lines += [
        "",
        f"Loading a {size_mb:.0f} MiB checkpoint (S) on 2-D 2x2 (4 ranks, so S/4 = {size_mb / 4:.0f} MiB): peak "
        "resident memory per rank while the model is built, sharded and filled, above what the rank held before. "
        "Anonymous memory is what the process allocated; file-backed is the checkpoint's pages mapped by safetensors "
        "(shared by the ranks of a node, reclaimable by the kernel).",
        "",
        "| loading | anonymous (MiB) | / S | file-backed (MiB) | sum of both peaks (MiB) | / S |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for mode, records in loads.items():

        def above(rec: dict, key: str) -> float:
            return rec["load_peak_mb"].get(key, 0.0) - rec["before_load_mb"].get(key, 0.0)

        anon = max(above(rec, "RssAnon") for rec in records)
        file_backed = max(above(rec, "RssFile") for rec in records)
        total = max(above(rec, "RssAnon") + above(rec, "RssFile") for rec in records)
        label = "sharded (`lightning_tp.from_pretrained`)" if mode == "sharded" else "full (`from_pretrained` per rank)"
        lines.append(
            f"| {label} | {anon:.0f} | {anon / size_mb:.2f} | {file_backed:.0f} | {total:.0f} | {total / size_mb:.2f} |"
        )
    lines += accumulation_lines(accumulation)
    table = "\n".join(lines)
    print(table)
    if out is not None:
        results = {"runs": runs, "loads": loads, "accumulation": accumulation, "checkpoint_mb": size_mb, "table": table}
        out.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
