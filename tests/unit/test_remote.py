"""Checkpoints at fsspec URLs, on ``memory://`` (one process: fsspec's memory filesystem lives in this process).

A one-device Trainer with ``TensorParallelStrategy`` runs in pytest without launching anything. The reference is
the same run uninterrupted; a resume from the URL must give exactly its losses. A ``file://`` URL names a local path,
saved and loaded as that path (``ModelCheckpoint(dirpath="file://...")`` with the Trainer below)."""

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
from lightning_tp.checkpoint.remote import COMMIT_MARKER, plan_save, resolve
from lightning_tp.checkpoint.validation import IncompleteCheckpointError
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
    # The one-device Trainers initialised a process group in this pytest process: leave none to later tests.
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


def _root() -> str:
    return f"memory://lightning_tp_test_{uuid.uuid4().hex[:8]}"


def _clean(url: str) -> None:
    """The memory filesystem is global to the process: remove what a test wrote there."""
    path = "/" + url.removeprefix("memory://")
    if MEM.exists(path):
        MEM.rm(path, recursive=True)


@pytest.fixture
def root():
    url = _root()
    yield url
    _clean(url)


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


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """One run that saves at URLs in every way tested here (each fit costs seconds):

    - ``mid``: saved at steps 3 and 5 (the second replaces the first);
    - ``run``: a user's directory holding their files, a data directory a killed save left and a look-alike of one,
      saved at steps 2 and 4;
    - ``mc``: ``ModelCheckpoint`` with top-2 and ``last`` every 2 steps, next to a user's file;
    - ``final``: ``trainer.save_checkpoint`` after the run.

    Run from an empty working directory: a URL mangled into a local path (``memory:/...``) would land there."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    root = _root()
    base = root.removeprefix("memory://")
    MEM.pipe_file(f"/{base}/run/notes.txt", b"mine")
    MEM.pipe_file(f"/{base}/run/shards-0123456789abcdef/__1_0.distcp", b"unfinished")
    MEM.pipe_file(f"/{base}/run/shards-fedcba9876543210/__0_0.distcp", b"x")
    MEM.pipe_file(f"/{base}/run/shards-fedcba9876543210/README", b"mine")
    MEM.pipe_file(f"/{base}/mc/notes.txt", b"mine")
    checkpoint = ModelCheckpoint(
        dirpath=f"{root}/mc", every_n_train_steps=2, save_top_k=2, monitor="step", mode="max", save_last=True
    )
    cwd = tmp_path_factory.mktemp("cwd")
    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(cwd)
        saves = SaveAt(steps={2: f"{root}/run", 3: f"{root}/mid", 4: f"{root}/run", 5: f"{root}/mid"})
        module, trainer = fit(callbacks=[saves, checkpoint])
        trainer.save_checkpoint(f"{root}/final")
    yield {
        "root": root,
        "losses": module.losses,
        "logits": probe_logits(module.model),
        "trainer": trainer,
        "checkpoint": checkpoint,
        "cwd": cwd,
    }
    _clean(root)


def _after(losses: dict[int, float], step: int) -> dict[int, float]:
    return {s: v for s, v in losses.items() if s > step}


def _tree(url: str) -> list[str]:
    base = url.removeprefix("memory://").strip("/")
    found = [p.strip("/") for p in MEM.find(f"/{base}", withdirs=True)]
    return sorted(p.removeprefix(base).lstrip("/") for p in found if p != base)


def test_save_and_resume_at_a_url_exactly(run: dict[str, Any]) -> None:
    url = f"{run['root']}/mid"
    resumed, _ = fit(ckpt_path=url)
    assert resumed.losses == _after(run["losses"], 5)
    assert not list(run["cwd"].iterdir()), "a URL was written as a local path"
    marker = json.loads(MEM.cat_file(f"/{url.removeprefix('memory://')}/{COMMIT_MARKER}"))
    # Only the second save's files are left: the first one's were removed once the second was committed.
    assert _tree(url) == sorted([COMMIT_MARKER, marker["data"], *marker["files"]])
    meta = MEM.open(f"/{url.removeprefix('memory://')}/{marker['data']}/meta.pt")
    assert torch.load(meta, weights_only=True)["global_step"] == 5


def test_a_directory_without_its_commit_marker_is_incomplete(run: dict[str, Any], root: str) -> None:
    url = f"{root}/ckpt"
    MEM.copy(f"/{run['root'].removeprefix('memory://')}/mid", f"/{url.removeprefix('memory://')}", recursive=True)
    resolve(url)  # whole
    MEM.rm_file(f"/{url.removeprefix('memory://')}/{COMMIT_MARKER}")  # as a save killed before its commit leaves it
    with pytest.raises(IncompleteCheckpointError, match=f"no commit marker \\({COMMIT_MARKER}\\)"):
        fit(ckpt_path=url)
    with pytest.raises(FileNotFoundError, match="No checkpoint at"):
        resolve(f"{root}/never_written")


def test_a_truncated_shard_at_a_url_is_incomplete(run: dict[str, Any], root: str) -> None:
    url = f"{root}/ckpt"
    MEM.copy(f"/{run['root'].removeprefix('memory://')}/mid", f"/{url.removeprefix('memory://')}", recursive=True)
    _, data = resolve(url)
    shard = f"{data.removeprefix('memory://')}/__0_0.distcp"
    MEM.pipe_file(shard, MEM.cat_file(shard)[:100])
    with pytest.raises(IncompleteCheckpointError, match=r"__0_0\.distcp holds 100 bytes, the index needs"):
        resolve(url)


def test_saves_and_removal_keep_a_users_files(run: dict[str, Any]) -> None:
    url = f"{run['root']}/run"
    resolve(url)  # whole: the step-4 save
    run["trainer"].strategy.remove_checkpoint(url)  # removes what the saves wrote, nothing else
    # The data directory a killed save left went with the next commit; the look-alike holding a user's file stays.
    kept = ["shards-fedcba9876543210", "shards-fedcba9876543210/README", "shards-fedcba9876543210/__0_0.distcp"]
    assert _tree(url) == sorted(["notes.txt", *kept])
    assert MEM.cat_file(f"/{url.removeprefix('memory://')}/notes.txt") == b"mine"


def test_model_checkpoint_at_a_url_keeps_top_k_and_last(run: dict[str, Any]) -> None:
    root = f"{run['root']}/mc"
    top = sorted(name for name in _tree(root) if "/" not in name)
    assert top == ["epoch=1-step=6.ckpt", "epoch=1-step=8.ckpt", "last.ckpt", "notes.txt"]
    assert run["checkpoint"].last_model_path == f"{root}/last.ckpt"
    for name in top[:3]:
        resolve(f"{root}/{name}")  # each whole
    # A directory this package did not write (no marker) is left alone, with a warning.
    MEM.pipe_file(f"/{root.removeprefix('memory://')}/other/data.bin", b"x")
    with pytest.warns(UserWarning, match="was not removed: it is neither a torch.save archive nor a directory"):
        run["trainer"].strategy.remove_checkpoint(f"{root}/other")
    assert MEM.isfile(f"/{root.removeprefix('memory://')}/other/data.bin")
    # Nor is a file that is not a torch.save archive, removed or replaced by a single-file save.
    MEM.pipe_file(f"/{root.removeprefix('memory://')}/notes.ckpt", b"mine")
    with pytest.warns(UserWarning, match="was not removed"):
        run["trainer"].strategy.remove_checkpoint(f"{root}/notes.ckpt")
    assert plan_save(f"{root}/notes.ckpt", directory=False)["error"].startswith(
        f"The checkpoint URL {root}/notes.ckpt holds a file that is not a checkpoint"
    )
    assert MEM.cat_file(f"/{root.removeprefix('memory://')}/notes.ckpt") == b"mine"


def test_model_checkpoint_at_a_file_url_saves_where_it_names(
    run: dict[str, Any], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 27: Lightning's ``ModelCheckpoint`` turns ``dirpath="file:///abs/dir"`` into ``<cwd>/file:/abs/dir``;
    the strategy saves, removes and resumes in ``/abs/dir``, as at that path (published by renames, no marker)."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    from lightning_tp.tools.export import main

    cwd = tmp_path / "cwd"
    cwd.mkdir()
    monkeypatch.chdir(cwd)
    directory = tmp_path / "ckpts"
    url = "file://" + str(directory)
    checkpoint = ModelCheckpoint(dirpath=url, every_n_train_steps=3, save_last=True)  # top-1: step 3's is removed
    module, _ = fit(callbacks=[checkpoint])
    assert module.losses == run["losses"]
    assert sorted(p.name for p in directory.iterdir()) == ["epoch=1-step=6.ckpt", "last.ckpt"]
    assert checkpoint.last_model_path == str(directory / "last.ckpt")
    assert (directory / "last.ckpt" / ".metadata").is_file()
    assert not (directory / "last.ckpt" / COMMIT_MARKER).exists()
    assert not list(cwd.iterdir()), "the file:// URL was written as a path under the working directory"

    resumed, trainer = fit(ckpt_path=f"{url}/last.ckpt")
    assert resumed.losses == _after(run["losses"], 6)
    trainer.strategy.remove_checkpoint(f"{url}/epoch=1-step=6.ckpt")
    (directory / "notes.txt").write_text("mine")
    with pytest.warns(UserWarning, match="not written by a save of this package"):
        trainer.strategy.remove_checkpoint(f"{url}/notes.txt")
    assert sorted(p.name for p in directory.iterdir()) == ["last.ckpt", "notes.txt"]
    assert main([f"{url}/last.ckpt", str(tmp_path / "exported")]) == 0  # the export CLI reads it as a path too
    assert (tmp_path / "exported" / "config.json").is_file()
    assert not list(cwd.iterdir())


def test_file_urls_name_local_paths(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from lightning.pytorch.callbacks import ModelCheckpoint

    from lightning_tp.checkpoint.remote import local_path
    from lightning_tp.compat import model_checkpoint_dirs_from_file_urls

    assert local_path("file:///abs/dir/") == "/abs/dir"
    assert local_path("local:///abs/dir") == "local:///abs/dir"  # fsspec's alias: on disk, as on an object store
    assert local_path("memory://bucket/x") == "memory://bucket/x"
    assert local_path("simplecache::file:///abs/x") == "simplecache::file:///abs/x"
    assert local_path(Path("/abs/x")) == Path("/abs/x")
    with pytest.raises(ValueError, match="names no absolute path: write file:///absolute/path"):
        local_path("file://relative/dir")  # fsspec: under the working directory; ModelCheckpoint: /relative/dir
    # A directory a file:// URL wrote before it meant a local path (the URLs' layout) is named, not called incomplete.
    from lightning_tp.checkpoint.format import COMMIT_MARKER
    from lightning_tp.checkpoint.validation import check_checkpoint

    old = tmp_path / "old_url_layout"
    (old / "shards-0123456789abcdef").mkdir(parents=True)
    (old / COMMIT_MARKER).write_text("{}")
    with pytest.raises(ValueError, match=f"load it as local://{old}"):
        check_checkpoint(old)

    monkeypatch.chdir(tmp_path)
    callbacks = [
        ModelCheckpoint(dirpath="file:///abs/dir"),
        ModelCheckpoint(dirpath=str(tmp_path / "plain")),
        ModelCheckpoint(dirpath="memory://bucket/dir"),
        ModelCheckpoint(),
    ]
    assert callbacks[0].dirpath == os.path.realpath(tmp_path) + "/file:/abs/dir"  # what Lightning 2.6.6 makes of it
    model_checkpoint_dirs_from_file_urls(callbacks)
    plain = os.path.realpath(tmp_path / "plain")
    assert [c.dirpath for c in callbacks] == ["/abs/dir", plain, "memory://bucket/dir", None]


def test_export_reads_a_url(run: dict[str, Any], tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    from lightning_tp.tools.export import main

    url = f"{run['root']}/final"
    assert main([url, str(tmp_path / "exported")]) == 0
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "exported")
    # One process: the exported values are the run's, and the same forward runs on them: bit for bit.
    torch.testing.assert_close(probe_logits(model), run["logits"], atol=0, rtol=0)
    MEM.rm_file(f"/{url.removeprefix('memory://')}/{COMMIT_MARKER}")
    assert main([url, str(tmp_path / "again")]) == 1
    assert not os.path.exists(tmp_path / "again")


def test_a_crafted_marker_removes_nothing(root: str) -> None:
    """The marker steers what removal deletes: a name outside its data directory makes it unreadable."""
    from lightning_tp.checkpoint.remote import remove_checkpoint

    base = root.removeprefix("memory://")
    MEM.pipe_file(f"/{base}/notes.txt", b"mine")
    marker = {"format": 1, "data": "shards-0123456789abcdef", "files": ["shards-0123456789abcdef/../notes.txt"]}
    MEM.pipe_file(f"/{base}/ckpt/{COMMIT_MARKER}", json.dumps(marker).encode())
    with pytest.raises(IncompleteCheckpointError, match="outside its data directory"):
        resolve(f"{root}/ckpt")
    assert remove_checkpoint(f"{root}/ckpt") == [f"{root}/ckpt"]  # left alone: the caller warns
    assert MEM.cat_file(f"/{base}/notes.txt") == b"mine"


def test_a_url_holding_the_other_kind_of_checkpoint_is_refused(root: str) -> None:
    from lightning_tp.checkpoint.remote import plan_save

    base = root.removeprefix("memory://")
    MEM.pipe_file(f"/{base}/file.ckpt", b"PK\x03\x04")  # the start of a torch.save archive: a checkpoint
    MEM.pipe_file(f"/{base}/directory/notes.txt", b"mine")
    assert "is a file" in plan_save(f"{root}/file.ckpt", directory=True)["error"]
    assert "is a directory" in plan_save(f"{root}/directory", directory=False)["error"]
    assert plan_save(f"{root}/directory", directory=True)["data"].startswith(f"{root}/directory/shards-")
    assert plan_save(f"{root}/file.ckpt", directory=False)["data"] == f"{root}/.file.ckpt.partial"


def test_a_save_killed_before_its_commit_leaves_the_previous_checkpoint(root: str, monkeypatch) -> None:
    from lightning_tp.checkpoint import remote

    url = f"{root}/last"
    calls = []
    original = remote.commit

    def commit_then_die(*args: Any) -> None:
        calls.append(args)
        if len(calls) == 2:  # the second save wrote its shards and meta.pt, and dies before its marker
            raise OSError("killed")
        original(*args)

    monkeypatch.setattr(remote, "commit", commit_then_die)
    with pytest.raises(RuntimeError, match="killed"):
        fit(callbacks=[SaveAt(steps={2: url, 4: url})])
    _, data = resolve(url)  # the first save, whole
    assert torch.load(MEM.open(data.removeprefix("memory://") + "/meta.pt"), weights_only=True)["global_step"] == 2
    unfinished = calls[1][1].removeprefix("memory://")
    assert MEM.isfile(f"{unfinished}/meta.pt")  # written, never committed
