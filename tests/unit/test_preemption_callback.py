"""The preemption callback in one process: which signals, when it saves (optimizer-step boundaries only), where
(``hpc_ckpt_N``, found by ``ckpt_path="hpc"``), how it exits, and that the handlers are put back. The multi-process
cases (every rank, one rank, both launchers) are in tests/distributed/test_preemption.py."""

from __future__ import annotations

import os
import signal
from typing import Any

import lightning as L
import pytest
import torch
from lightning.pytorch.utilities.exceptions import SIGTERMException
from torch import nn

from lightning_tp import TensorParallelStrategy
from lightning_tp.runtime.preemption import PreemptionCheckpoint, resolve_signals
from tests.helpers.models import quiet_trainer


def test_signal_names_are_checked_early() -> None:
    assert resolve_signals(("SIGTERM", "usr1", signal.SIGUSR2, 10)) == (signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2)
    assert resolve_signals(None) == () and resolve_signals([]) == ()
    with pytest.raises(ValueError, match=r"holds 'SIGTREM', which is not a signal.*`None` to turn"):
        resolve_signals(["SIGTREM"])
    with pytest.raises(ValueError, match="holds SIGKILL, which cannot be handled"):
        resolve_signals("SIGKILL")
    with pytest.raises(ValueError, match="holds 'SIGTREM'"):
        TensorParallelStrategy(preemption_signals=("SIGTREM",))  # when the Trainer is built, before any process
    assert TensorParallelStrategy()._preemption_signals == (signal.SIGTERM, signal.SIGUSR1)
    assert TensorParallelStrategy(preemption_signals=None)._preemption_signals == ()


class Regression(L.LightningModule):
    def __init__(self, signal_at: int | None = None) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Linear(4, 1)
        self.signal_at = signal_at
        self.losses: dict[int, float] = {}

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        if self.trainer.fit_loop.total_batch_idx == self.signal_at:
            os.kill(os.getpid(), signal.SIGTERM)  # mid-step, mid-accumulation
        loss = (self.net(batch[:, :4]) - batch[:, 4:]).pow(2).mean()
        self.losses[self.trainer.fit_loop.total_batch_idx] = loss.item()
        return loss

    def configure_optimizers(self) -> Any:
        return torch.optim.AdamW(self.parameters(), lr=0.1)

    def train_dataloader(self) -> Any:
        from torchdata.stateful_dataloader import StatefulDataLoader  # resumes mid-epoch at the next batch

        return StatefulDataLoader(torch.randn(12, 5, generator=torch.Generator().manual_seed(0)), batch_size=2)

    def validation_step(self, batch: torch.Tensor, batch_idx: int) -> None:
        if self.trainer.sanity_checking:  # the callback's handlers are in place from the sanity check on
            assert getattr(signal.getsignal(signal.SIGTERM), "__func__", None) is PreemptionCheckpoint._handle

    def val_dataloader(self) -> Any:
        return torch.utils.data.DataLoader(torch.randn(2, 5), batch_size=2)


def _fit(root: Any, module: Regression, **kwargs: Any) -> L.Trainer:
    trainer = quiet_trainer(
        accelerator="cpu",
        devices=1,
        max_epochs=2,
        accumulate_grad_batches=2,
        default_root_dir=root,
        callbacks=[PreemptionCheckpoint()],
    )
    trainer.fit(module, **kwargs)
    return trainer


def test_saves_at_the_next_optimizer_step_then_resumes_exactly(tmp_path: Any) -> None:
    reference = Regression()
    _fit(tmp_path / "reference", reference)
    before = signal.getsignal(signal.SIGTERM)
    preempted = Regression(signal_at=2)  # micro-batch 2 starts an accumulation of 2: the step ends after batch 3
    with pytest.raises(SIGTERMException) as exit:
        _fit(tmp_path, preempted)
    assert exit.value.code == 143
    assert signal.getsignal(signal.SIGTERM) == before  # Lightning's and this callback's handlers are gone
    assert sorted(preempted.losses) == [0, 1, 2, 3]
    checkpoint = torch.load(tmp_path / "hpc_ckpt_1.ckpt", weights_only=False)
    assert checkpoint["global_step"] == 2
    resumed = Regression()
    _fit(tmp_path, resumed, ckpt_path="hpc")
    assert sorted(resumed.losses) == list(range(4, 12))
    # The same process resumes with the same operations on the same values: bit for bit.
    assert {**preempted.losses, **resumed.losses} == reference.losses


def test_hpc_resume_skips_a_save_killed_midway(tmp_path: Any) -> None:
    """Lightning counts the hidden `.hpc_ckpt_2.ckpt.partial` of a killed save as the newest: resume the whole one."""
    from lightning_tp.checkpoint.publish import partial_path
    from lightning_tp.runtime.preemption import skip_unfinished_hpc_checkpoint

    (tmp_path / "hpc_ckpt_1.ckpt").mkdir()
    partial_path(tmp_path / "hpc_ckpt_2.ckpt").mkdir()
    trainer = quiet_trainer(default_root_dir=tmp_path)
    newest = trainer._checkpoint_connector._hpc_resume_path  # what `ckpt_path="hpc"` resolves to
    assert newest == str(tmp_path / "hpc_ckpt_2.ckpt")
    with pytest.warns(UserWarning, match=r"hpc_ckpt_2.ckpt .* unfinished save .* resuming from hpc_ckpt_1.ckpt"):
        assert skip_unfinished_hpc_checkpoint(newest) == tmp_path / "hpc_ckpt_1.ckpt"
    assert skip_unfinished_hpc_checkpoint(tmp_path / "hpc_ckpt_1.ckpt") == tmp_path / "hpc_ckpt_1.ckpt"
    (tmp_path / "hpc_ckpt_1.ckpt").rmdir()  # nothing whole: the load's own error names the unfinished save
    assert skip_unfinished_hpc_checkpoint(newest) == newest


def test_slurm_requeue_signal_saves_requeues_and_exits(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """On SLURM (auto-requeue on), SIGUSR1 saves, runs `scontrol requeue <job>` on rank 0, and exits with 138."""
    from lightning.fabric.plugins.environments import SLURMEnvironment

    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    scontrol = bin_dir / "scontrol"
    scontrol.write_text(f'#!/bin/sh\necho "$@" > {tmp_path / "scontrol_args"}\n')
    scontrol.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    for key, value in {
        "SLURM_NTASKS": "1",
        "SLURM_NTASKS_PER_NODE": "1",
        "SLURM_JOB_NAME": "train",
        "SLURM_JOB_ID": "4242",
        "SLURM_PROCID": "0",
        "SLURM_LOCALID": "0",
        "SLURM_NODEID": "0",
    }.items():
        monkeypatch.setenv(key, value)

    class Usr1(Regression):
        def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
            if batch_idx == 1:
                os.kill(os.getpid(), signal.SIGUSR1)
            return super().training_step(batch, batch_idx)

    trainer = quiet_trainer(
        accelerator="cpu",
        devices=1,
        max_epochs=1,
        default_root_dir=tmp_path,
        plugins=[SLURMEnvironment(auto_requeue=True)],
        callbacks=[PreemptionCheckpoint(("SIGTERM",))],  # the requeue signal is added by itself
    )
    with pytest.raises(SIGTERMException) as exit:
        trainer.fit(Usr1())
    assert exit.value.code == 128 + signal.SIGUSR1
    assert (tmp_path / "scontrol_args").read_text().split() == ["requeue", "4242"]
    assert torch.load(tmp_path / "hpc_ckpt_1.ckpt", weights_only=False)["global_step"] == 2
