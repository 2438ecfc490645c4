"""The layouts and models the dry run is checked on against real gloo ranks (tests/distributed/test_dry_run.py and
its worker): the same table read by both sides."""

from __future__ import annotations

from typing import Any

#: World size -> the layouts run on it: (name, ParallelLayout.resolve's sizes).
LAYOUTS: dict[int, list[tuple[str, dict[str, int]]]] = {
    2: [("tp2", {"tp_size": 2})],
    4: [("tp2_dp2", {"tp_size": 2}), ("dp4", {"tp_size": 1})],
    8: [("tp4_dp2", {"tp_size": 4})],
}
#: The models: a tiny decoder and a 12-layer one (activations grow with depth; checkpointing saves most of them).
LAYERS = {"tiny": 2, "deep": 12}
#: Each model with and without activation checkpointing.
CHECKPOINTING = (False, True)
#: The step's workload: rows per data-parallel rank, tokens per row.
BATCH, SEQ = 2, 32


def config(layers: int) -> Any:
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=SEQ,
    )


def build(layers: int) -> Any:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_config(config(layers))


def scenarios(world_size: int) -> list[tuple[str, dict[str, int], str, bool]]:
    """(name, sizes, model, activation checkpointing) of each run on ``world_size`` ranks: both models on 2 and 4
    ranks, the 2-layer one on 8 (the suite's time: 8 processes share 2 cores)."""
    models = [model for model in LAYERS if world_size < 8 or model == "tiny"]
    return [
        (f"{name}_{model}{'_ac' if checkpointing else ''}", sizes, model, checkpointing)
        for name, sizes in LAYOUTS[world_size]
        for model in models
        for checkpointing in CHECKPOINTING
    ]


def predict(world_size: int) -> dict:
    """The dry run of every scenario on ``world_size`` ranks: ``{name: {rank: {"memory": ..., "calls": [...]}}}`` for
    every rank of the 2-layer model, the first and last of the 12-layer one (their roles are the same)."""
    from dataclasses import asdict
    from functools import partial

    from lightning_tp.dryrun.engine import Workload, simulate_rank
    from lightning_tp.layout import ParallelLayout
    from lightning_tp.parallel_options import ParallelOptions

    out: dict = {}
    for name, sizes, model, checkpointing in scenarios(world_size):
        layout = ParallelLayout.resolve(world_size, **sizes)
        options = ParallelOptions(activation_checkpointing=checkpointing)
        ranks = range(world_size) if model == "tiny" else (0, world_size - 1)
        out[name] = {}
        for rank in ranks:
            run = simulate_rank(
                partial(build, LAYERS[model]),
                layout,
                rank,
                options=options,
                workload=Workload(batch_size=BATCH, seq_len=SEQ),
            )
            out[name][rank] = {"memory": asdict(run.memory), "calls": [asdict(call) for call in run.calls]}
    return out


if __name__ == "__main__":  # `python -m tests.helpers.dry_run WORLD OUT`: in a process of its own, as a user runs it
    import sys

    import torch

    torch.save(predict(int(sys.argv[1])), sys.argv[2])
