"""Checkpoints at fsspec URLs, on ``memory://`` (one process: fsspec's memory filesystem lives in this process).

A one-device Trainer with ``TensorParallelStrategy`` runs in pytest without launching anything. The reference is
the same run uninterrupted; a resume from the URL must give exactly its losses."""

from __future__ import annotations

import json
import os
import uuid
from pathlib import Path
from typing import Any

import fsspec
import pytest
import torch

from lightning_tp import TensorParallelStrategy
from lightning_tp.checkpoint import IncompleteCheckpointError
from lightning_tp.remote import COMMIT_MARKER, resolve
from tests.helpers.cases import CHECKPOINT_ENV
from tests.helpers.models import build_causal_lm, quiet_trainer, tiny_config
from tests.helpers.resume import STEPS, ResumeModule, SaveAt, probe_logits

MEM = fsspec.filesystem("memory")


@pytest.fixture(scope="module", autouse=True)
def _model_directory(tmp_path_factory: pytest.TempPathFactory):
    path = tmp_path_factory.mktemp("remote_model")
    build_causal_lm(tiny_config("qwen3")).save_pretrained(path / "qwen3")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(CHECKPOINT_ENV, str(path))
        yield


@pytest.fixture
def root():
    """A fresh memory:// prefix, removed afterwards (the memory filesystem is global to the process)."""
    name = f"lightning_tp_test_{uuid.uuid4().hex[:8]}"
    yield f"memory://{name}"
    if MEM.exists(f"/{name}"):
        MEM.rm(f"/{name}", recursive=True)


def fit(*, ckpt_path: str | None = None, callbacks=(), **strategy_kwargs: Any) -> tuple[ResumeModule, Any]:
    from lightning.pytorch.callbacks import ModelCheckpoint

    module = ResumeModule()
    trainer = quiet_trainer(
        accelerator="cpu",
        devices=1,
        strategy=TensorParallelStrategy(throughput_monitor=False, **strategy_kwargs),
        max_steps=STEPS,
        callbacks=list(callbacks),
        enable_checkpointing=any(isinstance(c, ModelCheckpoint) for c in callbacks),
    )
    trainer.fit(module, ckpt_path=ckpt_path)
    return module, trainer


def _after(losses: dict[int, float], step: int) -> dict[int, float]:
    return {s: v for s, v in losses.items() if s > step}


def _tree(url: str) -> list[str]:
    base = url.removeprefix("memory://").strip("/")
    found = [p.strip("/") for p in MEM.find(f"/{base}", withdirs=True)]
    return sorted(p.removeprefix(base).lstrip("/") for p in found if p != base)


@pytest.mark.parametrize("distributed", [True, False], ids=["directory", "file"])
def test_save_and_resume_at_a_url_exactly(root: str, distributed: bool, monkeypatch, tmp_path: Path) -> None:
    monkeypatch.chdir(tmp_path)  # a mangled URL (`memory:/...`) would land here
    url = f"{root}/mid" if distributed else f"{root}/mid.ckpt"
    # Saved twice at the same URL: the second save replaces the first.
    reference, _ = fit(callbacks=[SaveAt(steps={3: url, 5: url})], save_distributed_checkpoint=distributed)
    resumed, _ = fit(ckpt_path=url, save_distributed_checkpoint=distributed)
    assert resumed.losses == _after(reference.losses, 5)
    assert not list(tmp_path.iterdir()), "the URL was written as a local path"
    if distributed:
        marker = json.loads(MEM.cat_file(f"/{url.removeprefix('memory://')}/{COMMIT_MARKER}"))
        # Only the second save's files are left: the first one's were removed once the second was committed.
        assert _tree(url) == sorted([COMMIT_MARKER, marker["data"], *marker["files"]])
        assert torch.load(
            MEM.open(f"/{url.removeprefix('memory://')}/{marker['data']}/meta.pt"), weights_only=True
        )["global_step"] == 5
    else:
        assert _tree(root) == ["mid.ckpt"]


def test_a_directory_without_its_commit_marker_is_incomplete(root: str) -> None:
    url = f"{root}/ckpt"
    fit(callbacks=[SaveAt(steps={2: url})])
    resolve(url)  # whole
    MEM.rm_file(f"/{url.removeprefix('memory://')}/{COMMIT_MARKER}")  # as a save killed before its commit leaves it
    with pytest.raises(IncompleteCheckpointError, match=f"no commit marker \\({COMMIT_MARKER}\\)"):
        fit(ckpt_path=url)
    with pytest.raises(FileNotFoundError, match="No checkpoint at"):
        resolve(f"{root}/never_written")


