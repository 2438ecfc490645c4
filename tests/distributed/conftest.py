"""One torchrun launch per layout, holding every case: a cold multi-process start costs far more than a case."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.helpers.cases import CASES, CHECKPOINT_ENV, ERROR_CASES, _lora
from tests.helpers.launch import torchrun
from tests.helpers.models import build_causal_lm, tiny_config

WORKER = Path(__file__).with_name("worker.py")

TWO_D_CASES = [
    "qwen3_sgd",
    "tied_sgd",
    "qwen3_adamw_foreach_clip",
    "llama_accumulate",
    "qwen3_activation_checkpointing",
    "qwen3_meta_load",
    "tied_meta_load",
    "qwen3_hsdp",
    "qwen3_with_head",
    "tied_replicated",
    "qwen3_no_reshard",
    "qwen3_meta_init",
    "tied_meta_init",
    "qwen3_lora",
    "llama_rslora",
    "qwen3_meta_lora",
    "qwen3_sp_lp_adamw_clip",
    "qwen3_bf16_mixed",
    "qwen3_bf16_all_gather",
    "features",
    # Plain modules (not Transformers) under TP x FSDP2, FSDP2 alone (tp_size=1 on 4 ranks), ranks seeded apart.
    "mlp_custom_plan",
    "plain_twice_with_head",
    "plain_direct_call",
    "mlp_fsdp_only",
    "llama_rank_seeded",
    "sp_odd_on_one_group",
]
#: Cases that only make sense with data parallelism.
DP_ONLY_CASES = {"qwen3_hsdp", "qwen3_no_reshard", "qwen3_bf16_mixed", "qwen3_bf16_all_gather"}
#: bf16 cases, compared with a bf16 single process (not at fp32's tolerance).
BF16_CASES = {"qwen3_bf16_mixed", "qwen3_bf16_all_gather"}
#: Cases with tp_size=1 (FSDP2 alone over every rank): run in both launches, checked on their own.
FSDP_ONLY_CASES = {"mlp_fsdp_only"}
TP_PARITY_CASES = [name for name in CASES if name not in DP_ONLY_CASES | FSDP_ONLY_CASES]
TP_CASES = [
    *TP_PARITY_CASES,
    *FSDP_ONLY_CASES,
    "features",
    "save_failure",
    "collectives",
    "loss_parallel_checks",
    *(f"error:{name}" for name in ERROR_CASES),
]


@pytest.fixture(scope="session")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("checkpoint")
    for kind in ("qwen3", "tied"):
        build_causal_lm(tiny_config(kind)).save_pretrained(path / kind)
    _lora("qwen3").save_pretrained(path / "qwen3_adapter")
    return path


@pytest.fixture(scope="session", autouse=True)
def _checkpoint_env(checkpoint: Path, monkeypatch_session: pytest.MonkeyPatch) -> None:
    monkeypatch_session.setenv(CHECKPOINT_ENV, str(checkpoint))


@pytest.fixture(scope="session")
def monkeypatch_session():
    with pytest.MonkeyPatch.context() as mp:
        yield mp


def _launch(out: Path, nprocs: int, cases: list[str], *extra: str) -> list[dict]:
    torchrun(WORKER, nprocs, str(out), *extra, *cases)
    return [torch.load(out / f"rank{rank}.pt", weights_only=False) for rank in range(nprocs)]


@pytest.fixture(scope="session")
def tp2_results(tmp_path_factory: pytest.TempPathFactory, _checkpoint_env: None) -> list[dict]:
    """Every TP case on 2 processes (tp_size inferred: 2)."""
    return _launch(tmp_path_factory.mktemp("tp2"), 2, TP_CASES)


@pytest.fixture(scope="session")
def two_d_results(tmp_path_factory: pytest.TempPathFactory, _checkpoint_env: None) -> list[dict]:
    """2-D cases on 4 processes: dp_shard 2 x tp 2."""
    return _launch(tmp_path_factory.mktemp("2d"), 4, [*TWO_D_CASES, "group_timeouts"], "--tp-size", "2")
