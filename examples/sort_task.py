"""A small task the examples generate, so they run without downloads: sort a string of digits.

``"7391>"`` must be continued with ``"1379"``. A causal LM learns it in a few dozen steps on a CPU; the loss counts
only the answer. With a real model (``--model`` hub id or path), its own tokenizer encodes the same strings.
"""

from __future__ import annotations

import random
from typing import Any

import torch
from torch.utils.data import Dataset

DIGITS = "0123456789"
PAD, SEP, EOS = "_", ">", "."
VOCAB = PAD + SEP + EOS + DIGITS


class CharTokenizer:
    """One token per character of ``VOCAB``: what the tiny default model is built for."""

    pad_token_id = VOCAB.index(PAD)
    eos_token_id = VOCAB.index(EOS)
    vocab_size = len(VOCAB)

    def encode(self, text: str) -> list[int]:
        return [VOCAB.index(c) for c in text]

    def decode(self, ids: list[int]) -> str:
        return "".join(VOCAB[i] for i in ids)


def tiny_qwen3_config(vocab_size: int = len(VOCAB)) -> Any:
    """A Qwen3-style config (q/k norms, grouped-query attention) small enough to train on a laptop CPU."""
    from transformers import Qwen3Config

    return Qwen3Config(
        vocab_size=vocab_size,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        max_position_embeddings=64,
        tie_word_embeddings=False,
        pad_token_id=CharTokenizer.pad_token_id,
        eos_token_id=CharTokenizer.eos_token_id,
    )


def tiny_qwen3_moe_config(num_experts: int = 4, vocab_size: int = len(VOCAB)) -> Any:
    """:func:`tiny_qwen3_config` with a mixture of ``num_experts`` experts (2 per token) in place of each MLP, and
    the router's load-balancing loss on."""
    from transformers import Qwen3MoeConfig

    dense = tiny_qwen3_config(vocab_size).to_dict()
    keep = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim")
    return Qwen3MoeConfig(
        **{key: dense[key] for key in keep},
        max_position_embeddings=64,
        tie_word_embeddings=False,
        pad_token_id=CharTokenizer.pad_token_id,
        eos_token_id=CharTokenizer.eos_token_id,
        moe_intermediate_size=64,
        num_experts=num_experts,
        num_experts_per_tok=2,
        output_router_logits=True,
    )


class SortDigits(Dataset):
    """``size`` examples of ``length`` digits, deterministic for a ``seed``; pass ``tokenizer`` for a real model."""

    def __init__(self, size: int, *, length: int = 6, seed: int = 0, tokenizer: Any = None):
        rng = random.Random(seed)
        self.items = ["".join(rng.choice(DIGITS) for _ in range(length)) for _ in range(size)]
        self.tokenizer = tokenizer or CharTokenizer()

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        digits = self.items[index]
        prompt = self._encode(digits + SEP)
        answer = self._encode("".join(sorted(digits)) + EOS)
        ids = torch.tensor(prompt + answer)
        labels = ids.clone()
        labels[: len(prompt)] = -100  # the loss counts the answer only
        return {"input_ids": ids, "labels": labels, "prompt_length": torch.tensor(len(prompt))}

    def _encode(self, text: str) -> list[int]:
        if isinstance(self.tokenizer, CharTokenizer):
            return self.tokenizer.encode(text)
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]
