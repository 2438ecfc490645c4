"""GRPO (group relative policy optimisation) with tensor parallelism: the policy generates a group of completions per
prompt under TP (or 2-D), each is rewarded, and the policy learns from the group-normalised rewards, its frozen
reference sharded beside it. Every log-probability is taken on vocabulary-sharded logits.

    python examples/grpo.py                       # tiny Qwen3-style model, 2 CPU processes (TP 2), no download
    python examples/grpo.py --devices 1           # the same run on one process: the same completions and losses
    python examples/grpo.py --devices 4 --tp-size 2               # 2-D: dp 2 x tp 2
    python examples/grpo.py --lora                # LoRA policy; the reference is the policy with adapters disabled
    python examples/grpo.py --model Qwen/Qwen3-0.6B --reward my_rewards:score --accelerator gpu --devices 4
    python examples/grpo.py --engine 127.0.0.1:29650   # weights streamed after each step to examples/engine.py

The generated task: a prompt is a string of digits and ``>``; a completion earns the share of its characters that
are digits of the prompt (a verifiable reward, :func:`echo_reward`). Each step:

1. **Rollouts**: each prompt is repeated ``--group-size`` times and ``generate`` samples the completions (KV cache on).
   Sampling draws Gumbel noise from a generator seeded by the prompt's index, the sample and the step, the same on
   every rank of a TP group and in one process (:class:`SeededSampling`): the completions do not depend on the layout.
2. **Advantages**: each completion's reward minus its group's mean, over the group's standard deviation.
3. **Log-probabilities** of the completion tokens under the policy, the old policy (the policy before this batch's
   updates) and the reference, on the shards (:func:`lightning_tp.token_logprobs` inside
   :func:`lightning_tp.keep_logits_sharded`), and the entropy (:func:`lightning_tp.token_entropy`).
4. **Loss**: the clipped objective ``-min(ratio * A, clip(ratio, 1 - eps, 1 + eps) * A)`` plus ``beta`` times the
   per-token KL to the reference (``exp(ref - logp) - (ref - logp) - 1``) minus the entropy bonus, on completion tokens
   (through the first EOS), averaged by ``--loss-type``: ``token`` (DAPO: over every completion token of the batch),
   ``sequence`` (GRPO's paper: over each completion's tokens, then over completions) or ``dr_grpo`` (Dr. GRPO: the sum
   over tokens over completions x ``--max-new-tokens``). The averages are over the whole batch, every data-parallel
   rank's completions counted, so the loss and gradients are one process's.
5. ``--num-iterations`` optimiser steps on the same rollouts (the ratio to the old policy moves away from 1).

Prints per step: the mean reward, the loss and the gradient norm; at the end the reward of the first and last steps.
"""

from __future__ import annotations

import argparse
import copy
import importlib
import json
import os
import random
import zlib
from collections.abc import Callable
from typing import Any

import lightning as L
import torch
from sort_task import DIGITS, EOS, SEP, CharTokenizer, tiny_qwen3_config
from torch.utils.data import DataLoader, Dataset, DistributedSampler
from transformers import LogitsProcessor

import lightning_tp


def echo_reward(prompt: str, completion: str) -> float:
    """The share of the completion's characters (through its end marker) that are digits of the prompt."""
    text = completion.split(EOS, 1)[0]
    return sum(c in prompt for c in text if c in DIGITS) / max(1, len(text) + (EOS not in completion))


class Prompts(Dataset):
    """``size`` prompts of ``length`` digits and ``SEP``, each with its index (which seeds its samples)."""

    def __init__(self, size: int, *, length: int = 5, seed: int = 0, tokenizer: Any = None):
        rng = random.Random(seed)
        self.texts = ["".join(rng.choice(DIGITS) for _ in range(length)) + SEP for _ in range(size)]
        self.tokenizer = tokenizer or CharTokenizer()

    def __len__(self) -> int:
        return len(self.texts)

    def __getitem__(self, index: int) -> dict[str, Any]:
        if isinstance(self.tokenizer, CharTokenizer):
            ids = self.tokenizer.encode(self.texts[index])
        else:
            ids = self.tokenizer(self.texts[index], add_special_tokens=False)["input_ids"]
        return {"ids": ids, "index": index}


