"""LightningCLI for causal-LM fine-tuning with tensor parallelism, configured from YAML.

    python examples/cli.py fit --config examples/configs/tp.yaml        # TP 2 on 2 CPU processes
    python examples/cli.py fit --config examples/configs/2d.yaml        # dp_shard 2 x tp 2 on 4 processes
    python examples/cli.py fit --config examples/configs/lora.yaml      # LoRA, TP 2
    python examples/cli.py fit --config examples/configs/cp.yaml        # context parallelism: cp 2 on 2 processes
    python examples/cli.py fit --config examples/configs/tp.yaml --print_config

`--trainer.strategy=tp` works too (the name `lightning_tp` registers), and every constructor argument of
`TensorParallelStrategy` is an `init_args` entry.
"""

from __future__ import annotations

import lightning as L
import torch
from lightning.pytorch.cli import LightningCLI
from sort_task import SortDigits, tiny_qwen3_config, tiny_qwen3_moe_config
from torch.utils.data import DataLoader

import lightning_tp  # noqa: F401  (registers the "tp" strategy name)


def _collate(items: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    return {key: torch.stack([item[key] for item in items]) for key in ("input_ids", "labels")}


class CausalLM(L.LightningModule):
    """Fine-tunes a causal LM: the tiny generated-task model by default, or ``model`` (a hub id or a local path,
    loaded sharded). ``moe_experts > 0``: the tiny model with that many experts per layer (for ``ep_size``).
    ``lora_r > 0`` trains LoRA adapters on ``lora_targets`` instead of every weight."""

    def __init__(
        self,
        model: str | None = None,
        *,
        lr: float = 3e-3,
        weight_decay: float = 0.0,
        lora_r: int = 0,
        lora_alpha: int = 32,
        lora_targets: str = "all-linear",
        lora_dropout: float = 0.0,
        moe_experts: int = 0,
    ):
        super().__init__()
        self.save_hyperparameters()
        self.model: torch.nn.Module | None = None

    def configure_model(self) -> None:
        if self.model is not None:
            return
        from transformers import AutoModelForCausalLM

        hp = self.hparams
        torch.manual_seed(0)  # the same weights on every rank: each shards its own copy
        if hp.model is not None:
            model = lightning_tp.from_pretrained(hp.model)
        elif hp.moe_experts > 0:
            model = AutoModelForCausalLM.from_config(tiny_qwen3_moe_config(hp.moe_experts))
        else:
            model = AutoModelForCausalLM.from_config(tiny_qwen3_config())
        if hp.lora_r > 0:
            from peft import LoraConfig, get_peft_model

            targets = hp.lora_targets if hp.lora_targets == "all-linear" else hp.lora_targets.split(",")
            config = LoraConfig(
                r=hp.lora_r, lora_alpha=hp.lora_alpha, target_modules=targets, lora_dropout=hp.lora_dropout
            )
            model = get_peft_model(model, config)
        self.model = model

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        loss = self.model(**batch).loss
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> None:
        self.log("val_loss", self.model(**batch).loss, sync_dist=True)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        params = [p for p in self.parameters() if p.requires_grad]
        return torch.optim.AdamW(params, lr=self.hparams.lr, weight_decay=self.hparams.weight_decay)


class SortTask(L.LightningDataModule):
    """The generated digit-sorting task; ``tokenizer`` (a hub id or path) encodes it for a real model."""

    def __init__(
        self,
        batch_size: int = 16,
        train_size: int = 1024,
        val_size: int = 64,
        length: int = 6,
        tokenizer: str | None = None,
    ):
        super().__init__()
        self.save_hyperparameters()

    def setup(self, stage: str) -> None:
        tokenizer = None
        if self.hparams.tokenizer is not None:
            from transformers import AutoTokenizer

            tokenizer = AutoTokenizer.from_pretrained(self.hparams.tokenizer)
        hp = self.hparams
        self.train_set = SortDigits(hp.train_size, length=hp.length, seed=0, tokenizer=tokenizer)
        self.val_set = SortDigits(hp.val_size, length=hp.length, seed=1, tokenizer=tokenizer)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.train_set, batch_size=self.hparams.batch_size, shuffle=True, collate_fn=_collate)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.val_set, batch_size=self.hparams.batch_size, collate_fn=_collate)


def main(args: list[str] | None = None) -> LightningCLI:
    """``args``: the command line's arguments by default."""
    return LightningCLI(CausalLM, SortTask, args=args, save_config_kwargs={"overwrite": True})


if __name__ == "__main__":
    main()
