"""Checkpoint size and save/load time: one process against TP 2 on the same model, in one run.

    python benchmarks/checkpoint.py [--out benchmarks/checkpoint.json] [--layers 12 --hidden 768]

Each layout trains one AdamW step of a Llama-style model (built from a config, seeded: no download), then times
``trainer.save_checkpoint`` (a distributed checkpoint: model and optimizer shards, metadata) and
``strategy.load_checkpoint`` on the same path, and reports the bytes on disk. Then it exports the TP 2 checkpoint with
``python -m lightning_tp.export`` and reports the export's peak RSS above a process that only imports the libraries.
Layouts alternate over ``--rounds``; medians are quoted, and the ratios of TP 2 to one process.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def worker(args: argparse.Namespace) -> None:
    import lightning as L
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    from lightning_tp import TensorParallelStrategy

    class Module(L.LightningModule):
        def configure_model(self) -> None:
            if getattr(self, "model", None) is None:
                torch.manual_seed(0)
                config = LlamaConfig(
                    vocab_size=args.vocab,
                    hidden_size=args.hidden,
                    intermediate_size=4 * args.hidden,
                    num_hidden_layers=args.layers,
                    num_attention_heads=12,
                    num_key_value_heads=4,
                    tie_word_embeddings=False,
                )
                self.model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)

        def training_step(self, batch, batch_idx):
            return self.model(input_ids=batch, labels=batch).loss

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-4)

    data = torch.utils.data.DataLoader([torch.randint(0, args.vocab, (2, 64))], batch_size=None)
    strategy = TensorParallelStrategy(throughput_monitor=False)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=int(os.environ.get("LOCAL_WORLD_SIZE", 1)),
        strategy=strategy,
        max_steps=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        use_distributed_sampler=False,
    )
    trainer.fit(Module(), data)
    path = Path(args.path)
    strategy.barrier()
    start = time.perf_counter()
    trainer.save_checkpoint(path)
    strategy.barrier()
    save_s = time.perf_counter() - start
    start = time.perf_counter()
    strategy.load_checkpoint(path)
    strategy.barrier()
    load_s = time.perf_counter() - start
    if trainer.global_rank == 0:
        size = sum(f.stat().st_size for f in path.rglob("*") if f.is_file())
        Path(args.result).write_text(json.dumps({"save_s": save_s, "load_s": load_s, "bytes": size}))


def run_layout(ranks: int, args: argparse.Namespace, tmp: Path, tag: str) -> dict:
    result = tmp / f"{tag}.json"
    common = [
        str(Path(__file__)),
        "--worker",
        "--path",
        str(tmp / f"{tag}.ckpt"),
        "--result",
        str(result),
        "--layers",
        str(args.layers),
        "--hidden",
        str(args.hidden),
        "--vocab",
        str(args.vocab),
    ]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={ranks}"]
    subprocess.run([*launcher, *common], env=env, check=True, capture_output=True)
    return json.loads(result.read_text())


def peak_rss_mb(module: str, *argv: str) -> float:
    """Peak RSS (MiB) of a fresh process that imports the libraries and runs ``python -m module argv...``
    (``module`` empty: only the imports)."""
    code = (
        "import resource, runpy, sys\n"
        "import torch, transformers, lightning_tp.tools.export\n"
        f"sys.argv = {[module, *argv]!r}\n"
        "try:\n"
        f"    {module!r} and runpy.run_module({module!r}, run_name='__main__')\n"
        "except SystemExit as exit:\n"
        "    assert not exit.code, exit.code\n"
        "print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)\n"
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, "-c", code], env=env, check=True, capture_output=True, text=True).stdout
    return int(out.strip().splitlines()[-1]) / 1024


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--path", help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--hidden", type=int, default=768)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return
    tmp = Path(tempfile.mkdtemp(prefix="lightning_tp_ckpt_bench_"))
    runs: dict[str, list[dict]] = {"1 process": [], "TP 2": []}
    for round_ in range(args.rounds):
        order = [("1 process", 1), ("TP 2", 2)]
        for name, ranks in order if round_ % 2 == 0 else order[::-1]:
            runs[name].append(run_layout(ranks, args, tmp, f"{ranks}_{round_}"))
    summary = {
        name: {key: statistics.median(r[key] for r in records) for key in ("save_s", "load_s", "bytes")}
        for name, records in runs.items()
    }
    exported = tmp / "exported"
    checkpoint = tmp / "2_0.ckpt"
    baseline = peak_rss_mb("")
    export = peak_rss_mb("lightning_tp.export", str(checkpoint), str(exported))
    model_bytes = sum(f.stat().st_size for f in exported.glob("*.safetensors"))
    report = {
        "config": {"layers": args.layers, "hidden": args.hidden, "vocab": args.vocab, "rounds": args.rounds},
        "runs": summary,
        "ratios_tp2_over_1": {k: summary["TP 2"][k] / summary["1 process"][k] for k in ("save_s", "load_s", "bytes")},
        "export": {
            "model_mb": model_bytes / 2**20,
            "peak_rss_mb": export,
            "baseline_rss_mb": baseline,
            "above_baseline_mb": export - baseline,
        },
    }
    print(json.dumps(report, indent=2))
    if args.out:
        args.out.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