def collate(items: list[dict[str, Any]], pad_id: int = CharTokenizer.pad_token_id) -> dict[str, torch.Tensor]:
    """Prompts left-padded to one length (``generate`` continues each at the right end)."""
    width = max(len(item["ids"]) for item in items)
    ids = torch.tensor([[pad_id] * (width - len(item["ids"])) + item["ids"] for item in items])
    mask = torch.tensor([[0] * (width - len(item["ids"])) + [1] * len(item["ids"]) for item in items])
    return {"input_ids": ids, "attention_mask": mask, "index": torch.tensor([item["index"] for item in items])}


class SeededSampling(LogitsProcessor):
    """Sampling at ``temperature`` as ``argmax(scores / temperature + Gumbel noise)`` (the Gumbel-max trick: a draw
    from ``softmax(scores / temperature)``), the noise of row ``i`` at position ``t`` drawn from a generator seeded
    by ``(keys[i], t)``: a row's samples depend on its key only, not on the rank, the batch it shares or the layout.
    Use with ``do_sample=False``."""

    def __init__(self, keys: list[int], *, temperature: float, start: int):
        self.keys, self.temperature, self.start = keys, temperature, start

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        position = input_ids.shape[1] - self.start
        noise = torch.stack(
            [
                torch.rand(scores.shape[-1], generator=torch.Generator().manual_seed(key * 4099 + position))
                for key in self.keys
            ]
        ).to(scores.device)
        gumbel = -torch.log(-torch.log(noise.clamp(1e-20, 1.0 - 1e-7)))
        return scores.float() / self.temperature + gumbel


def completion_mask(completions: torch.Tensor, eos_id: int) -> torch.Tensor:
    """1 on each completion's tokens through its first EOS, 0 after (``generate`` pads finished rows)."""
    is_eos = completions == eos_id
    after = (is_eos.cumsum(dim=1) - is_eos.long()) > 0  # strictly after the first EOS
    return (~after).float()


