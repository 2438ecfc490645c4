"""What KV-head replication costs: the same Llama-style model at TP 2 with 2 KV heads (split as usual, one per rank)
and with 1 KV head (replicated: each rank gathers the K/V weights and computes the one KV head), side by side in one
launch, against the theory.

    torchrun --standalone --nproc-per-node 2 benchmarks/kv_heads.py --out benchmarks/kv_heads.json

Per variant: the median step time over ``--steps`` steps after ``--warmup`` (forward, backward, SGD step; the slowest
rank) in each of ``--rounds`` interleaved rounds (the best round and the median of the rounds are reported), the
collectives of one step counted by ``benchmarks/comm.py`` (kind, count, bytes per rank as nccl-tests count them), and
the parameter bytes each rank stores. The theory for replication: per layer and step, one all-gather of each of K and
V's weights (``kv_heads * head_dim * hidden`` values) in the forward and one reduce-scatter of their gradients in the
backward; nothing else changes. One thread per process (a core is a device).
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.comm import count_collectives  # noqa: E402


def build(
    kv_heads: int, *, hidden: int, layers: int, heads: int, vocab: int, max_positions: int = 4096
) -> torch.nn.Module:
    """A Llama-style model of these sizes (untied, SDPA), seeded: the benchmarks' common model."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=hidden * 11 // 4,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=hidden // heads,
        max_position_embeddings=max_positions,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")


class Run:
    """One variant: its sharded model and optimizer, timed in several rounds."""

    def __init__(self, model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> None:
        self.model, self.batch = model, batch
        self.optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
        self.medians: list[float] = []

    def step(self) -> None:
        self.model(**self.batch).loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad()

    def time_round(self, *, steps: int, warmup: int) -> None:
        for _ in range(warmup):
            self.step()
        times = []
        for _ in range(steps):
            dist.barrier()
            start = time.perf_counter()
            self.step()
            elapsed = torch.tensor(time.perf_counter() - start)
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)  # the slowest rank
            times.append(elapsed.item())
        self.medians.append(statistics.median(times))

    def report(self) -> dict:
        stored = sum(p.to_local().numel() * p.element_size() for p in self.model.parameters())
        return {
            "step_s_best_round": min(self.medians),
            "step_s_median_of_rounds": statistics.median(self.medians),
            "round_medians": self.medians,
            "collectives": count_collectives(self.step),
            "stored_bytes": stored,
        }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=timedelta(seconds=300))
    import lightning_tp

    tp_size = dist.get_world_size()
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(0, args.vocab, (args.batch, args.seq), generator=generator)
    batch = {"input_ids": ids, "labels": ids}
    head_dim = args.hidden // args.heads
    runs: dict[str, Run] = {}
    for name, kv_heads in (("split_kv2", tp_size), ("replicated_kv1", 1)):  # kv_of below
        model = build(kv_heads, hidden=args.hidden, layers=args.layers, heads=args.heads, vocab=args.vocab)
        runs[name] = Run(lightning_tp.parallelize(copy.deepcopy(model), tp_size=tp_size), batch)
    # Rounds interleaved, the order reversed each round: the machine is shared and its load comes and goes.
    for round_index in range(args.rounds):
        for run in list(runs.values())[:: 1 if round_index % 2 == 0 else -1]:
            run.time_round(steps=args.steps, warmup=args.warmup)
    kv_of = {"split_kv2": tp_size, "replicated_kv1": 1}
    results = {name: {**run.report(), "kv_heads": kv_of[name]} for name, run in runs.items()}
    split, replicated = results["split_kv2"], results["replicated_kv1"]
    kv_weight_bytes = 1 * head_dim * args.hidden * 4  # one KV head's K (or V) weight, fp32
    theory = {
        "all_gather_bytes_added": 2 * args.layers * kv_weight_bytes,
        "reduce_scatter_bytes_added": 2 * args.layers * kv_weight_bytes,
    }

    def kind_bytes(result: dict, kind: str) -> int:
        return result["collectives"].get("total", result["collectives"]).get(kind, {}).get("bytes", 0)

    summary = {
        "layout": f"TP {tp_size}, Llama hidden {args.hidden}, {args.layers} layers, {args.heads} query heads, seq "
        f"{args.seq}, batch {args.batch}, fp32, gloo, one thread per rank",
        "step_time_ratio_replicated_over_split_best_round": replicated["step_s_best_round"]
        / split["step_s_best_round"],
        "step_time_ratio_replicated_over_split_median": replicated["step_s_median_of_rounds"]
        / split["step_s_median_of_rounds"],
        "all_gather_bytes_added": kind_bytes(replicated, "all_gather") - kind_bytes(split, "all_gather"),
        "reduce_scatter_bytes_added": kind_bytes(replicated, "reduce_scatter") - kind_bytes(split, "reduce_scatter"),
        "theory": theory,
        "stored_bytes_per_rank": {name: r["stored_bytes"] for name, r in results.items()},
        # Megatron-Core/vLLM keep each needed KV head on its ranks: the rank's K and V weights whole, no gather.
        "stored_bytes_if_heads_were_kept_whole": replicated["stored_bytes"] + args.layers * kv_weight_bytes,
    }
    if dist.get_rank() == 0:
        report = {"summary": summary, "runs": results}
        text = json.dumps(report, indent=2, default=str)
        print(json.dumps(summary, indent=2))
        if args.out is not None:
            args.out.write_text(text + "\n")
    dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
