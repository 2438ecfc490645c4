"""The dry run (issue 47's engine, begun): the real ``parallelize`` at the real world size in one process, on a fake
process group, the model on the meta device (``device="meta"``): every check and every shard's shape as on the
GPUs, nothing allocated. The fake group is a tool here, never a parity check."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

import lightning_tp
from lightning_tp.layout import ParallelLayout

CONFIGS = Path(__file__).resolve().parents[1] / "data" / "configs"


@pytest.fixture
def world_of_64():
    """Rank 0 of a fake process group of 64 ranks (collectives return at once, leaving tensors as they are)."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", rank=0, world_size=64, store=FakeStore())
    try:
        yield 64
    finally:
        dist.destroy_process_group()


def _meta_model(name: str) -> torch.nn.Module:
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText

    config = AutoConfig.from_pretrained(CONFIGS / name)
    auto = AutoModelForImageTextToText if config.get_text_config() is not config else AutoModelForCausalLM
    with torch.device("meta"):
        return auto.from_config(config, dtype=torch.bfloat16)


def _dry_run(model: torch.nn.Module, mesh) -> None:
    """``parallelize`` as a dry run, then the process-wide patches it installed given up (a mixture-of-experts
    model's router loss under data parallelism), as a strategy's teardown would."""
    from lightning_tp.strategies.shared import release_process_wide_patches

    try:
        lightning_tp.parallelize(model, mesh=mesh, device="meta")
    finally:
        release_process_wide_patches(model)


def _local_bytes(model: torch.nn.Module) -> int:
    return sum((p.to_local() if isinstance(p, DTensor) else p).nbytes for p in model.parameters())


def test_a_70b_model_at_64_ranks_holds_a_64th_on_each_rank_and_nothing_is_allocated(world_of_64):
    model = _meta_model("llama-3.1-70b")
    whole = sum(math.prod(p.shape) * p.element_size() for p in model.parameters())
    norms = sum(math.prod(p.shape) * p.element_size() for p in model.parameters() if p.dim() == 1)
    mesh = ParallelLayout.resolve(world_of_64, tp_size=8).build_device_mesh("cpu")[0]
    _dry_run(model, mesh)
    state = lightning_tp.parallel_state(model)
    assert (state.layout.tp_size, state.layout.dp_shard_size) == (8, 8)
    # Every weight of Llama is split over tp x dp_shard but its norms, replicated over tp and sharded by FSDP2 alone.
    assert _local_bytes(model) == (whole - norms) // 64 + norms // 8
    assert all(p.is_meta for p in model.parameters()) and all(b.is_meta for b in model.buffers())


@pytest.mark.parametrize("name", ["llama-3.1-8b", "qwen3-32b", "qwen3-235b-a22b", "deepseek-v3", "gemma-3-27b"])
def test_each_real_config_dry_runs_at_64_ranks(world_of_64, name):
    model = _meta_model(name)
    whole = sum(math.prod(p.shape) * p.element_size() for p in model.parameters())
    mesh = ParallelLayout.resolve(world_of_64, tp_size=8).build_device_mesh("cpu")[0]
    _dry_run(model, mesh)
    local = _local_bytes(model)
    # At least a 64th (what is replicated over tp adds to it), far below the whole.
    assert whole / 64 <= local < whole / 32, (local, whole)


def test_the_dry_run_refuses_what_the_strategy_refuses_with_its_message(world_of_64):
    from lightning_tp.composition import BY_KEY

    model = _meta_model("gemma-3-27b")
    mesh = ParallelLayout.resolve(world_of_64, tp_size=8, cp_size=2).build_device_mesh("cpu")[0]
    rule = BY_KEY["cp+composite"]
    with pytest.raises(ValueError, match=rule.fix.removesuffix(".")):
        _dry_run(model, mesh)
