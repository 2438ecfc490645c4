"""Direct preference optimisation (DPO) with tensor parallelism: the policy and its frozen reference both sharded,
the log-probabilities computed on vocabulary-sharded logits (no rank ever holds a whole row of logits).

    python examples/dpo.py                     # tiny Qwen3-style model, 2 CPU processes (TP 2), no download
    python examples/dpo.py --devices 1         # the same run on one process, for comparison
    python examples/dpo.py --model Qwen/Qwen3-0.6B --accelerator gpu --devices 4 --precision bf16-true

The preference pairs are generated here: for a string of digits, the *chosen* answer sorts them ascending, the
*rejected* one descending (see ``sort_task.py``). DPO's loss is ``-log sigmoid(beta * ((log pi(chosen) - log
ref(chosen)) - (log pi(rejected) - log ref(rejected))))``, the log-probabilities summed over the answer's tokens with
:func:`lightning_tp.token_logprobs`. Prints the loss and the reward margin per step, and the held-out preference
accuracy (the share of pairs whose chosen answer the policy prefers more than the reference does) before and after.

GRPO uses the same pieces: per-token log-probabilities of sampled completions under the policy (inside
:func:`lightning_tp.keep_logits_sharded`), of the old policy and of the reference (under ``torch.no_grad()``), then
the clipped ratio ``exp(logp - old_logp)`` times each completion's group-normalised advantage, minus ``beta`` times
the per-token KL to the reference; :func:`lightning_tp.token_entropy` gives the entropy bonus on the same shards:
``examples/grpo.py``.
"""

from __future__ import annotations

import argparse
import copy
import random

import lightning as L
import torch
import torch.nn.functional as F
from sort_task import DIGITS, EOS, SEP, CharTokenizer, tiny_qwen3_config
from torch.utils.data import DataLoader, Dataset

import lightning_tp


class SortPreferences(Dataset):
    """``size`` prompts of ``length`` digits, each with its chosen (ascending) and rejected (descending) answer, as
    one sequence each: ``input_ids`` ``(2, length)`` and ``labels`` (-100 on the prompt)."""

    def __init__(self, size: int, *, length: int = 6, seed: int = 0, tokenizer=None):
        rng = random.Random(seed)
        self.items = ["".join(rng.choice(DIGITS) for _ in range(length)) for _ in range(size)]
        self.tokenizer = tokenizer or CharTokenizer()

    def __len__(self) -> int:
        return len(self.items)

    def _encode(self, text: str) -> list[int]:
        if isinstance(self.tokenizer, CharTokenizer):
            return self.tokenizer.encode(text)
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        digits = self.items[index]
        prompt = self._encode(digits + SEP)
        answers = ["".join(sorted(digits)) + EOS, "".join(sorted(digits, reverse=True)) + EOS]
        ids = torch.tensor([prompt + self._encode(answer) for answer in answers])
        labels = ids.clone()
        labels[:, : len(prompt)] = -100  # the answer's tokens only
        return {"input_ids": ids, "labels": labels}


def collate(items: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Chosen sequences first, then the rejected ones: ``(2 x batch, length)``."""
    return {key: torch.cat([item[key][i : i + 1] for i in (0, 1) for item in items]) for key in items[0]}


class DPO(L.LightningModule):
    def __init__(self, model: str | None, *, beta: float, lr: float):
        super().__init__()
        self.model_name, self.beta, self.lr = model, beta, lr
        self.policy: torch.nn.Module | None = None
        self.reference: torch.nn.Module | None = None
        self.accuracy: list[float] = []

    def configure_model(self) -> None:
        if self.policy is not None:
            return
        from transformers import AutoModelForCausalLM

        torch.manual_seed(0)  # identical weights on every rank: each shards its own copy
        if self.model_name is None:
            self.policy = AutoModelForCausalLM.from_config(tiny_qwen3_config())
        else:
            self.policy = lightning_tp.from_pretrained(self.model_name)
        # The reference is the policy's starting point, frozen: the strategy shards it with its own plan too.
        self.reference = copy.deepcopy(self.policy).requires_grad_(False).eval()

    def answer_logprobs(self, model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """Each sequence's summed log-probability of its answer tokens, fp32 ``(2 x batch,)``."""
        with lightning_tp.keep_logits_sharded():  # with loss_parallel=True the logits stay vocabulary-sharded
            logits = model(input_ids=batch["input_ids"]).logits
        return lightning_tp.token_logprobs(logits[:, :-1], batch["labels"][:, 1:]).sum(dim=-1)

    def margins(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """``beta x`` (the policy's log-ratio to the reference on the chosen answer minus on the rejected one)."""
        policy = self.answer_logprobs(self.policy, batch)
        with torch.no_grad():
            reference = self.answer_logprobs(self.reference, batch)
        ratio = policy - reference
        chosen, rejected = ratio.chunk(2)
        return self.beta * (chosen - rejected)

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        margin = self.margins(batch)
        loss = -F.logsigmoid(margin).mean()
        self.print(f"step {self.global_step:3d}  loss {loss.item():.6f}  margin {margin.mean().item():.6f}")
        return loss

    def validation_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> None:
        self.accuracy.append((self.margins(batch) > 0).float().mean().item())

    def on_validation_epoch_end(self) -> None:
        accuracy = sum(self.accuracy) / max(1, len(self.accuracy))
        self.print(f"step {self.global_step:3d}  held-out preference accuracy {accuracy:.3f}")
        self.accuracy.clear()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW([p for p in self.policy.parameters() if p.requires_grad], lr=self.lr)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="hub id or local path (default: a tiny model built here)")
    parser.add_argument("--accelerator", default="cpu")
    parser.add_argument("--devices", type=int, default=2, help="1: one process, no strategy (the reference)")
    parser.add_argument("--precision", default="32-true")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--beta", type=float, default=0.1)
    args = parser.parse_args()

    tokenizer = None
    if args.model is not None:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(args.model)
    train = SortPreferences(args.steps * args.batch_size, tokenizer=tokenizer)
    held_out = SortPreferences(32, seed=1, tokenizer=tokenizer)
    # TP over every device, the logits vocabulary-sharded; one device: a plain Trainer, the run to compare with.
    tp = lightning_tp.TensorParallelStrategy(loss_parallel=True, throughput_monitor=False)
    strategy = tp if args.devices > 1 else "auto"
    trainer = L.Trainer(
        accelerator=args.accelerator,
        devices=args.devices,
        strategy=strategy,
        precision=args.precision,
        max_steps=args.steps,
        val_check_interval=args.steps,
        num_sanity_val_steps=-1,  # the held-out accuracy before training
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        # Every device is a TP rank (one data-parallel replica): each reads the loader as it is, in the order the
        # one-process run reads it (Lightning's distributed sampler would shuffle the training data).
        use_distributed_sampler=False,
    )
    trainer.fit(
        DPO(args.model, beta=args.beta, lr=args.lr),
        DataLoader(train, batch_size=args.batch_size, collate_fn=collate),
        DataLoader(held_out, batch_size=16, collate_fn=collate),
    )


if __name__ == "__main__":
    main()
