"""LoRA fine-tuning with tensor parallelism: PEFT as usual, adapters sharded with their base layers.

    python examples/finetune_lora.py                  # tiny Qwen3-style model, 2 CPU processes, no download
    python examples/finetune_lora.py --model Qwen/Qwen3-0.6B --accelerator gpu --devices 4 --precision bf16-true

Reports answer-token accuracy and exact-match accuracy (torchmetrics) on held-out items, and saves the adapter in
PEFT's format (`PeftModel.from_pretrained(base, --out)` loads it on one process).
"""

from __future__ import annotations

import argparse

import lightning as L
import torch
import torchmetrics
from sort_task import SortDigits, tiny_qwen3_config
from torch.utils.data import DataLoader

import lightning_tp


def collate(items: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    return {key: torch.stack([item[key] for item in items]) for key in items[0]}


class LoRAFineTune(L.LightningModule):
    def __init__(self, model: str | None, *, rank: int, lr: float):
        super().__init__()
        self.model_name, self.rank, self.lr = model, rank, lr
        self.model: torch.nn.Module | None = None
        self.token_accuracy = torchmetrics.MeanMetric()
        self.exact_match = torchmetrics.MeanMetric()

    def configure_model(self) -> None:
        if self.model is not None:
            return
        from peft import LoraConfig, get_peft_model
        from transformers import AutoModelForCausalLM

        torch.manual_seed(0)  # identical weights and adapters on every rank: each shards its own copy
        if self.model_name is None:
            base = AutoModelForCausalLM.from_config(tiny_qwen3_config())
        else:  # built on the meta device; the strategy reads each rank's slices after sharding
            base = lightning_tp.from_pretrained(self.model_name)
        config = LoraConfig(r=self.rank, lora_alpha=2 * self.rank, target_modules="all-linear", lora_dropout=0.0)
        self.model = get_peft_model(base, config)

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        loss = self.model(input_ids=batch["input_ids"], labels=batch["labels"]).loss
        self.log("loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> None:
        ids, labels = batch["input_ids"], batch["labels"]
        logits = self.model(input_ids=ids).logits
        answer = labels[:, 1:] != -100
        predicted = logits[:, :-1].argmax(-1)
        self.token_accuracy.update((predicted == labels[:, 1:])[answer].float())
        # Greedy generation of the whole answer from the prompt: exact match per item.
        prompt = int(batch["prompt_length"][0])
        generated = self.model.generate(
            input_ids=ids[:, :prompt],
            attention_mask=torch.ones_like(ids[:, :prompt]),
            max_new_tokens=ids.shape[1] - prompt,
            do_sample=False,
        )
        self.exact_match.update((generated[:, prompt:] == ids[:, prompt:]).all(-1).float())

    def on_validation_epoch_end(self) -> None:
        token, exact = self.token_accuracy.compute(), self.exact_match.compute()  # synchronised over the ranks
        # The metrics themselves are logged (Lightning computes and resets them): they are synchronised already.
        self.log_dict({"token_accuracy": self.token_accuracy, "exact_match": self.exact_match})
        self.print(f"step {self.global_step:3d}  answer-token accuracy {token:.3f}  exact match {exact:.3f}")

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW([p for p in self.parameters() if p.requires_grad], lr=self.lr)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="hub id or local path (default: a tiny model built here)")
    parser.add_argument("--accelerator", default="cpu")
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--tp-size", type=int, default=None)
    parser.add_argument("--precision", default="32-true")
    parser.add_argument("--steps", type=int, default=120)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--lr", type=float, default=1e-2)
    parser.add_argument("--rank", type=int, default=16, help="LoRA rank")
    parser.add_argument("--out", default="lora_adapter", help="where the adapter is saved")
    args = parser.parse_args()

    tokenizer = None
    if args.model is not None:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(args.model)
    train = SortDigits(args.steps * args.batch_size, length=4, tokenizer=tokenizer)
    held_out = SortDigits(64, length=4, seed=1, tokenizer=tokenizer)
    trainer = L.Trainer(
        accelerator=args.accelerator,
        devices=args.devices,
        strategy=lightning_tp.TensorParallelStrategy(args.tp_size),
        precision=args.precision,
        max_steps=args.steps,
        val_check_interval=args.steps // 3,
        num_sanity_val_steps=-1,  # the held-out accuracy before training
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    module = LoRAFineTune(args.model, rank=args.rank, lr=args.lr)
    trainer.fit(
        module,
        DataLoader(train, batch_size=args.batch_size, shuffle=True, collate_fn=collate),
        DataLoader(held_out, batch_size=32, collate_fn=collate),
    )
    # Called on every rank: the adapters are gathered and rank 0 writes one standard PEFT directory.
    module.model.save_pretrained(args.out)
    trainer.print(f"adapter saved to {args.out}")


if __name__ == "__main__":
    main()
