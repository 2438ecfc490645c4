"""Prompts and a LightningModule for evaluation and prediction with ``generate`` when data-parallel ranks get unequal
work (fewer batches on one rank, generations of different lengths), with the single-process reference."""

from __future__ import annotations

from functools import partial
from typing import Any

import lightning as L
import torch

from tests.helpers.models import build_causal_lm, lm_batches, tiny_config

MAX_NEW_TOKENS = 6
build = partial(build_causal_lm, tiny_config("qwen3"))


def prompts() -> list[dict[str, torch.Tensor]]:
    """Three prompts of different lengths: on 2 data-parallel ranks, Lightning's predict sampler gives rank 0 two."""
    return [
        {"index": torch.tensor([i]), "input_ids": (torch.arange(length).reshape(1, length) * (i + 3) + 5) % 90 + 2}
        for i, length in enumerate((5, 7, 4))
    ]


def generate_kwargs() -> dict[str, Any]:
    """Greedy decoding whose end-of-sequence token is the second token the reference generates for prompt 0, so that
    prompt 0 stops early and the others run to ``MAX_NEW_TOKENS``: ranks generate different lengths."""
    model = build().eval()
    with torch.no_grad():
        first = model.generate(prompts()[0]["input_ids"], max_new_tokens=2, do_sample=False, pad_token_id=0)
    return {"max_new_tokens": MAX_NEW_TOKENS, "do_sample": False, "eos_token_id": int(first[0, -1]), "pad_token_id": 0}


def reference_outputs(kwargs: dict[str, Any]) -> dict[int, list[int]]:
    """Each prompt's generation on one process, without any strategy."""
    model = build().eval()
    with torch.no_grad():
        return {int(p["index"]): model.generate(p["input_ids"], **kwargs)[0].tolist() for p in prompts()}


def val_batches() -> list[dict[str, torch.Tensor]]:
    return [{**batch, "index": torch.tensor([i])} for i, batch in enumerate(lm_batches(3))]


def reference_losses() -> dict[int, float]:
    model = build().eval()
    with torch.no_grad():
        return {i: float(model(input_ids=b["input_ids"], labels=b["labels"]).loss) for i, b in enumerate(val_batches())}


class InferenceModule(L.LightningModule):
    """``predict_step`` generates; ``validation_step`` records each batch's loss and generates from its first tokens,
    so every batch runs a different number of forwards on each rank."""

    def __init__(self, kwargs: dict[str, Any]):
        super().__init__()
        self.kwargs = kwargs
        self.model: torch.nn.Module | None = None
        self.val_losses: dict[int, float] = {}
        self.generate_in_training = False
        self.train_generated: dict[int, list[int]] = {}

    def configure_model(self) -> None:
        if self.model is None:
            self.model = build()

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        if self.generate_in_training:  # sharded weights; rank r generates from prompt r: 2 tokens on rank 0, 6 on 1
            prompt = prompts()[self.global_rank]
            out = self.model.generate(prompt["input_ids"], **self.kwargs)
            self.train_generated[int(prompt["index"])] = out[0].tolist()
        return self.model(input_ids=batch["input_ids"], labels=batch["labels"]).loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.0)  # the weights stay those of the reference

    def predict_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> tuple[int, list[int]]:
        out = self.model.generate(batch["input_ids"], attention_mask=torch.ones_like(batch["input_ids"]), **self.kwargs)
        return int(batch["index"]), out[0].tolist()

    def validation_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> None:
        loss = self.model(input_ids=batch["input_ids"], labels=batch["labels"]).loss
        self.val_losses[int(batch["index"])] = float(loss)
        ids = batch["input_ids"][:1, : 3 + batch_idx]
        self.model.generate(ids, attention_mask=torch.ones_like(ids), **self.kwargs)


def held_share(module: torch.nn.Module) -> float:
    """The share of the model's parameters this rank holds now: FSDP2 registers a gathered parameter (whole, or its
    TP shard) while a module is unsharded and its shard otherwise."""
    from torch.distributed.tensor import DTensor

    held = total = 0
    for p in module.parameters():
        held += (p.to_local() if isinstance(p, DTensor) else p).numel()
        total += p.numel()
    return held / total


class HeldShare(L.Callback):
    """:func:`held_share` at the start of every training and validation batch."""

    def __init__(self) -> None:
        self.shares: dict[str, list[float]] = {"train": [], "validation": []}

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any) -> None:
        self.shares["train"].append(held_share(pl_module))

    def on_validation_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any) -> None:
        self.shares["validation"].append(held_share(pl_module))
