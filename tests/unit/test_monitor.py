"""The ThroughputMonitor on one process: what it measures, how often it pays a collective, which peak it divides by."""

from __future__ import annotations

from pathlib import Path

import lightning as L
import pytest
import torch
from torch.utils.data import DataLoader

from lightning_tp import ThroughputMonitor
from lightning_tp.compat import CUDA_FLOPS
from lightning_tp.runtime.monitor import matmul_dtype


class _Tiny(L.LightningModule):
    def __init__(self, spike_mb: int = 0) -> None:
        super().__init__()
        self.layer = torch.nn.Embedding(64, 8)
        self.spike_mb = spike_mb

    def on_fit_start(self) -> None:
        if self.spike_mb:  # a setup-time spike (a checkpoint load, say), freed before training
            spike = torch.ones(self.spike_mb * 2**20 // 4)
            del spike

    def training_step(self, batch, batch_idx):
        return self.layer(batch["input_ids"]).sum()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _fit(module: L.LightningModule, *, steps: int, log_every: int, accumulate: int = 1) -> tuple[L.Trainer, list]:
    monitor = ThroughputMonitor()
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=steps,
        log_every_n_steps=log_every,
        accumulate_grad_batches=accumulate,
        callbacks=[monitor],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    reduces: list[float] = []
    reduce = trainer.strategy.reduce

    def counted(tensor, *args, **kwargs):
        import inspect

        if inspect.stack()[1].function == "on_train_batch_end":  # the monitor's (Lightning reduces some of its own)
            reduces.append(float(tensor))
        return reduce(tensor, *args, **kwargs)

    trainer.strategy.reduce = counted  # type: ignore[method-assign]
    mask = torch.ones(2, 8, dtype=torch.long)
    mask[:, -3:] = 0  # padding: 10 tokens per batch, not 16
    data = [{"input_ids": torch.randint(0, 64, (2, 8)), "attention_mask": mask} for _ in range(steps * accumulate)]
    trainer.fit(module, DataLoader(data, batch_size=None))
    return trainer, reduces


def test_reduces_only_where_the_loggers_write() -> None:
    """Ten steps, logging every 4: a window closes at the first step and at the logging steps only (one reduce each),
    not at every step; tokens come from the mask, and the figures are the window's."""
    trainer, reduces = _fit(_Tiny(), steps=10, log_every=4)
    assert len(reduces) == 3, reduces  # step 1, then where Lightning logs (steps 4 and 8)
    metrics = trainer.callback_metrics
    assert float(metrics["tokens_per_sec"]) == pytest.approx(reduces[-1])  # one process: the global sum is its own
    assert float(metrics["tokens_per_sec_per_replica"]) == pytest.approx(reduces[-1])
    assert float(metrics["step_time_s"]) > 0
    # tokens/s x the window's time = its tokens: 10 per step (the mask), an exact multiple.
    tokens_in_window = float(metrics["tokens_per_sec_per_replica"]) * float(metrics["step_time_s"])
    assert tokens_in_window == pytest.approx(10.0, rel=1e-6)


def test_counts_every_micro_batch_and_closes_at_the_optimizer_step() -> None:
    trainer, reduces = _fit(_Tiny(), steps=4, log_every=2, accumulate=3)
    assert len(reduces) == 3, reduces  # steps 1, 2 and 4
    tokens_per_step = float(trainer.callback_metrics["tokens_per_sec_per_replica"]) * float(
        trainer.callback_metrics["step_time_s"]
    )
    assert tokens_per_step == pytest.approx(30.0, rel=1e-6)  # 3 micro-batches of 10 tokens


@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="no /proc/self/clear_refs to reset peaks")
def test_peak_memory_is_the_windows_own() -> None:
    """A 512 MiB spike before training is not in the reported peak (the window's peak is reset when it opens)."""
    trainer, _ = _fit(_Tiny(spike_mb=512), steps=2, log_every=1)
    from lightning_tp.runtime.monitor import peak_rss_mb

    rss_now = peak_rss_mb()
    assert float(trainer.callback_metrics["peak_memory_mb"]) < rss_now + 256


@pytest.mark.parametrize(
    ("precision", "matmul", "expected"),
    [
        ("32-true", "highest", torch.float32),
        ("32-true", "high", "tfloat32"),
        ("32-true", "medium", "tfloat32"),
        ("bf16-mixed", "highest", torch.bfloat16),
        ("bf16-true", "high", torch.bfloat16),
        ("16-true", "highest", torch.float16),
    ],
)
def test_mfu_divides_by_the_peak_of_the_dtype_the_matmuls_run_in(precision: str, matmul: str, expected) -> None:
    before = torch.get_float32_matmul_precision()
    try:
        torch.set_float32_matmul_precision(matmul)
        assert matmul_dtype(precision) == expected
    finally:
        torch.set_float32_matmul_precision(before)
    # Lightning's table has every one of them; TF32 against fp32 is the 7x the old choice was off by on an H100.
    assert CUDA_FLOPS["h100 sxm"]["tfloat32"] / CUDA_FLOPS["h100 sxm"][torch.float32] > 7
    assert expected in CUDA_FLOPS["h100 sxm"]


class _SlowValidation(_Tiny):
    def validation_step(self, batch, batch_idx) -> None:
        import time

        time.sleep(0.3)


def test_validation_inside_a_window_is_not_training_time() -> None:
    monitor = ThroughputMonitor()
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=4,
        log_every_n_steps=4,
        val_check_interval=2,
        num_sanity_val_steps=0,
        limit_val_batches=1,
        callbacks=[monitor],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    data = [{"input_ids": torch.randint(0, 64, (2, 8))} for _ in range(4)]
    trainer.fit(_SlowValidation(), DataLoader(data, batch_size=None), DataLoader(data[:1], batch_size=None))
    assert float(trainer.callback_metrics["step_time_s"]) < 0.1  # the window of steps 2-4 held a 0.3 s validation
