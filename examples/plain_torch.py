"""Tensor parallelism in a plain PyTorch loop, no Lightning: ``lightning_tp.parallelize`` and nothing else.

    torchrun --nproc-per-node 2 examples/plain_torch.py                  # TP 2, tiny model, CPU
    torchrun --nproc-per-node 4 examples/plain_torch.py --tp-size 2      # TP 2 x FSDP2 over 2
    torchrun --nproc-per-node 4 examples/plain_torch.py --model Qwen/Qwen3-0.6B   # a real model (GPU: NCCL)

Each TP group sees the same batches; the sampler splits the data over the data-parallel ranks only.
"""

from __future__ import annotations

import argparse

import torch
import torch.distributed as dist
from sort_task import SortDigits, tiny_qwen3_config
from torch.utils.data import DataLoader, DistributedSampler

import lightning_tp


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="hub id or path (default: a tiny Qwen3-style model)")
    parser.add_argument("--tp-size", type=int, default=None, help="ranks per TP group (default: all)")
    parser.add_argument("--steps", type=int, default=30)
    args = parser.parse_args()

    from transformers import AutoModelForCausalLM, AutoTokenizer

    dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    if torch.cuda.is_available():
        torch.cuda.set_device(dist.get_rank() % torch.cuda.device_count())
    torch.manual_seed(0)  # the same initial weights on every rank
    if args.model is None:
        model, tokenizer = AutoModelForCausalLM.from_config(tiny_qwen3_config()), None
    else:
        model, tokenizer = AutoModelForCausalLM.from_pretrained(args.model), AutoTokenizer.from_pretrained(args.model)

    # --- the ten lines --------------------------------------------------------------------------------------------
    layout = lightning_tp.ParallelLayout.resolve(dist.get_world_size(), tp_size=args.tp_size)
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    mesh, dp_mesh = layout.build_device_mesh(device.type)
    model = lightning_tp.parallelize(model, mesh=mesh)  # the model's own TP plan, then FSDP2 over the rest
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    data = SortDigits(64 * args.steps, tokenizer=tokenizer)
    sampler = DistributedSampler(data, num_replicas=dp_mesh.size(), rank=dp_mesh.get_local_rank(), seed=0)
    for step, batch in enumerate(DataLoader(data, batch_size=8, sampler=sampler)):
        loss = model(input_ids=batch["input_ids"].to(device), labels=batch["labels"].to(device)).loss
        loss.backward()
        lightning_tp.clip_grad_norm_(model.parameters(), 1.0)  # the global norm over every shard
        optimizer.step()
        optimizer.zero_grad()
        # ------------------------------------------------------------------------------------------------------------
        if dist.get_rank() == 0 and (step % 10 == 0 or step == args.steps - 1):
            print(f"step {step} loss {loss.item():.4f} ({layout})", flush=True)
        if step + 1 == args.steps:
            break
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
