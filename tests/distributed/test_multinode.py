"""Two simulated nodes of two processes each (two torchrun launches, c10d rendezvous): HSDP replicating across the
nodes and sharding within each, one download per node, save and resume. The reference is one process with a plain
Lightning Trainer on the same global batches."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.helpers.cases import CHECKPOINT_ENV
from tests.helpers.launch import ROOT
from tests.helpers.models import quiet_trainer
from tests.helpers.resume import STEPS, ResumeModule, fp32_loss_bounds

WORKER = Path(__file__).with_name("multinode_worker.py")
#: The same layout resumes with the same operations on the same values: bit for bit (as
#: tests/distributed/test_checkpoint.py). One process sums in another order: within fp32's bounds
#: (:func:`fp32_loss_bounds`).
IDENTICAL = 0.0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def _launch_two_nodes(out: Path, timeout: float = 300) -> None:
    port = _free_port()
    env = {
        **os.environ,
        "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
        "OMP_NUM_THREADS": "1",
    }
    procs = []
    for node in range(2):
        cmd = [
            sys.executable, "-m", "torch.distributed.run",
            "--nnodes=2", f"--node-rank={node}", "--nproc-per-node=2",
            "--rdzv-backend=c10d", f"--rdzv-endpoint=localhost:{port}", "--rdzv-id=multinode-test",
            str(WORKER), str(out), str(Path(os.environ[CHECKPOINT_ENV]) / "qwen3"),
        ]  # fmt: skip
        log = open(out / f"node{node}.log", "w")
        procs.append((subprocess.Popen(cmd, env={**env, "SIMULATED_NODE": str(node)}, cwd=ROOT, stdout=log,
                                       stderr=subprocess.STDOUT), log))  # fmt: skip
    failed = []
    for node, (proc, log) in enumerate(procs):
        try:
            code = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            for other, _ in procs:
                other.kill()
            code = "timeout"
        log.close()
        if code != 0:
            failed.append(f"node {node} ({code}):\n{(out / f'node{node}.log').read_text()[-8000:]}")
    assert not failed, "\n".join(failed)


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory, _checkpoint_env: None) -> list[dict[str, Any]]:
    out = tmp_path_factory.mktemp("multinode")
    _launch_two_nodes(out)
    results = [torch.load(out / f"rank{rank}.pt", weights_only=False) for rank in range(4)]
    for rank, result in enumerate(results):
        assert "crash" not in result, f"rank {rank}:\n{result['crash']}"
        downloads = [json.loads(line) for line in (out / f"downloads_rank{rank}.jsonl").read_text().splitlines()]
        result["downloads"] = [d["local_files_only"] for d in downloads]
    return results


def test_hsdp_across_two_nodes_saves_resumes_and_downloads_once_per_node(ranks: list[dict[str, Any]]) -> None:
    # Layout: each FSDP2 shard group lies within one node, each replica group spans both.
    for result in ranks:
        nodes = result["nodes"]
        assert {nodes[r] for r in result["shard_group"]} == {result["node"]}, result
        assert {nodes[r] for r in result["replicate_group"]} == {"0", "1"}, result
    # One download per node, by its LOCAL_RANK 0 (once per `from_pretrained`: two fits); the other ranks only read
    # the local cache.
    for result in ranks:
        expected = [False, True] * 2 if result["local_rank"] == 0 else [True, True]
        assert result["downloads"] == expected, result
    assert sorted(r["node"] for r in ranks if r["local_rank"] == 0) == ["0", "1"]
    # Resume: exactly the uninterrupted run, on every rank.
    for result in ranks:
        resumed, reference = result["resumed"], result["reference"]
        assert sorted(resumed) == list(range(7, STEPS + 1))
        assert max(abs(resumed[s] - reference[s]) for s in resumed) <= IDENTICAL
    # Parity: each data-parallel rank trains on a quarter of each global batch; their mean is one process's loss.
    module = ResumeModule()
    quiet_trainer(accelerator="cpu", devices=1, max_steps=STEPS).fit(module)
    by_dp = {r["dp_rank"]: r["reference"] for r in ranks}
    assert sorted(by_dp) == [0, 1, 2, 3]
    mean = {step: sum(losses[step] for losses in by_dp.values()) / 4 for step in module.losses}
    gaps = {step: abs(mean[step] - module.losses[step]) for step in module.losses}
    bounds = fp32_loss_bounds(module.losses, trained=module.model.state_dict())
    assert all(gaps[step] <= bounds[step] for step in gaps), (gaps, bounds)
