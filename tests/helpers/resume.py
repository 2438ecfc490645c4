"""What the checkpoint tests train: a tiny Qwen3 (or another family: ``kind``) with AdamW and a per-step LR schedule,
over a shuffled data set read through torchdata's ``StatefulDataLoader`` (so Lightning can continue mid-epoch; a plain
``DataLoader`` for the resumes at an epoch's end on other layouts), saving at chosen steps."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import lightning as L
import torch
from torch.utils.data import DataLoader, DistributedSampler

from tests.helpers.cases import CHECKPOINT_ENV
from tests.helpers.models import SEQ, VOCAB, lm_batches
from tests.helpers.tolerances import fp32_loss_gap, fp32_roundings, output_scale

SAMPLES = 16
GLOBAL_BATCH = 4
EPOCHS = 2
STEPS = SAMPLES // GLOBAL_BATCH * EPOCHS  # 8: 4 per epoch
ROWS = GLOBAL_BATCH * SEQ  # the rows of a global batch (each predicts its next token)
PROBE = torch.arange(24).reshape(2, 12) % 90  # a fixed batch for logits
#: Families whose sequence mixers TP 2 splits by heads (lightning_tp/plans/mixers.py), with parameters of each that
#: it must store as a plain ``Shard(0)`` of the whole tensor: packed blocks (``[q | k | v]``, Mamba2's
#: ``[z | x | B | C | dt]``, the conv over those channels) whose module reads its slice of each block
#: (lightning_tp/parallel/blocks.py), or the per-head projections of latent attention. A checkpoint holds the model's
#: own layout of each.
MIXER_KINDS: dict[str, tuple[str, ...]] = {
    "qwen3_5": (  # a Gated DeltaNet layer, then full attention
        "model.layers.0.linear_attn.in_proj_qkv.weight",
        "model.layers.0.linear_attn.conv1d.weight",
        "model.layers.0.linear_attn.A_log",
    ),
    "deepseek_v3": (  # multi-head latent attention, a dense then a MoE layer
        "model.layers.0.self_attn.q_b_proj.weight",
        "model.layers.0.self_attn.kv_b_proj.weight",
    ),
    "nemotron_h": (  # a Mamba2 mixer, then attention
        "model.layers.0.mixer.in_proj.weight",
        "model.layers.0.mixer.conv1d.weight",
        "model.layers.0.mixer.D",
    ),
}


def samples() -> list[dict[str, torch.Tensor]]:
    rows = lm_batches(SAMPLES, batch_size=1, seed=7)
    return [{k: v[0] for k, v in row.items()} for row in rows]


class ResumeModule(L.LightningModule):
    """Records each step's local loss by global step; ``dropout`` makes the run depend on the random states."""

    def __init__(
        self, *, dropout: float = 0.0, lora: bool = False, stateful_data: bool = True, kind: str = "qwen3"
    ) -> None:
        super().__init__()
        self.kind = kind  # the tiny checkpoint it loads (tests/distributed/conftest.py writes them)
        self.dropout = dropout
        self.lora = lora
        self.stateful_data = stateful_data
        self.model: Any = None
        self.losses: dict[int, float] = {}

    def configure_model(self) -> None:
        if self.model is not None:
            return
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(
            Path(os.environ[CHECKPOINT_ENV]) / self.kind, attention_dropout=self.dropout, dtype=torch.float32
        )
        if self.lora:
            from peft import LoraConfig, get_peft_model

            torch.manual_seed(3)
            config = LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", init_lora_weights=False)
            self.model = get_peft_model(self.model, config)
        self.model.train()  # `from_pretrained` returns the model in eval mode, where dropout does nothing

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        loss = self.model(**batch).loss
        self.losses[self.global_step + 1] = loss.item()
        return loss

    def configure_optimizers(self) -> Any:
        optimizer = torch.optim.AdamW([p for p in self.parameters() if p.requires_grad], lr=1e-2)
        schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (1 + step))
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}

    def train_dataloader(self) -> Any:
        from torchdata.stateful_dataloader import StatefulDataLoader

        strategy = self.trainer.strategy
        replicas, rank = 1, 0
        if hasattr(strategy, "dp_mesh"):
            replicas, rank = strategy.dp_mesh.size(), strategy.dp_mesh.get_local_rank()
        # The same global batches on every layout: rank r of n reads samples r, r+n, ... of one shuffled order.
        sampler = DistributedSampler(samples(), num_replicas=replicas, rank=rank, shuffle=True, seed=0)
        loader = StatefulDataLoader if self.stateful_data else DataLoader
        return loader(samples(), batch_size=GLOBAL_BATCH // replicas, sampler=sampler)


class SaveAt(L.Callback):
    """``trainer.save_checkpoint`` after the given global steps (mid-epoch, as ``ModelCheckpoint(every_n_train_steps)``
    does) and at the end of the given epochs (as ``ModelCheckpoint`` does by default)."""

    def __init__(self, steps: dict[int, Path] | None = None, epochs: dict[int, Path] | None = None) -> None:
        self.steps = steps or {}
        self.epochs = epochs or {}

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        if trainer.global_step in self.steps:
            trainer.save_checkpoint(self.steps[trainer.global_step])

    def on_train_epoch_end(self, trainer: L.Trainer, *args: Any) -> None:
        if trainer.current_epoch in self.epochs:
            trainer.save_checkpoint(self.epochs[trainer.current_epoch])


def probe_logits(model: Any) -> torch.Tensor:
    model.eval()
    with torch.no_grad():
        device = next(model.parameters()).device
        return model(input_ids=PROBE.to(device)).logits.detach().cpu().clone()


#: ``(forward, step, output scale)`` of the runs of :class:`ResumeModule` by kind (tests/helpers/tolerances.py),
#: counted once per session.
_FP32: dict[str, tuple[int, int, float]] = {}


def fp32_resume_counts(kind: str, trained: dict[str, torch.Tensor] | None = None) -> tuple[int, int, float]:
    """What a run of :class:`ResumeModule` of ``kind`` rounds in fp32 (:func:`fp32_roundings` over a global batch), and
    its outputs' scale for :func:`fp32_loss_gap`: the largest over an epoch's global batches at the initial and the
    ``trained`` weights (pass them at the first call of a session)."""
    if kind not in _FP32:
        module = ResumeModule(kind=kind)
        module.configure_model()
        forward, step = fp32_roundings([v.shape for v in module.model.state_dict().values()], ROWS)
        rows = samples()
        batches = [
            {key: torch.stack([row[key] for row in rows[i : i + GLOBAL_BATCH]]) for key in rows[0]}
            for i in range(0, len(rows), GLOBAL_BATCH)
        ]
        _FP32[kind] = (forward, step, output_scale(module.model, batches, (trained,) if trained else ()))
    return _FP32[kind]


def fp32_loss_bounds(
    expected: dict[int, float], kind: str = "qwen3", trained: dict[str, torch.Tensor] | None = None
) -> dict[int, float]:
    """Per global step of ``expected`` (one layout's losses of :class:`ResumeModule`), the bound on another layout's
    (:func:`fp32_loss_gap`): step ``s`` computes with the weights of ``s - 1`` steps, whose roundings it counts too
    (AdamW's larger gaps of the weights move a loss by ``g · Δw`` only: see tests/helpers/tolerances.py)."""
    forward, step, scale = fp32_resume_counts(kind, trained)
    return {
        s: fp32_loss_gap(forward + (s - 1) * step, scale, loss, rows=ROWS, classes=VOCAB)
        for s, loss in expected.items()
    }
