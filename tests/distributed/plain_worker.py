"""``lightning_tp.parallelize`` in a plain PyTorch loop (no Trainer, no Fabric), under torchrun: each case trains a
tiny model with TP (from sizes) or FSDP2 (from a mesh) and compares every step's loss and the final weights with the
same loop run whole on this process. Prints one JSON line per case on rank 0."""

from __future__ import annotations

import copy
import gc
import json
import sys

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.utils.data import DataLoader, DistributedSampler

from tests.helpers.models import build_causal_lm, lm_batches, tiny_config
from tests.helpers.scenarios import Scenarios
from tests.helpers.tripwire import worker_setup

STEPS = 3
SCENARIOS = Scenarios("plain_worker.py")


def _train(model: torch.nn.Module, batches: list[dict], *, clip: bool, norms: list | None = None) -> list[float]:
    """SGD over ``batches``; with ``clip`` each step's gradients clipped to norm 0.5 (the norms appended to
    ``norms``), the model given whole: a pipelined model knows which ranks hold its other stages."""
    import lightning_tp

    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)  # exact: AdamW would amplify rounding in tiny gradients
    losses = []
    for batch in batches:
        loss = model(**batch).loss
        loss.backward()
        if clip:
            norm = lightning_tp.clip_grad_norm_(model, 0.5)
            if norms is not None:
                norms.append(norm.item())
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def _full(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def _gaps(model: torch.nn.Module, reference: torch.nn.Module, losses: list, ref_losses: list) -> dict:
    """The sharded run against the one-process one: the names of the weights this rank holds (``held``; a pipeline
    stage holds some) and of the reference's (``names``), the largest loss gap, and the largest gap of a held
    weight, gathered whole."""
    held = {n: _full(p.detach()) for n, p in model.named_parameters()}
    ref_weights = dict(reference.named_parameters())
    return {
        "held": set(held),
        "names": set(ref_weights),
        "loss_diff": max(abs(a - b) for a, b in zip(losses, ref_losses, strict=True)),
        "weight_diff": max((held[n] - ref_weights[n].detach()).abs().max().item() for n in held),
    }


def _compare(name: str, model: torch.nn.Module, reference: torch.nn.Module, losses: list, ref_losses: list) -> dict:
    gaps = _gaps(model, reference, losses, ref_losses)
    return {
        "case": name,
        "names_match": gaps["held"] == gaps["names"],
        "loss_diff": gaps["loss_diff"],
        "weight_diff": gaps["weight_diff"],
        "all_dtensors": all(isinstance(p, DTensor) for p in model.parameters()),
    }


@SCENARIOS.register("tp_from_sizes")
def case_tp_from_sizes() -> dict:
    """TP over both ranks, the sizes given: every rank sees the same batches."""
    import lightning_tp

    model = build_causal_lm(tiny_config("qwen3"))
    reference = copy.deepcopy(model)
    batches = lm_batches(STEPS)
    lightning_tp.parallelize(model, tp_size=2)
    return _compare(
        "tp_from_sizes", model, reference, _train(model, batches, clip=True), _train(reference, batches, clip=True)
    )


@SCENARIOS.register("cp_from_sizes")
def case_cp_from_sizes() -> dict:
    """Context parallelism over both ranks (each sequence split over them; both read the same batches): the same
    loop as one process, with clipping by the global norm."""
    import lightning_tp

    model = build_causal_lm(tiny_config("qwen3"))
    reference = copy.deepcopy(model)
    batches = lm_batches(STEPS)
    lightning_tp.parallelize(model, tp_size=1, cp_size=2)
    return _compare(
        "cp_from_sizes", model, reference, _train(model, batches, clip=True), _train(reference, batches, clip=True)
    )


@SCENARIOS.register("ep_from_sizes")
def case_ep_from_sizes() -> dict:
    """Expert parallelism over the data-parallel ranks (tp 1, ep 2: each rank holds half of Mixtral's experts and
    trains on half of each batch): the same loop as one process on the whole batch."""
    import lightning_tp

    model = build_causal_lm(tiny_config("mixtral"))
    reference = copy.deepcopy(model)
    batches = lm_batches(STEPS)
    lightning_tp.parallelize(model, tp_size=1, ep_size=2)
    rank = torch.distributed.get_rank()
    halves = [{k: v.chunk(2)[rank] for k, v in batch.items()} for batch in batches]
    losses = _train_data_parallel(model, halves, dp_group=None)
    return _compare("ep_from_sizes", model, reference, losses, _train(reference, batches, clip=False))


@SCENARIOS.register("pp_clip_from_sizes")
def case_pp_clip_from_sizes() -> dict:
    """Pipeline parallelism over both ranks (each holds two of the four layers; both read the same batches), clipped
    by ``clip_grad_norm_(model, 0.5)`` with no group: the model's parallel state names its pipeline, so the norm is
    every stage's (a rank's own stage's would clip by another factor on each rank)."""
    import lightning_tp

    model = build_causal_lm(tiny_config("llama", num_hidden_layers=4))
    reference = copy.deepcopy(model)
    batches = lm_batches(STEPS)
    lightning_tp.parallelize(model, tp_size=1, pp_size=2)
    norms: list[float] = []
    ref_norms: list[float] = []
    losses = _train(model, batches, clip=True, norms=norms)
    gaps = _gaps(model, reference, losses, _train(reference, batches, clip=True, norms=ref_norms))
    return {
        "case": "pp_clip_from_sizes",
        "names_match": bool(gaps["held"]) and gaps["held"] < gaps["names"],  # this rank's stage: some of the weights
        "loss_diff": gaps["loss_diff"],
        "weight_diff": gaps["weight_diff"],
        "norm_rel_diff": max(abs(a - b) / b for a, b in zip(norms, ref_norms, strict=True)),
        "clipped": min(ref_norms) > 0.5,
    }


@SCENARIOS.register("models_in_turn")
def case_models_in_turn() -> dict:
    """Five models parallelised differently in one process, trained a step of each in turn and clipped by
    ``clip_grad_norm_(model, 0.5)``: TP 2 with sequence and loss parallelism, CP 2, PP 2, and two mixture-of-experts
    models of one family adding their routers' load-balancing loss, one over FSDP2's 2 ranks (its loss over both
    ranks' tokens: the family's function wrapped for it) and one at TP 2 (the family's own loss: the same wrapped
    function, called by a model it was not wrapped for). Each at parity with its own one-process run, so nothing one
    model's parallelisation set up reaches another's forward, loss or norm. Every rank trains on the whole batch
    (the FSDP2 model's ranks on the same rows: their mean gradient, and the router loss over both ranks' tokens, is
    one process's)."""
    import lightning_tp

    options = {
        "tp": lightning_tp.ParallelOptions(sequence_parallel=True, loss_parallel=True),
        "cp": None,
        "pp": None,
        "moe_dp": None,
        "moe_tp": None,
    }
    sizes = {
        "tp": {"tp_size": 2},
        "cp": {"tp_size": 1, "cp_size": 2},
        "pp": {"tp_size": 1, "pp_size": 2},
        "moe_dp": {"tp_size": 1},
        "moe_tp": {"tp_size": 2},
    }
    models = {
        "tp": build_causal_lm(tiny_config("qwen3")),
        "cp": build_causal_lm(tiny_config("llama")),
        "pp": build_causal_lm(tiny_config("llama", num_hidden_layers=4)),
        "moe_dp": build_causal_lm(tiny_config("qwen3_moe", output_router_logits=True)),
        "moe_tp": build_causal_lm(tiny_config("qwen3_moe", output_router_logits=True)),
    }
    references = {name: copy.deepcopy(model) for name, model in models.items()}
    batches = lm_batches(STEPS)
    for name, model in models.items():
        lightning_tp.parallelize(model, options=options[name], **sizes[name])
    optimizers = {name: torch.optim.SGD(model.parameters(), lr=0.5) for name, model in models.items()}
    losses: dict[str, list[float]] = {name: [] for name in models}
    for batch in batches:
        for name, model in models.items():
            loss = model(**batch).loss
            loss.backward()
            lightning_tp.clip_grad_norm_(model, 0.5)
            optimizers[name].step()
            optimizers[name].zero_grad()
            losses[name].append(loss.item())
    result: dict = {"case": "models_in_turn"}
    for name, model in models.items():
        gaps = _gaps(model, references[name], losses[name], _train(references[name], batches, clip=True))
        result[name] = {
            "held": bool(gaps["held"]) and gaps["held"] <= gaps["names"],
            "loss_diff": gaps["loss_diff"],
            "weight_diff": gaps["weight_diff"],
        }
    return result


@SCENARIOS.register("fsdp_from_mesh")
def case_fsdp_from_mesh() -> dict:
    """FSDP2 over both ranks from a mesh the script built: each rank takes its half of every batch (the sampler over
    the data-parallel ranks), and the run equals one process on the whole batches."""
    import lightning_tp
    from lightning_tp import ParallelLayout

    layout = ParallelLayout.resolve(dist.get_world_size(), tp_size=1)
    mesh, dp_mesh = layout.build_device_mesh("cpu")
    model = build_causal_lm(tiny_config("llama"))
    reference = copy.deepcopy(model)
    batches = lm_batches(STEPS, batch_size=4)
    lightning_tp.parallelize(model, mesh=mesh, options=lightning_tp.ParallelOptions(activation_checkpointing=True))
    rows = [{k: v[i] for k, v in b.items()} for b in batches for i in range(len(b["input_ids"]))]
    sampler = DistributedSampler(rows, num_replicas=dp_mesh.size(), rank=dp_mesh.get_local_rank(), shuffle=False)
    local = list(DataLoader(rows, batch_size=2, sampler=sampler))
    # The sampler interleaves rows across ranks: the reference takes the same rows per step, in order.
    losses = _train_data_parallel(model, local, dp_group=dp_mesh.get_group())
    return _compare("fsdp_from_mesh", model, reference, losses, _train(reference, batches, clip=False))


@SCENARIOS.register("grad_norm_missing_gradient")
def case_grad_norm_missing_gradient() -> dict:
    """A gradient present on one rank only (an expert that saw none of the other rank's tokens, outside FSDP2): the
    norm's reductions follow the parameters, so both ranks run the same ones and get the norm with zeros there. Two
    sharded parameters on two meshes' placements, the second's gradient missing on rank 1."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    import lightning_tp

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    torch.manual_seed(0)
    whole = [torch.randn(4, 6), torch.randn(4, 6)]
    params = [
        torch.nn.Parameter(distribute_tensor(whole[0].clone(), mesh, [Shard(0)])),
        torch.nn.Parameter(distribute_tensor(whole[1].clone(), mesh, [Shard(1)])),
    ]
    grads = [torch.randn(4, 6), torch.randn(4, 6)]
    params[0].grad = distribute_tensor(grads[0], mesh, [Shard(0)])
    params[1].grad = distribute_tensor(grads[1], mesh, [Shard(1)])
    # The one-process norm: the second gradient's columns that rank 1 holds are missing, i.e. zeros.
    expected_grads = [grads[0], grads[1].clone()]
    expected_grads[1][:, 3:] = 0
    if dist.get_rank() == 1:
        params[1].grad = None
    norm = lightning_tp.clip_grad_norm_(params, max_norm=1.0)
    expected = torch.linalg.vector_norm(torch.stack([g.norm() for g in expected_grads]))
    norms = [torch.zeros(()) for _ in range(dist.get_world_size())]
    dist.all_gather(norms, norm.reshape(()).float())
    return {
        "case": "grad_norm_missing_gradient",
        "norm_diff": max(abs(n.item() - expected.item()) for n in norms),
        "expected": expected.item(),
    }


def _train_data_parallel(model: torch.nn.Module, batches: list[dict], *, dp_group) -> list[float]:
    """The global mean loss of each step (every rank's batch has the same number of counted tokens here)."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)  # exact: AdamW would amplify rounding in tiny gradients
    losses = []
    for batch in batches:
        loss = model(**batch).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        mean = loss.detach().clone()
        dist.all_reduce(mean, group=dp_group)
        losses.append(mean.item() / dist.get_world_size(dp_group))
    return losses


def main() -> None:
    timeout = worker_setup()
    dist.init_process_group("gloo", timeout=timeout)
    try:
        names = sys.argv[1:] or list(SCENARIOS)
        SCENARIOS.check(names)
        for name in names:
            result = SCENARIOS.run(name)
            if dist.get_rank() == 0:
                print(json.dumps(result), flush=True)
    finally:
        # The models' reference cycles freed first, while gloo's threads can still drop the tensors they hold (left to
        # the interpreter's exit, a launch aborts now and then: "terminate called without an active exception").
        gc.collect()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
