"""A stand-in inference engine for examples/grpo.py: a Transformers model in a process of its own (an engine such as
vLLM lives in another environment), that loads the weights the trainer streams after each step and generates.

    python examples/engine.py --address 127.0.0.1:29650 &
    python examples/grpo.py --engine 127.0.0.1:29650

It serves the hand-off's address, receives each update through ``WeightReceiver.receive(load_weights)`` (the call a
vLLM worker makes with its model's ``load_weights``: see docs/post-training.md), and after each prints its greedy
completions of :data:`PROBES`, which the trainer's policy prints too: they are the same.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Iterator
from pathlib import Path

import torch
from sort_task import CharTokenizer, tiny_qwen3_config

from lightning_tp.runtime.weight_sync import WeightReceiver

#: The prompts both sides complete after each update.
PROBES = ["31415>", "27182>", "90210>"]


def load_weights_into(model: torch.nn.Module):
    """A ``load_weights`` callable: each ``(name, tensor)`` copied into the model's parameter of that name (a tied
    head takes its embedding's values through the tie)."""
    params = dict(model.named_parameters(remove_duplicate=False)) | dict(model.named_buffers())

    def load_weights(weights: Iterator[tuple[str, torch.Tensor]]) -> None:
        with torch.no_grad():
            for name, tensor in weights:
                if name not in params:
                    raise KeyError(f"The engine's model has no weight {name!r}.")
                params[name].copy_(tensor)

    return load_weights


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--address", default="127.0.0.1:29650")
    parser.add_argument("--max-new-tokens", type=int, default=6)
    parser.add_argument("--out", type=Path, default=None, help="write each update's completions here (JSON)")
    args = parser.parse_args()

    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_config(tiny_qwen3_config()).eval()  # its own weights are replaced by each update
    tokenizer = CharTokenizer()
    receiver = WeightReceiver(args.address)
    load_weights = load_weights_into(model)
    updates = []
    while (count := receiver.receive(load_weights)) is not None:
        ids = torch.tensor([tokenizer.encode(text) for text in PROBES])
        with torch.no_grad():
            out = model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=args.max_new_tokens,
                do_sample=False,
                eos_token_id=tokenizer.eos_token_id,
                pad_token_id=tokenizer.pad_token_id,
            )
        texts = [tokenizer.decode(row[ids.shape[1] :].tolist()) for row in out]
        updates.append({"tensors": count, "completions": texts})
        print(f"engine update {len(updates) - 1}: {' '.join(texts)}  (received {count} tensors)", flush=True)
    if args.out is not None:
        args.out.write_text(json.dumps(updates))


if __name__ == "__main__":
    main()
