"""Checks of :func:`lightning_tp.stream_weights` on an initialised process group (TP 2, dp 2 x tp 2, pp 2 x dp 2 x tp
2): the streamed tensors against the model's own ``save_pretrained`` (and a LoRA model's against ``save_merged``), the
peak of live bytes while streaming, which ranks receive, the consumer's tp parts, and a rank whose loop raises.

Called from the suite's worker (``stream_weights`` scenario); returns one record per rank, checked by
tests/distributed/test_post_training.py.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from safetensors.torch import load_file
from torch.distributed.tensor import DTensor

import lightning_tp
from lightning_tp.dryrun.record import LiveBytes
from tests.helpers.cases import _lora
from tests.helpers.models import build_causal_lm, tiny_config


def _saved(directory: Path) -> dict[str, torch.Tensor]:
    tensors: dict[str, torch.Tensor] = {}
    for file in sorted(directory.glob("*.safetensors")):
        tensors.update(load_file(file))
    return tensors


def _compare(streamed: dict[str, torch.Tensor], saved: dict[str, torch.Tensor]) -> dict[str, Any]:
    differ = sorted(k for k, v in streamed.items() if k not in saved or not torch.equal(v, saved[k]))
    gaps = [((v - saved[k]).abs().max().item(), saved[k].abs().max().item()) for k, v in streamed.items() if k in saved]
    return {
        "names": sorted(streamed),
        "saved_names": sorted(saved),
        "differ": differ,
        "max_gap": max((g for g, _ in gaps), default=0.0),
        "max_value": max((m for _, m in gaps), default=0.0),
    }


def _peak(model: torch.nn.Module, chunk: int) -> dict[str, int]:
    """The peak of the bytes the stream holds above the model's own shards (live storages, counted by the dry run's
    counter), the consumer dropping each tensor before the next, and how many tensors it yielded."""
    with LiveBytes() as live:
        for tensor in model.state_dict().values():  # the shards: counted before, the stream's own bytes above them
            live.track(tensor)
        shards = live.live
        count = 0
        for _, tensor in lightning_tp.stream_weights(model, chunk_bytes=chunk):
            count += 1
            del tensor
    return {"peak": live.peak - shards, "count": count}


def _all_names(names: list[str]) -> list[str]:
    """Every rank's names (under pipeline parallelism each stage streams its own)."""
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, names)
    return sorted({name for part in gathered for name in part})


def run_stream_checks(out: Path, *, tp_size: int, pp_size: int) -> dict[str, Any]:
    rank = dist.get_rank()
    sizes = {"tp_size": tp_size, "pp_size": pp_size}
    record: dict[str, Any] = {"world": dist.get_world_size()}
    kind = "tied" if pp_size > 1 else "qwen3"  # pp: a weight tied across stages, streamed once
    torch.manual_seed(0)
    deep = {"num_hidden_layers": 4, "layer_types": ["full_attention"] * 4} if pp_size > 1 else {}
    config = tiny_config(kind, **deep)
    model = lightning_tp.parallelize(build_causal_lm(config), **sizes)
    directory = out / "stream_save"
    model.save_pretrained(directory)
    saved = _saved(directory)

    sizes_bytes = [t.numel() * t.element_size() for t in model.state_dict().values()]
    chunk = max(64, max(sizes_bytes) // 16)  # every tensor above it gathered in slices
    streamed = {name: tensor.clone() for name, tensor in lightning_tp.stream_weights(model, chunk_bytes=chunk)}
    record["plain"] = _compare(streamed, saved)
    record["plain"]["all_names"] = _all_names(sorted(streamed))
    del streamed
    record["memory"] = {**_peak(model, chunk), "largest": max(sizes_bytes), "chunk": chunk}

    state = lightning_tp.parallel_state(model)
    # Which ranks receive.
    record["targets"] = {
        targets: sum(1 for _ in lightning_tp.stream_weights(model, targets=targets))
        for targets in ("replicas", "first")
    }
    record["coords"] = {axis: state.mesh.get_local_rank(axis) for axis in state.mesh.mesh_dim_names}

    # An engine at its own tp size: its parts, put back together along the split dim, are the saved tensors; at
    # this run's own size under pure TP each rank's part is its own shard.
    if pp_size == 1:
        split = {
            k: v.placements[-1].dim
            for k, v in model.state_dict().items()
            if isinstance(v, DTensor) and v.placements[-1].is_shard()
        }
        differ = []
        for size in (2, 4) if state.layout.dp_shard_size == 1 else (2,):
            parts = [dict(lightning_tp.stream_weights(model, consumer_tp=(size, r))) for r in range(size)]
            for name, whole in saved.items():
                rebuilt = torch.cat([p[name] for p in parts], dim=split[name]) if name in split else parts[0][name]
                if not torch.equal(rebuilt, whole) or (
                    name not in split and size > 1 and not torch.equal(parts[-1][name], whole)
                ):
                    differ.append((size, name))
        record["consumer_parts_differ"] = differ
        if state.layout.dp_shard_size == 1:
            tp_rank = state.mesh.get_local_rank("tp")
            own = {k: v.to_local() if isinstance(v, DTensor) else v for k, v in model.state_dict().items()}
            parts = dict(lightning_tp.stream_weights(model, consumer_tp=(tp_size, tp_rank)))
            record["own_shards_differ"] = sorted(k for k, v in parts.items() if not torch.equal(v, own[k].detach()))
        try:
            lightning_tp.stream_weights(model, consumer_tp=(3, 0))
        except ValueError as error:
            record["consumer_error"] = str(error)

    # A rank whose loop raises, at the third tensor and at its last: the others raise at their next tensor (or at
    # the round after the last) instead of waiting for it.
    for case, at in (("failure", 2), ("failure_at_last", record["memory"]["count"] - 1)):
        try:
            for index, _ in enumerate(lightning_tp.stream_weights(model)):
                if rank == 1 and index == at:
                    raise KeyError("the consumer failed")
            record[case] = "finished"
        except KeyError:
            record[case] = "raised here"
        except RuntimeError as error:
            record[case] = str(error)

    # LoRA merged on the fly, against save_merged of the same sharded model.
    torch.manual_seed(0)
    peft_model = lightning_tp.parallelize(_lora(kind, deep or None), **sizes)
    merged_dir = out / "stream_merged"
    lightning_tp.save_merged(peft_model, merged_dir)
    merged = {name: tensor.clone() for name, tensor in lightning_tp.stream_weights(peft_model, chunk_bytes=chunk)}
    record["lora"] = _compare(merged, _saved(merged_dir))
    adapters = [t.numel() * t.element_size() for k, t in peft_model.state_dict().items() if ".lora_" in k]
    record["lora_memory"] = {**_peak(peft_model, chunk), "adapters": 2 * max(adapters)}
    record["lora"]["all_names"] = _all_names(sorted(merged))
    record["lora"]["rank"] = 4
    base = {name: t.clone() for name, t in lightning_tp.stream_weights(peft_model, merge_lora=False)}
    record["lora_base"] = _compare(base, saved)
    record["lora_base"]["differs_from_merged"] = any(not torch.equal(base[k], merged[k]) for k in base if k in merged)
    return record
