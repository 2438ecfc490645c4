"""GarbageCollection: automatic collection off and setup's objects frozen while training, a young-generation
collection every N optimizer steps, the collector restored afterwards (also when training fails)."""

from __future__ import annotations

import gc

import lightning as L
import pytest
import torch
from torch.utils.data import DataLoader

from lightning_tp import GarbageCollection


class _Module(L.LightningModule):
    def __init__(self, fail_at: int | None = None) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(4, 1)
        self.fail_at = fail_at
        self.seen: list[tuple[bool, int]] = []

    def training_step(self, batch, batch_idx):
        self.seen.append((gc.isenabled(), gc.get_freeze_count()))
        if batch_idx == self.fail_at:
            raise RuntimeError("boom")
        return self.layer(batch).sum()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _fit(module: _Module, *, steps: int, every: int, accumulate: int = 1) -> list[tuple[int, bool]]:
    collections: list[tuple[int, bool]] = []

    def record(phase: str, info: dict) -> None:
        if phase == "start":
            collections.append((info["generation"], gc.isenabled()))

    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=steps,
        accumulate_grad_batches=accumulate,
        callbacks=[GarbageCollection(every)],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    gc.callbacks.append(record)
    try:
        trainer.fit(module, DataLoader([torch.randn(2, 4) for _ in range(steps * accumulate)], batch_size=None))
    finally:
        gc.callbacks.remove(record)
    return collections


def test_collects_every_n_steps_with_automatic_collection_off() -> None:
    assert gc.isenabled()
    module = _Module()
    collections = _fit(module, steps=9, every=4, accumulate=2)
    assert all(not enabled and frozen > 0 for enabled, frozen in module.seen), module.seen[:3]
    # The full collection before freezing, then full ones (of what came since) at steps 4 and 8 (the optimizer steps,
    # not the 18 micro-batches); nothing automatic in between (Python's own may follow once it is enabled again).
    assert collections[:3] == [(2, True), (2, False), (2, False)], collections
    assert all(enabled for _, enabled in collections[3:]), collections
    assert gc.isenabled() and gc.get_freeze_count() == 0


def test_restores_the_collector_when_training_fails() -> None:
    with pytest.raises(RuntimeError, match="boom"):
        _fit(_Module(fail_at=2), steps=5, every=2)
    assert gc.isenabled() and gc.get_freeze_count() == 0


@pytest.mark.parametrize("value", [0, -1, 2.5, True])
def test_refuses_a_bad_interval(value) -> None:
    with pytest.raises(ValueError, match="gc_every_n_steps"):
        GarbageCollection(value)


def _listed(objects: list) -> int:
    """How many of ``objects`` the collector lists in its generations: ``gc.get_objects()`` leaves out the frozen
    (permanent) generation. (``gc.get_freeze_count()`` is no measure of a freeze: it drops whenever any frozen object
    is freed, which anything in the process may do.)"""
    ids = {id(obj) for obj in objects}
    return sum(id(obj) in ids for obj in gc.get_objects())


def test_leaves_a_users_own_freeze_and_reenables_collection_in_forked_children() -> None:
    import os

    mine = [[] for _ in range(3)]  # containers (tracked by the collector) only this test refers to
    assert _listed(mine) == len(mine)
    gc.freeze()
    try:
        assert _listed(mine) == 0 and gc.get_freeze_count() > 0  # the user's freeze: out of every generation
        callback = GarbageCollection(2)
        callback.on_train_start(None, None)  # type: ignore[arg-type]
        assert not gc.isenabled()
        read, write = os.pipe()
        pid = os.fork()
        if pid == 0:  # a data-loader worker forked while training
            os.write(write, b"1" if gc.isenabled() else b"0")
            os._exit(0)
        os.waitpid(pid, 0)
        assert os.read(read, 1) == b"1"
        callback.on_train_end(None, None)  # type: ignore[arg-type]
        assert gc.isenabled() and _listed(mine) == 0  # the user's freeze is still theirs: not undone by the callback
    finally:
        gc.unfreeze()
        gc.enable()
    assert _listed(mine) == len(mine)  # an unfreeze (the user's here) puts them back: what the check above would see