class GRPO(L.LightningModule):
    def __init__(
        self,
        model: str | None = None,
        *,
        reward: Callable[[str, str], float] = echo_reward,
        group_size: int = 4,
        max_new_tokens: int = 6,
        temperature: float = 1.0,
        lr: float = 1e-3,
        beta: float = 0.04,
        epsilon: float = 0.2,
        entropy_coef: float = 0.0,
        num_iterations: int = 1,
        loss_type: str = "token",
        lora: bool = False,
        seed: int = 0,
        engine: str | None = None,
        tokenizer: Any = None,
    ):
        super().__init__()
        if loss_type not in ("token", "sequence", "dr_grpo"):
            raise ValueError(f"`loss_type` must be 'token', 'sequence' or 'dr_grpo', got {loss_type!r}.")
        self.automatic_optimization = False  # several optimiser steps per rollout batch
        self.model_name, self.reward, self.group_size = model, reward, group_size
        self.max_new_tokens, self.temperature, self.lr = max_new_tokens, temperature, lr
        self.beta, self.epsilon, self.entropy_coef = beta, epsilon, entropy_coef
        self.num_iterations, self.loss_type, self.lora, self.seed = num_iterations, loss_type, lora, seed
        self.engine, self.sender = engine, None
        self.tokenizer = tokenizer or CharTokenizer()
        self.policy: torch.nn.Module | None = None
        self.reference: torch.nn.Module | None = None
        self.history: list[dict[str, Any]] = []  # per step: completions, rewards, losses, gradient norms

    def configure_model(self) -> None:
        if self.policy is not None:
            return
        from transformers import AutoModelForCausalLM

        torch.manual_seed(self.seed)  # identical weights on every rank: each shards its own copy
        if self.model_name is None:
            policy = AutoModelForCausalLM.from_config(tiny_qwen3_config())
        else:
            policy = lightning_tp.from_pretrained(self.model_name)
        if self.lora:
            from peft import LoraConfig, get_peft_model

            # The reference is the base model: the policy with its adapters disabled, no second model.
            policy = get_peft_model(policy, LoraConfig(r=8, lora_alpha=16, target_modules="all-linear"))
        else:
            # The reference is the policy's starting point, frozen: the strategy shards it with its own plan too.
            self.reference = copy.deepcopy(policy).requires_grad_(False).eval()
        self.policy = policy

    # -- the pieces -----------------------------------------------------------------------------------------------

    def rollouts(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """``group_size`` completions per prompt, sampled with keys from (prompt index, sample, step)."""
        prompts = batch["input_ids"].repeat_interleave(self.group_size, dim=0)
        mask = batch["attention_mask"].repeat_interleave(self.group_size, dim=0)
        keys = [
            zlib.crc32(f"{self.seed}/{int(index)}/{sample}/{self.global_step}".encode())
            for index in batch["index"]
            for sample in range(self.group_size)
        ]
        eos, pad = self._special_ids()
        was_training = self.policy.training
        self.policy.eval()
        with torch.no_grad():
            out = self.policy.generate(
                input_ids=prompts,
                attention_mask=mask,
                max_new_tokens=self.max_new_tokens,
                do_sample=False,  # the sampling is SeededSampling's
                logits_processor=[SeededSampling(keys, temperature=self.temperature, start=prompts.shape[1])],
                eos_token_id=eos,
                pad_token_id=pad,
                use_cache=True,
            )
        self.policy.train(was_training)
        completions = out[:, prompts.shape[1] :]
        width = self.max_new_tokens  # every completion padded to one width, so every rank's batches match
        completions = torch.nn.functional.pad(completions, (0, width - completions.shape[1]), value=pad)
        return {"prompts": prompts, "prompt_mask": mask, "completions": completions}

    def _special_ids(self) -> tuple[int, int]:
        eos = self.tokenizer.eos_token_id
        pad = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else eos
        return eos, pad

    def rewards(self, batch: dict[str, torch.Tensor], completions: torch.Tensor) -> torch.Tensor:
        prompts = [
            self._decode(ids[mask.bool()])
            for ids, mask in zip(batch["input_ids"], batch["attention_mask"], strict=True)
        ]
        texts = [self._decode(ids) for ids in completions]
        scores = [self.reward(prompts[i // self.group_size], text) for i, text in enumerate(texts)]
        return torch.tensor(scores, dtype=torch.float32, device=self.device)

    def _decode(self, ids: torch.Tensor) -> str:
        return self.tokenizer.decode(ids.tolist())

    def advantages(self, rewards: torch.Tensor) -> torch.Tensor:
        """Each reward minus its group's mean, over its group's standard deviation (0 for a group all alike)."""
        groups = rewards.view(-1, self.group_size)
        mean, std = groups.mean(dim=1, keepdim=True), groups.std(dim=1, keepdim=True)
        return ((groups - mean) / (std + 1e-4)).view(-1)

    def logprobs(
        self, model: torch.nn.Module, rollout: dict[str, torch.Tensor], *, entropy: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Per-token log-probabilities of the completions (and their entropies), fp32 ``(batch, max_new_tokens)``."""
        ids = torch.cat([rollout["prompts"], rollout["completions"]], dim=1)
        mask = torch.cat([rollout["prompt_mask"], torch.ones_like(rollout["completions"])], dim=1)
        start = rollout["prompts"].shape[1]
        positions = (mask.cumsum(dim=1) - 1).clamp_min(0)  # as generate numbers left-padded rows
        with lightning_tp.keep_logits_sharded():  # with loss_parallel=True the logits stay vocabulary-sharded
            logits = model(input_ids=ids, attention_mask=mask, position_ids=positions).logits[:, start - 1 : -1]
        logp = lightning_tp.token_logprobs(logits, rollout["completions"])
        return logp, lightning_tp.token_entropy(logits) if entropy else None

    def data_parallel(self) -> tuple[int, Any]:
        """The number of data-parallel ranks and their process group (``None`` on one)."""
        state = lightning_tp.parallel_state(self.policy)
        if state is None:
            return 1, None
        size = state.layout.dp_replicate_size * state.layout.dp_shard_size
        return size, state.mesh["dp"].get_group() if size > 1 else None

    def global_sum(self, value: torch.Tensor) -> torch.Tensor:
        """``value`` summed over the data-parallel ranks (the TP ranks of a replica hold the same)."""
        size, group = self.data_parallel()
        if size > 1:
            value = value.clone()
            torch.distributed.all_reduce(value, group=group)
        return value

    def loss(self, per_token: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's share of the batch's loss (what its backward takes: the data-parallel ranks' gradients are
        averaged, so it is scaled by their number) and the whole batch's loss (for the log)."""
        if self.loss_type == "sequence":
            numerator = ((per_token * mask).sum(dim=1) / mask.sum(dim=1).clamp_min(1)).sum()
            denominator = self.global_sum(torch.tensor(float(mask.shape[0]), device=self.device))
        else:
            numerator = (per_token * mask).sum()
            count = mask.sum() if self.loss_type == "token" else torch.tensor(float(mask.numel()), device=self.device)
            denominator = self.global_sum(count.detach())
        size, _ = self.data_parallel()
        return numerator * size / denominator, self.global_sum(numerator.detach()) / denominator

    # -- the step -------------------------------------------------------------------------------------------------

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> None:
        optimizer = self.optimizers()
        rollout = self.rollouts(batch)
        eos, _ = self._special_ids()
        mask = completion_mask(rollout["completions"], eos)
        rewards = self.rewards(batch, rollout["completions"])
        advantages = self.advantages(rewards).unsqueeze(1)
        with torch.no_grad():
            old = self.logprobs(self.policy, rollout)[0] if self.num_iterations > 1 else None
            if self.reference is not None:
                reference = self.logprobs(self.reference, rollout)[0]
            else:
                with self.policy.disable_adapter():
                    reference = self.logprobs(self.policy, rollout)[0]
        losses, norms, scales = [], [], []
        for _ in range(self.num_iterations):
            logp, entropy = self.logprobs(self.policy, rollout, entropy=self.entropy_coef > 0)
            ratio = torch.exp(logp - (old if old is not None else logp.detach()))
            clipped = torch.clamp(ratio, 1 - self.epsilon, 1 + self.epsilon)
            per_token = -torch.min(ratio * advantages, clipped * advantages)
            if self.beta:
                delta = reference - logp
                per_token = per_token + self.beta * (torch.exp(delta) - delta - 1)
            if entropy is not None:
                per_token = per_token - self.entropy_coef * entropy
            loss, whole_loss = self.loss(per_token, mask)
            scale = self.loss(per_token.detach().abs(), mask)[1]  # the size of the terms the loss sums
            optimizer.zero_grad()
            self.manual_backward(loss)
            norms.append(float(lightning_tp.grad_norm(self.policy)))
            optimizer.step()
            losses.append(float(whole_loss))
            scales.append(float(scale))
        count = torch.tensor(float(rewards.numel()), device=self.device)
        mean_reward = float(self.global_sum(rewards.sum()) / self.global_sum(count))
        self.history.append(
            {
                "completions": rollout["completions"].tolist(),
                "index": batch["index"].tolist(),
                "rewards": rewards.tolist(),
                "mean_reward": mean_reward,
                "losses": losses,
                "grad_norms": norms,
                "loss_scales": scales,
            }
        )
        self.print(f"step {self.global_step:3d}  reward {mean_reward:.4f}  loss {losses[-1]:.6f}  grad {norms[-1]:.6f}")
        if self.engine is not None:
            self.push_weights()

    def push_weights(self) -> None:
        """Stream the new weights to the inference engine (examples/engine.py): gathered one tensor at a time, sent
        from the first rank (LoRA merged), loaded by the engine before it generates; then the policy's own greedy
        completions of the engine's probe prompts, for comparison."""
        from engine import PROBES

        from lightning_tp.runtime.weight_sync import WeightSender

        if self.sender is None:
            self.sender = WeightSender(self.engine, sender=self.global_rank == 0)
        sent = self.sender.send(lightning_tp.stream_weights(self.policy, targets="first", device="cpu"))
        probes = collate([{"ids": self.tokenizer.encode(text), "index": 0} for text in PROBES])
        probes = {key: value.to(self.device) for key, value in probes.items()}
        eos, pad = self._special_ids()
        was_training = self.policy.training
        self.policy.eval()
        with torch.no_grad():
            out = self.policy.generate(
                input_ids=probes["input_ids"],
                attention_mask=probes["attention_mask"],
                max_new_tokens=self.max_new_tokens,
                do_sample=False,
                eos_token_id=eos,
                pad_token_id=pad,
            )
        self.policy.train(was_training)
        texts = [self._decode(row[probes["input_ids"].shape[1] :]) for row in out]
        self.print(f"policy step {self.global_step}: {' '.join(texts)}  (sent {sent['tensors']:.0f} tensors)")

    def on_train_end(self) -> None:
        if self.sender is not None:
            self.sender.close()
        if self.history:
            span = max(1, min(10, len(self.history) // 2))
            first = sum(h["mean_reward"] for h in self.history[:span]) / span
            last = sum(h["mean_reward"] for h in self.history[-span:]) / span
            self.print(f"mean reward of the first {span} rollouts {first:.4f}, of the last {span} {last:.4f}")

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW([p for p in self.policy.parameters() if p.requires_grad], lr=self.lr)


def load_reward(spec: str) -> Callable[[str, str], float]:
    """``module:function``: a reward function ``(prompt, completion) -> float``."""
    module, _, name = spec.partition(":")
    return getattr(importlib.import_module(module), name)


def build_trainer(devices: int, *, tp_size: int | None, accelerator: str, precision: str, steps: int) -> L.Trainer:
    """TP over ``tp_size`` of the devices (all by default), data parallel over the rest; one device: a plain Trainer,
    the run to compare with."""
    strategy: Any = "auto"
    if devices > 1:
        strategy = lightning_tp.TensorParallelStrategy(tp_size=tp_size, loss_parallel=True, throughput_monitor=False)
    return L.Trainer(
        accelerator=accelerator,
        devices=devices,
        strategy=strategy,
        precision=precision,
        max_steps=steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )


def prompt_loader(prompts: Prompts, *, per_step: int, devices: int, tp_size: int | None, pad: int) -> DataLoader:
    """Each step's ``per_step`` prompts, split over the data-parallel replicas (``devices / tp_size``) by Lightning's
    sampler, which shuffles the prompts with its seed (0); one device gets the same order from the same sampler, so
    every layout sees each step's prompts."""
    replicas = max(1, devices // (tp_size or devices))
    if per_step % replicas:
        raise ValueError(f"--prompts-per-step {per_step} must divide by the {replicas} data-parallel replicas.")
    # On several devices Lightning replaces the sampler with its distributed one (shuffled, seed 0, split over the
    # replicas); on one it keeps this one, which draws the same order.
    sampler = DistributedSampler(prompts, num_replicas=1, rank=0, shuffle=True, seed=0) if devices == 1 else None
    return DataLoader(
        prompts, batch_size=per_step // replicas, sampler=sampler, collate_fn=lambda items: collate(items, pad)
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="hub id or local path (default: a tiny model built here)")
    parser.add_argument("--reward", default=None, help="module:function scoring (prompt, completion) (default: echo)")
    parser.add_argument("--accelerator", default="cpu")
    parser.add_argument("--devices", type=int, default=2, help="1: one process, no strategy (the reference)")
    parser.add_argument("--tp-size", type=int, default=None, help="default: every device")
    parser.add_argument("--precision", default="32-true")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--prompts-per-step", type=int, default=8)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=6)
    parser.add_argument("--lr", type=float, default=1e-2)
    parser.add_argument("--beta", type=float, default=0.04)
    parser.add_argument("--entropy-coef", type=float, default=0.0)
    parser.add_argument("--num-iterations", type=int, default=1)
    parser.add_argument("--loss-type", default="token", choices=("token", "sequence", "dr_grpo"))
    parser.add_argument("--lora", action="store_true")
    parser.add_argument("--engine", default=None, help="host:port of examples/engine.py: weights pushed every step")
    parser.add_argument(
        "--record", default=None, help="a directory: each rank's completions, rewards, losses per step (JSON)"
    )
    args = parser.parse_args()

    tokenizer = None
    if args.model is not None:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(args.model)
    # As many prompts as the longest run reads: the first steps of any run see the same prompts.
    prompts = Prompts(max(args.steps, 200) * args.prompts_per_step, tokenizer=tokenizer)
    pad = CharTokenizer.pad_token_id if tokenizer is None else (tokenizer.pad_token_id or tokenizer.eos_token_id)
    module = GRPO(
        args.model,
        reward=load_reward(args.reward) if args.reward else echo_reward,
        group_size=args.group_size,
        max_new_tokens=args.max_new_tokens,
        lr=args.lr,
        beta=args.beta,
        entropy_coef=args.entropy_coef,
        num_iterations=args.num_iterations,
        loss_type=args.loss_type,
        lora=args.lora,
        engine=args.engine,
        tokenizer=tokenizer,
    )
    trainer = build_trainer(
        args.devices, tp_size=args.tp_size, accelerator=args.accelerator, precision=args.precision, steps=args.steps
    )
    loader = prompt_loader(prompts, per_step=args.prompts_per_step, devices=args.devices, tp_size=args.tp_size, pad=pad)
    trainer.fit(module, loader)
    if args.record:  # each rank's own prompts (a data-parallel rank's share of each step)
        os.makedirs(args.record, exist_ok=True)
        with open(os.path.join(args.record, f"rank{trainer.global_rank}.json"), "w") as file:
            json.dump(module.history, file)


if __name__ == "__main__":
    main()
