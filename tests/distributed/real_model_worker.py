"""SmolLM2-135M-Instruct (a real pretrained model) at TP 3, under torchrun on 3 processes: greedy chat answers, a few
training steps of the whole model and of LoRA adapters through the Trainer strategy, the trained model exported and
the adapter saved. Writes what rank 0 saw to OUT_DIR/result.pt; the test compares it with one process.

Usage: real_model_worker.py MODEL_DIR OUT_DIR
"""

from __future__ import annotations

import gc
import sys
from functools import partial
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.utils.data import DataLoader

import lightning_tp
from lightning_tp import TensorParallelStrategy
from tests.helpers.models import ParityModule, quiet_trainer
from tests.helpers.real_model import CHAT_QUESTIONS, STEPS, build_lora, chat_answers, training_batches
from tests.helpers.tripwire import worker_setup


def chat(model_dir: str) -> dict:
    """Sharded with `parallelize` (the plain API), then Transformers' own `generate`."""
    from transformers import AutoTokenizer

    model = lightning_tp.from_pretrained(model_dir)
    lightning_tp.parallelize(model, tp_size=3)
    q_proj = model.model.layers[0].self_attn.q_proj.weight
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    return {
        "answers": chat_answers(model, tokenizer, CHAT_QUESTIONS),
        "q_proj_local_shape": tuple(q_proj.to_local().shape),
        "tied": model.lm_head.weight is model.model.embed_tokens.weight,
    }


def train(model_dir: str, out: Path, *, lora: bool) -> dict:
    from transformers import AutoTokenizer

    build = partial(build_lora, model_dir) if lora else partial(lightning_tp.from_pretrained, model_dir)
    # LoRA with SGD: AdamW's first steps move every weight by about lr whatever its gradient, so a gradient that is
    # zero up to rounding (lora_B starts at zero) gets a sign of its own on each layout.
    module = ParityModule(build, optimizer="sgd", lr=0.5) if lora else ParityModule(build, optimizer="adamw", lr=1e-5)
    batches = training_batches(AutoTokenizer.from_pretrained(model_dir))
    trainer = quiet_trainer(accelerator="cpu", devices=3, strategy=TensorParallelStrategy(tp_size=3), max_steps=STEPS)
    trainer.fit(module, DataLoader(batches, batch_size=None))
    name = "lora" if lora else "full"
    module.model.save_pretrained(out / name)  # every rank: gathered, written by rank 0
    return {
        "losses": module.losses,
        "grad_norms": module.grad_norms,
        "all_dtensor": all(isinstance(p, DTensor) for p in module.parameters()),
        "trainable": sum(p.requires_grad for p in module.parameters()),
        "saved": str(out / name),
    }


def main() -> None:
    timeout = worker_setup()
    model_dir, out = sys.argv[1], Path(sys.argv[2])
    dist.init_process_group("gloo", timeout=timeout)
    try:
        result = {"chat": chat(model_dir)}
        gc.collect()
        result["full"] = train(model_dir, out, lora=False)
        gc.collect()
        result["lora"] = train(model_dir, out, lora=True)
        if dist.get_rank() == 0:
            torch.save(result, out / "result.pt")
    finally:
        gc.collect()  # the models' cycles freed while gloo's threads can still drop their tensors
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
