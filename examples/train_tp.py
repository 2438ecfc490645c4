"""Fine-tune a causal LM with tensor parallelism: the main job.

    python examples/train_tp.py                       # tiny Qwen3-style model, 2 CPU processes, no download
    python examples/train_tp.py --model Qwen/Qwen3-0.6B --accelerator gpu --devices 4 --precision bf16-true

Each rank of the TP group holds half of every sharded weight and sees the same batches; the loss printed per step is
the one a single process would compute.
"""

from __future__ import annotations

import argparse

import lightning as L
import torch
from sort_task import SortDigits, tiny_qwen3_config
from torch.utils.data import DataLoader

from lightning_tp import TensorParallelStrategy


class CausalLM(L.LightningModule):
    def __init__(self, model: str | None, *, lr: float):
        super().__init__()
        self.model_name = model
        self.lr = lr
        self.model: torch.nn.Module | None = None

    def configure_model(self) -> None:
        # Called on every rank before the strategy shards the model; guarded so a second call (validate after fit)
        # keeps the trained, sharded model.
        if self.model is not None:
            return
        from transformers import AutoModelForCausalLM

        torch.manual_seed(0)  # the same initial weights on every rank: sharding slices each rank's own copy
        if self.model_name is None:
            self.model = AutoModelForCausalLM.from_config(tiny_qwen3_config())
        else:
            self.model = AutoModelForCausalLM.from_pretrained(self.model_name)

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        loss = self.model(input_ids=batch["input_ids"], labels=batch["labels"]).loss
        self.log("loss", loss, prog_bar=True)
        self.print(f"step {self.global_step:3d}  loss {loss.item():.4f}")
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=self.lr)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="hub id or local path (default: a tiny model built here)")
    parser.add_argument("--accelerator", default="cpu")
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--tp-size", type=int, default=None, help="default: every device")
    parser.add_argument("--precision", default="32-true")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--lr", type=float, default=3e-3)
    args = parser.parse_args()

    tokenizer = None
    if args.model is not None:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(args.model)
    data = SortDigits(args.steps * args.batch_size, tokenizer=tokenizer)
    loader = DataLoader(
        data,
        batch_size=args.batch_size,
        shuffle=True,
        collate_fn=lambda items: {key: torch.stack([item[key] for item in items]) for key in ("input_ids", "labels")},
    )
    trainer = L.Trainer(
        accelerator=args.accelerator,
        devices=args.devices,
        strategy=TensorParallelStrategy(args.tp_size),
        precision=args.precision,
        max_steps=args.steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(CausalLM(args.model, lr=args.lr), loader)


if __name__ == "__main__":
    main()
