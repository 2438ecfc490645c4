"""Runs under torchrun (2, 4 or 8 processes): the real step the dry run simulates, measured the same way. For each
scenario of :mod:`tests.helpers.dry_run`, each rank builds the model on the meta device, parallelises it for real
(materialised on CPU), runs one training step counting its live tensor bytes and recording its collectives, and
writes them to OUT_DIR/rankN.pt.

Usage: dry_run_worker.py OUT_DIR
"""

from __future__ import annotations

import argparse
import os
from dataclasses import asdict, replace
from pathlib import Path

import torch
import torch.distributed as dist

from tests.helpers.tripwire import worker_setup


def main() -> None:
    timeout = worker_setup()
    parser = argparse.ArgumentParser()
    parser.add_argument("out", type=Path)
    args = parser.parse_args()
    dist.init_process_group("gloo", timeout=timeout)

    import lightning_tp
    from lightning_tp.dryrun.engine import Workload, measure_step, mesh_axis_names
    from lightning_tp.dryrun.record import CollectiveRecorder
    from lightning_tp.layout import ParallelLayout
    from lightning_tp.parallel_options import ParallelOptions
    from lightning_tp.strategies.shared import release_process_wide_patches
    from tests.helpers import dry_run

    world = dist.get_world_size()
    results = {}
    for name, sizes, model_name, checkpointing in dry_run.scenarios(world):
        torch.manual_seed(0)
        with torch.device("meta"):
            model = dry_run.build(dry_run.LAYERS[model_name])
        layout = ParallelLayout.resolve(world, **sizes)
        mesh, _ = layout.build_device_mesh("cpu", timeout=timeout)
        options = ParallelOptions(activation_checkpointing=checkpointing)
        lightning_tp.parallelize(model, mesh=mesh, options=options, device="cpu")
        recorder = CollectiveRecorder()
        workload = Workload(batch_size=dry_run.BATCH, seq_len=dry_run.SEQ)
        memory = measure_step(model, options=options, workload=workload, recorder=recorder, free_cycles=True)
        axes = mesh_axis_names(model)
        calls = [asdict(replace(call, axis=axes.get(call.group, call.axis))) for call in recorder.calls]
        results[name] = {"memory": asdict(memory), "calls": calls}
        release_process_wide_patches(model)
        del model
    args.out.mkdir(parents=True, exist_ok=True)
    torch.save(results, args.out / f"rank{os.environ['RANK']}.pt")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
