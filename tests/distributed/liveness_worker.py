"""Runs under torchrun (2 processes): nothing waits silently. Writes what each rank saw to OUT_DIR/rankN.pt.

Usage: liveness_worker.py OUT_DIR

On a process group the worker creates itself (the strategy must leave it alone): predict and validate with
``generate`` when the data-parallel ranks get unequal work, on FSDP2 over 2 ranks and on TP 2; then, with the world
group's timeout lowered to 8 s, the timeout of every mesh group and a rank-0 write longer than it.
"""

from __future__ import annotations

import argparse
import gc
import os
import time
import traceback
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader

from tests.helpers.tripwire import worker_setup

#: Seconds: the world group's timeout in the last checks, a rank-0 write longer than it, the mesh groups' timeout.
WORLD_TIMEOUT_S, WRITE_S, MESH_TIMEOUT_S = 8, 12, 21


def phase_store() -> dict[str, Any]:
    from lightning_tp.checkpoint.publish import run_on_main_and_share_failure
    from lightning_tp.layout import ParallelLayout

    # The world group (Lightning's, from the cases above) gets a timeout shorter than the write below (torch's private
    # setter: test code only; destroying and re-creating the world group on the same store fails to connect at times).
    dist.barrier()
    dist.distributed_c10d._set_pg_timeout(timedelta(seconds=WORLD_TIMEOUT_S))
    results: dict[str, Any] = {}
    # Every group of the mesh carries the timeout it was built with (on 2 ranks: the size-1 groups are new ones).
    mesh, dp_mesh = ParallelLayout(tp_size=1, dp_shard_size=2).build_device_mesh(
        "cpu", timeout=timedelta(seconds=MESH_TIMEOUT_S)
    )
    groups = {name: mesh.get_group(name) for name in mesh.mesh_dim_names}
    groups["dp"] = dp_mesh.get_group()
    world = dist.group.WORLD
    results["group_timeouts"] = {
        name: (group._get_backend(torch.device("cpu")).options._timeout.total_seconds(), group.size(), group is world)
        for name, group in groups.items()
    }
    # A rank-0 write longer than the process-group timeout: the others wait in the store, not in a collective.
    start = time.monotonic()
    try:
        run_on_main_and_share_failure(lambda: time.sleep(WRITE_S), is_main=dist.get_rank() == 0)
        results["slow_write"] = {"ok": True, "seconds": time.monotonic() - start}
    except Exception as err:
        results["slow_write"] = {"ok": False, "error": f"{type(err).__name__}: {err}"}

    def fail() -> None:
        raise OSError(28, "No space left on device")

    try:
        run_on_main_and_share_failure(fail, is_main=dist.get_rank() == 0)
        results["failed_write"] = None
    except RuntimeError as err:
        results["failed_write"] = str(err)
    # Rank 1 writes (a caller may choose another main rank), rank 0 waits.
    marks: list[int] = []
    run_on_main_and_share_failure(lambda: marks.append(1), is_main=dist.get_rank() == 1)
    results["other_writer"] = marks
    dist.barrier()
    return results


def phase_inference(timeout: timedelta) -> dict[str, Any]:
    from lightning_tp import TensorParallelStrategy
    from tests.helpers.inference import HeldShare, InferenceModule, generate_kwargs, prompts, val_batches
    from tests.helpers.models import quiet_trainer

    kwargs = generate_kwargs()
    results: dict[str, Any] = {"kwargs": kwargs}
    # Uneven work: on FSDP2 with the weights gathered for evaluation (`eval_weights="gathered"`), and refused
    # before the loop with them sharded (the default); on TP 2 (no FSDP2) with the default. Then sharded evaluation
    # with even work inside fit, recording what each rank holds.
    runs = [("fsdp2", 1, stage, "gathered") for stage in ("predict", "validate", "fit_validate")]
    runs += [("fsdp2_sharded", 1, stage, "sharded") for stage in ("predict", "validate")]
    runs += [("tp2", 2, stage, "sharded") for stage in ("predict", "validate", "fit_validate")]
    runs += [("fsdp2_sharded", 1, "fit_validate_even", "sharded"), ("fsdp2_kept", 1, "fit_validate_even", "sharded")]
    for name, tp_size, stage, eval_weights in runs:
        key = f"{name}_{stage}"
        try:
            module = InferenceModule(kwargs)
            strategy = TensorParallelStrategy(
                tp_size=tp_size,
                timeout=timeout,
                throughput_monitor=False,
                eval_weights=eval_weights,
                reshard_after_forward=name != "fsdp2_kept",  # layers kept whole after a forward, for its backward
            )
            held = HeldShare()
            trainer = quiet_trainer(
                accelerator="cpu",
                devices=2,
                strategy=strategy,
                use_distributed_sampler=stage == "predict",  # Lightning's predict sampler: 2 prompts, then 1
                max_steps=2,
                num_sanity_val_steps=0,
                callbacks=[held],
            )
            if stage == "fit_validate_even":  # both ranks validate the same 2 batches after each training step
                train = [{k: v for k, v in b.items() if k != "index"} for b in val_batches()[:1]]
                trainer.fit(module, DataLoader(train, batch_size=None), DataLoader(val_batches()[:2], batch_size=None))
                results[key] = {"losses": dict(module.val_losses), "held": held.shares}
                continue
            if stage == "predict":
                out = trainer.predict(module, DataLoader(prompts(), batch_size=None))
                results[key] = {"outputs": dict(out or [])}
                continue
            # Validation data split by hand, unevenly: rank 0 gets batches 0 and 2, rank 1 batch 1.
            dp_rank = dist.get_rank() if tp_size == 1 else 0
            mine = val_batches()[dp_rank::2] if tp_size == 1 else val_batches()
            if stage == "validate":
                trainer.validate(module, DataLoader(mine, batch_size=None))
            else:  # validation inside fit, after each of 2 training steps: weights gathered, sharded, gathered
                train = [{k: v for k, v in b.items() if k != "index"} for b in val_batches()[:1]]
                module.generate_in_training = tp_size == 1
                trainer.fit(module, DataLoader(train, batch_size=None), DataLoader(mine, batch_size=None))
                results[f"{key}_steps"] = trainer.global_step
                results[f"{key}_train_generated"] = module.train_generated
            results[key] = {"losses": dict(module.val_losses)}
        except ValueError as err:  # a refusal: the same on every rank, before anything hangs
            results[key] = {"refused": str(err)}
        except Exception:
            results[key] = {"crash": traceback.format_exc()}
    return results


def main() -> None:
    timeout = worker_setup()
    parser = argparse.ArgumentParser()
    parser.add_argument("out", type=Path)
    args = parser.parse_args()
    # The process group is the worker's own, as a user may create it before the Trainer: the strategy must leave it
    # alone (no destroy at exit registered); the worker destroys it at the end.
    dist.init_process_group("gloo", timeout=timeout)
    results = phase_inference(timeout)
    args.out.mkdir(parents=True, exist_ok=True)
    torch.save(results, args.out / f"rank{os.environ['RANK']}.pt")  # kept if what follows fails
    results.update(phase_store())
    import lightning_tp.strategies.shared

    results["destroy_registered"] = lightning_tp.strategies.shared._destroy_registered
    gc.collect()  # the runs' reference cycles hold the groups' finished work: free it while the interpreter is whole
    dist.destroy_process_group()
    gc.collect()
    args.out.mkdir(parents=True, exist_ok=True)
    torch.save(results, args.out / f"rank{os.environ['RANK']}.pt")


if __name__ == "__main__":
    main()