def test_a_truncated_shard_at_a_url_is_incomplete(root: str) -> None:
    url = f"{root}/ckpt"
    fit(callbacks=[SaveAt(steps={2: url})])
    _, data = resolve(url)
    shard = f"{data.removeprefix('memory://')}/__0_0.distcp"
    MEM.pipe_file(shard, MEM.cat_file(shard)[:100])
    with pytest.raises(IncompleteCheckpointError, match=r"__0_0\.distcp holds 100 bytes, the index needs"):
        resolve(url)


def test_a_save_into_a_users_directory_keeps_their_files(root: str) -> None:
    url = f"{root}/run"
    base = url.removeprefix("memory://")
    MEM.pipe_file(f"/{base}/notes.txt", b"mine")
    # What a save killed before its commit leaves (removed by the next save), and a user's look-alike (kept).
    MEM.pipe_file(f"/{base}/shards-0123456789abcdef/__1_0.distcp", b"unfinished")
    MEM.pipe_file(f"/{base}/shards-fedcba9876543210/__0_0.distcp", b"x")
    MEM.pipe_file(f"/{base}/shards-fedcba9876543210/README", b"mine")
    fit(callbacks=[SaveAt(steps={2: url, 4: url})])
    _, trainer = fit(ckpt_path=url)
    trainer.strategy.remove_checkpoint(url)  # removes what the saves wrote, nothing else
    kept = ["shards-fedcba9876543210", "shards-fedcba9876543210/README", "shards-fedcba9876543210/__0_0.distcp"]
    assert _tree(url) == sorted(["notes.txt", *kept])
    assert MEM.cat_file(f"/{base}/notes.txt") == b"mine"


def test_model_checkpoint_at_a_url_keeps_top_k_and_last(root: str) -> None:
    from lightning.pytorch.callbacks import ModelCheckpoint

    MEM.pipe_file(f"/{root.removeprefix('memory://')}/notes.txt", b"mine")
    checkpoint = ModelCheckpoint(
        dirpath=root, every_n_train_steps=2, save_top_k=2, monitor="step", mode="max", save_last=True
    )
    module, trainer = fit(callbacks=[checkpoint])
    top = sorted(name for name in _tree(root) if "/" not in name)
    assert top == ["epoch=1-step=6.ckpt", "epoch=1-step=8.ckpt", "last.ckpt", "notes.txt"]
    assert checkpoint.last_model_path == f"{root}/last.ckpt"
    # A directory this package did not write (no marker) is left alone, with a warning.
    MEM.pipe_file(f"/{root.removeprefix('memory://')}/other/data.bin", b"x")
    with pytest.warns(UserWarning, match="was not removed: it has no commit marker"):
        trainer.strategy.remove_checkpoint(f"{root}/other")
    assert MEM.isfile(f"/{root.removeprefix('memory://')}/other/data.bin")
    resumed, _ = fit(ckpt_path=f"{root}/epoch=1-step=6.ckpt")
    assert resumed.losses == _after(module.losses, 6)


def test_export_reads_a_url(root: str, tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    from lightning_tp.export import main

    module, trainer = fit()
    trainer.save_checkpoint(f"{root}/final")
    expected = probe_logits(module.model)
    assert main([f"{root}/final", str(tmp_path / "exported")]) == 0
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "exported")
    torch.testing.assert_close(probe_logits(model), expected, atol=1e-5, rtol=0)
    MEM.rm_file(f"/{root.removeprefix('memory://')}/final/{COMMIT_MARKER}")
    assert main([f"{root}/final", str(tmp_path / "again")]) == 1
    assert not os.path.exists(tmp_path / "again")


def test_a_crafted_marker_removes_nothing(root: str) -> None:
    """The marker steers what removal deletes: a name outside its data directory makes it unreadable."""
    from lightning_tp.remote import remove_checkpoint

    base = root.removeprefix("memory://")
    MEM.pipe_file(f"/{base}/notes.txt", b"mine")
    marker = {"format": 1, "data": "shards-0123456789abcdef", "files": ["shards-0123456789abcdef/../notes.txt"]}
    MEM.pipe_file(f"/{base}/ckpt/{COMMIT_MARKER}", json.dumps(marker).encode())
    with pytest.raises(IncompleteCheckpointError, match="which lightning_tp does not write"):
        resolve(f"{root}/ckpt")
    assert remove_checkpoint(f"{root}/ckpt") == [f"{root}/ckpt"]  # left alone: the caller warns
    assert MEM.cat_file(f"/{base}/notes.txt") == b"mine"
