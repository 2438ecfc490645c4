"""Manual check (too slow for the suite): launch a tiny successful run many times and count the launches that do not
exit 0, e.g. a rank aborting at interpreter exit ("terminate called without an active exception", issue 11 defect 9).

    OMP_NUM_THREADS=1 python benchmarks/exit_loop.py --runs 50            # ~25 s a launch on 2 busy cores
    OMP_NUM_THREADS=1 python benchmarks/exit_loop.py --runs 50 --layout 2d --nprocs 4

Each launch is ``torchrun --standalone --nproc_per_node=N benchmarks/exit_loop.py --worker``: a tiny Qwen3 trained 3
steps with ``TensorParallelStrategy`` (TP over every rank, or ``--layout 2d``: dp_shard 2 x tp 2 on 4 ranks, with
bf16-mixed), a sharded checkpoint saved, then a validate and a predict. Prints one line per launch and a summary;
exits 1 if any launch failed.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def worker(layout: str, out: Path) -> None:
    import torch
    from torch.utils.data import DataLoader

    from lightning_tp import TensorParallelStrategy
    from tests.helpers.models import ParityModule, build_causal_lm, lm_batches, quiet_trainer, tiny_config

    kwargs = {"tp_size": 2} if layout == "2d" else {}
    precision = "bf16-mixed" if layout == "2d" else "32-true"

    def build() -> torch.nn.Module:
        return build_causal_lm(tiny_config("qwen3"))

    module = ParityModule(build)
    module.validation_step = lambda batch, batch_idx: None  # type: ignore[method-assign]
    module.predict_step = lambda batch, batch_idx: module.model(input_ids=batch["input_ids"]).logits.argmax(-1)  # type: ignore
    trainer = quiet_trainer(
        accelerator="cpu",
        devices=int(os.environ["LOCAL_WORLD_SIZE"]),
        strategy=TensorParallelStrategy(**kwargs),
        max_steps=3,
        precision=precision,
    )
    batches = lm_batches(3)
    trainer.fit(module, DataLoader(batches, batch_size=None))
    trainer.save_checkpoint(out / "ckpt")
    trainer.validate(module, DataLoader(batches[:1], batch_size=None))
    trainer.predict(module, DataLoader(batches[:1], batch_size=None))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=50)
    parser.add_argument("--nprocs", type=int, default=2)
    parser.add_argument("--layout", choices=["tp", "2d"], default="tp")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args.layout, args.out)
        return
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}", "OMP_NUM_THREADS": "1"}
    env["PYTHONFAULTHANDLER"] = "1"  # an abort prints every thread's Python stack: where it happened
    failures = []
    for run in range(args.runs):
        with tempfile.TemporaryDirectory() as tmp:
            cmd = [
                sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={args.nprocs}",
                __file__, "--worker", "--layout", args.layout, "--out", tmp,
            ]  # fmt: skip
            start = time.monotonic()
            proc = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=600)
            output = proc.stdout + proc.stderr
            aborted = "terminate called" in output
            print(
                f"run {run + 1:3d}: exit {proc.returncode}{'  ABORT at exit' if aborted else ''} "
                f"({time.monotonic() - start:.0f} s)",
                flush=True,
            )
            if proc.returncode != 0 or aborted:
                failures.append(run + 1)
                print(output[-6000:], flush=True)
    print(f"{args.runs - len(failures)} of {args.runs} launches exited 0 without an abort; failed: {failures}")
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
