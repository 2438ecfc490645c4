"""What expert parallelism buys and costs on one mixture-of-experts model, side by side with splitting every expert
TP-wise (``moe_tp_experts``) and with FSDP2 alone, in one 2-process launch:

    torchrun --standalone --nproc-per-node 2 benchmarks/expert_parallel.py --out benchmarks/expert_parallel.json
    torchrun --standalone --nproc-per-node 4 benchmarks/expert_parallel.py --out benchmarks/expert_parallel_4.json

The layouts, on the same 2 processes and the same global batch (``--batch`` rows of ``--seq`` tokens per step):

- ``moe_tp_experts``: tp 2, every expert split over both ranks (the model's TP plan);
- ``ep2_tp2``: tp 2 with ep 2 over the TP group: each rank holds half of the experts whole, and each of the two ranks
  (which share the batch) sends half of the tokens;
- ``ep2_dp2``: tp 1, ep 2 over the data-parallel ranks (each trains half of the batch; FSDP2 shards the rest);
- ``fsdp2``: tp 1, FSDP2 alone (every rank computes every expert on its half of the batch, weights gathered).

On 4 processes: ``moe_tp_experts`` at tp 2 x dp 2, ep 2 and ep 4 with tp 2 x dp 2, ep 4 over dp 4, FSDP2 over dp 4.

Measured: the expert weights each rank holds (bytes, and the fraction of the whole) and those it computes with
(FSDP2 gathers the rest of its share for each forward and backward), the step time (forward, backward
and SGD step, median of ``--steps`` after a warm-up, the slower rank; two processes on this machine's two cores, one
thread each), and the all-to-alls per step counted by ``benchmarks/comm.py`` (bytes of each call's input, the
nccl-tests convention) against the theory: per MoE layer one exchange of the per-expert counts (``num_experts``
int64) and, of the tokens, two in the forward (dispatch, combine) and two in the backward, each carrying
``tokens x top_k x hidden`` fp32 values per rank on average (the mean over the ranks is reported; each rank's share
depends on the routing), ``tokens`` being the rank's share of its TP group's batch.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.comm import count_collectives  # noqa: E402

#: The layouts of each world size, the first the baseline of the step-time ratios.
LAYOUTS = {
    2: {
        "moe_tp_experts": {"tp_size": 2},
        "ep2_tp2": {"tp_size": 2, "ep_size": 2},
        "ep2_dp2": {"tp_size": 1, "ep_size": 2},
        "fsdp2": {"tp_size": 1},
    },
    4: {
        "moe_tp_experts_tp2_dp2": {"tp_size": 2},
        "ep2_tp2_dp2": {"tp_size": 2, "ep_size": 2},
        "ep4_tp2_dp2": {"tp_size": 2, "ep_size": 4},
        "ep4_dp4": {"tp_size": 1, "ep_size": 4},
        "fsdp2_dp4": {"tp_size": 1},
    },
}


def build(args: argparse.Namespace) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM, Qwen3MoeConfig

    config = Qwen3MoeConfig(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        num_hidden_layers=args.layers,
        num_attention_heads=8,
        num_key_value_heads=2,
        head_dim=args.hidden // 8,
        max_position_embeddings=args.seq,
        moe_intermediate_size=args.expert_width,
        num_experts=args.experts,
        num_experts_per_tok=args.top_k,
        tie_word_embeddings=False,
    )
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config)


def run(sizes: dict, args: argparse.Namespace) -> dict:
    import lightning_tp

    model = lightning_tp.parallelize(build(args), **sizes)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    dp = dist.get_world_size() // sizes["tp_size"]
    rank_in_dp = dist.get_rank() // sizes["tp_size"]
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, args.vocab, (args.batch, args.seq), generator=g).chunk(dp)[rank_in_dp]
    batch = {"input_ids": ids, "labels": ids}

    def step() -> None:
        model(**batch).loss.backward()
        optimizer.step()
        optimizer.zero_grad()

    step()  # warm-up
    counts = count_collectives(step)
    times = []
    for _ in range(args.steps):
        dist.barrier()
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    seconds = torch.tensor(statistics.median(times))
    dist.all_reduce(seconds, op=dist.ReduceOp.MAX)
    experts = [p for n, p in model.named_parameters() if ".experts." in n]
    local = sum(p.to_local().numel() for p in experts) * 4
    whole = sum(p.numel() for p in experts) * 4
    # What a rank computes with (FSDP2 gathers the rest of its share for the forward and backward): 1/tp of every
    # expert, 1/ep of the experts whole, or every expert.
    computed = whole // sizes.get("ep_size", 1) if sizes.get("ep_size", 1) > 1 else whole // sizes["tp_size"]
    all_to_all = dict(counts.get("all_to_all", {"count": 0, "bytes": 0}))
    # The mean over the ranks: a rank's share depends on where the router sent its tokens; the sum does not.
    mean = torch.tensor(float(all_to_all["bytes"]))
    dist.all_reduce(mean)
    all_to_all["bytes"] = mean.item() / dist.get_world_size()
    total = sum(v["bytes"] for v in counts.values())
    tokens = ids.numel() // (sizes["tp_size"] if sizes.get("ep_size", 1) > 1 else 1)
    theory = (
        {
            "count": 5 * args.layers,
            "bytes": args.layers * (args.experts * 8 + 4 * tokens * args.top_k * args.hidden * 4),
        }
        if sizes.get("ep_size", 1) > 1
        else {"count": 0, "bytes": 0}
    )
    return {
        "sizes": sizes,
        "expert_bytes_per_rank": local,
        "expert_fraction": local / whole,
        "expert_bytes_computed_per_rank": computed,
        "step_time_s": float(seconds),
        "all_to_all": all_to_all,
        "all_to_all_theory": theory,
        "collective_bytes": total,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--experts", type=int, default=16)
    parser.add_argument("--expert-width", type=int, default=256)
    parser.add_argument("--top-k", type=int, default=2)
    parser.add_argument("--vocab", type=int, default=2048)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=timedelta(minutes=5))
    layouts = LAYOUTS[dist.get_world_size()]
    results = {name: run(sizes, args) for name, sizes in layouts.items()}
    base = next(iter(results.values()))["step_time_s"]
    for result in results.values():
        result["step_time_vs_moe_tp_experts"] = result["step_time_s"] / base
    if dist.get_rank() == 0:
        report = {"config": vars(args) | {"out": str(args.out)}, "world_size": dist.get_world_size(), **results}
        lines = [
            f"| Layout ({dist.get_world_size()} ranks) | Expert weights per rank: held (fraction), computed with "
            f"| Step time (vs {next(iter(results))}) | all_to_all per step: calls, MiB per rank (theory) |",
            "| --- | --- | --- | --- |",
        ]
        for name, r in results.items():
            a, t = r["all_to_all"], r["all_to_all_theory"]
            lines.append(
                f"| {name} | {r['expert_bytes_per_rank'] / 2**20:.1f} MiB ({r['expert_fraction']:.2f}), "
                f"{r['expert_bytes_computed_per_rank'] / 2**20:.1f} MiB | "
                f"{r['step_time_s'] * 1e3:.0f} ms ({r['step_time_vs_moe_tp_experts']:.2f}x) | {a['count']}, "
                f"{a['bytes'] / 2**20:.2f} ({t['count']}, {t['bytes'] / 2**20:.2f}) |"
            )
        print("\n".join(lines))
        if args.out is not None:
            args.out.write_text(json.dumps(report, indent=2) + "\n")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
