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
    "qwen3_lora",
    "llama_rslora",
    "qwen3_meta_lora",
    "qwen3_sp_lp_adamw_clip",
    "features",
]
#: Cases that only make sense with data parallelism.
DP_ONLY_CASES = {"qwen3_hsdp", "qwen3_no_reshard"}
#: Cases trained from a random initialisation, which no single process can reproduce: checked on their own.
UNREFERENCED_CASES = {"qwen3_meta_init", "qwen3_meta_lora"}
TP_PARITY_CASES = [name for name in CASES if name not in DP_ONLY_CASES | UNREFERENCED_CASES]
TP_CASES = [
    *TP_PARITY_CASES,
    *UNREFERENCED_CASES,
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
