"""Runs under two torchrun launches on one machine, each a simulated node of two processes (c10d rendezvous):
HSDP (replicated across the nodes, sharded within each), a model "downloaded" once per node, save and resume.

Usage: multinode_worker.py OUT_DIR MODEL_DIR

``huggingface_hub.snapshot_download`` is replaced by a stand-in that records each call and returns MODEL_DIR, so the
per-node download logic of ``lightning_tp.from_pretrained`` runs without a network.
"""

from __future__ import annotations

import json
import os
import sys
import traceback
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

import lightning_tp
from lightning_tp import TensorParallelStrategy
from tests.helpers.models import quiet_trainer
from tests.helpers.resume import STEPS, ResumeModule, SaveAt
from tests.helpers.tripwire import worker_setup

HUB_ID = "lightning-tp-test/tiny-qwen3"


def fake_snapshot_download(repo_id: str, **kwargs: Any) -> str:
    record = {"repo_id": repo_id, "local_files_only": bool(kwargs.get("local_files_only"))}
    with open(Path(sys.argv[1]) / f"downloads_rank{os.environ['RANK']}.jsonl", "a") as f:
        f.write(json.dumps(record) + "\n")
    return sys.argv[2]


class HubModule(ResumeModule):
    def configure_model(self) -> None:
        if self.model is None:
            self.model = lightning_tp.from_pretrained(HUB_ID, dtype=torch.float32)
            self.model.train()


def fit(module: ResumeModule, *, ckpt_path: Path | None = None, callbacks=()) -> Any:
    strategy = TensorParallelStrategy(
        tp_size=1, dp_shard_size=2, dp_replicate_size=2, throughput_monitor=False, timeout=timedelta(seconds=90)
    )
    trainer = quiet_trainer(
        accelerator="cpu",
        num_nodes=2,
        devices=int(os.environ["LOCAL_WORLD_SIZE"]),
        strategy=strategy,
        max_steps=STEPS,
        callbacks=list(callbacks),
    )
    trainer.fit(module, ckpt_path=ckpt_path)
    return trainer


def main() -> None:
    worker_setup()  # stack dumps on a hang; the strategies below set their own short timeouts
    out = Path(sys.argv[1])
    import huggingface_hub

    huggingface_hub.snapshot_download = fake_snapshot_download
    results: dict[str, Any] = {}
    try:
        module = HubModule()
        trainer = fit(module, callbacks=[SaveAt(steps={6: out / "mid"})])
        results["reference"] = module.losses
        mesh = trainer.strategy.device_mesh
        nodes: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(nodes, os.environ["SIMULATED_NODE"])
        results["nodes"] = nodes
        results["shard_group"] = dist.get_process_group_ranks(mesh["dp_shard"].get_group())
        results["replicate_group"] = dist.get_process_group_ranks(mesh["dp_replicate"].get_group())
        results["dp_rank"] = trainer.strategy.dp_mesh.get_local_rank()
        module = HubModule()
        fit(module, ckpt_path=out / "mid")
        results["resumed"] = module.losses
    except Exception:
        results = {"crash": traceback.format_exc()}
    results["local_rank"] = int(os.environ["LOCAL_RANK"])
    results["node"] = os.environ["SIMULATED_NODE"]
    torch.save(results, out / f"rank{os.environ['RANK']}.pt")


if __name__ == "__main__":
    main()
