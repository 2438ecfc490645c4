"""Fine-tune a causal LM with tensor parallelism in Lightning Fabric: your own loop, the same sharding as the Trainer.

    python examples/fabric_tp.py                      # tiny Qwen3-style model, 2 CPU processes, no download
    python examples/fabric_tp.py --model Qwen/Qwen3-0.6B --accelerator cuda --devices 4 --precision bf16-true

Fabric starts the other processes itself (or run it under torchrun/SLURM). Each rank of a TP group holds its slice of
every sharded weight and reads the same batches; the loss printed per step is the one a single process computes.
``--checkpoint DIR`` saves model and optimizer at the end (a directory any layout loads; ``python -m
lightning_tp.export DIR OUT`` turns it into a Transformers directory).
"""

from __future__ import annotations

import argparse

import torch
from lightning.fabric import Fabric
from sort_task import SortDigits, tiny_qwen3_config
from torch.utils.data import DataLoader

import lightning_tp
from lightning_tp.fabric import TensorParallelStrategy


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="hub id or local path (default: a tiny model built here)")
    parser.add_argument("--accelerator", default="cpu")
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--tp-size", type=int, default=None, help="default: every device")
    parser.add_argument("--precision", default="32-true")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--batch-size", type=int, default=16, help="per data-parallel replica")
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--checkpoint", default=None, help="save model and optimizer here at the end")
    args = parser.parse_args()

    fabric = Fabric(
        accelerator=args.accelerator,
        devices=args.devices,
        strategy=TensorParallelStrategy(args.tp_size),
        precision=args.precision,
    )
    fabric.launch()
    fabric.seed_everything(0)  # the same initial weights on every rank: sharding slices each rank's own copy

    tokenizer = None
    if args.model is None:
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_config(tiny_qwen3_config())
    else:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(args.model)
        with fabric.init_module(empty_init=True):  # on the meta device: each rank reads only its slices
            model = lightning_tp.from_pretrained(args.model)
    model.train()
    # `fabric.setup` shards the model (its own TP plan; FSDP2 over the ranks TP leaves) and points the optimizer
    # at the sharded parameters.
    model, optimizer = fabric.setup(model, torch.optim.AdamW(model.parameters(), lr=args.lr, foreach=False))

    data = SortDigits(args.steps * args.batch_size * fabric.strategy.dp_mesh.size(), tokenizer=tokenizer)
    loader = DataLoader(
        data,
        batch_size=args.batch_size,
        shuffle=True,
        collate_fn=lambda items: {key: torch.stack([item[key] for item in items]) for key in ("input_ids", "labels")},
    )
    loader = fabric.setup_dataloaders(loader)  # split over the data-parallel ranks only

    for step, batch in enumerate(loader):
        loss = model(input_ids=batch["input_ids"], labels=batch["labels"]).loss
        fabric.backward(loss)
        fabric.clip_gradients(model, optimizer, max_norm=1.0)  # the global norm over every shard
        optimizer.step()
        optimizer.zero_grad()
        loss = fabric.all_reduce(loss.detach())  # mean over the data-parallel replicas
        fabric.print(f"step {step:3d}  loss {loss.item():.4f}")

    if args.checkpoint is not None:
        fabric.save(args.checkpoint, {"model": model, "optimizer": optimizer, "step": args.steps})
        fabric.print(f"saved {args.checkpoint}")


if __name__ == "__main__":
    main()
