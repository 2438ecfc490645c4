"""Fabric parity worker, run with torchrun: each case trains a tiny model with ``lightning_tp.strategies.fabric`` and
with one Fabric process (``SingleDeviceStrategy``, in the same worker, same seed and data), and records both.

    torchrun --nproc_per_node=N tests/distributed/fabric_worker.py OUT_DIR CHECKPOINT_DIR CASE [CASE ...]

``CHECKPOINT_DIR`` holds Transformers directories the test wrote (``tied``); each rank writes ``OUT_DIR/rank{r}.pt``:
``{case: result}``.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tests.helpers.tripwire import worker_setup  # noqa: E402

TIMEOUT = worker_setup()

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from lightning.fabric import Fabric  # noqa: E402
from lightning.fabric.strategies import SingleDeviceStrategy  # noqa: E402
from torch.distributed.fsdp import FSDPModule  # noqa: E402
from torch.utils.data import DataLoader  # noqa: E402

import lightning_tp  # noqa: E402
from lightning_tp.strategies.fabric import TensorParallelStrategy  # noqa: E402
from tests.helpers.models import build_causal_lm, lm_batches, padded_lm_batches, tiny_config  # noqa: E402
from tests.helpers.scenarios import Scenarios  # noqa: E402

WORLD_SIZE = int(os.environ["WORLD_SIZE"])
RANK = int(os.environ["RANK"])
STEPS = 3

#: name -> case function(out_dir, checkpoint_dir) -> result dict
SCENARIOS = Scenarios("fabric_worker.py")


def case(fn: Callable[[Path, Path], dict[str, Any]]) -> Callable[[Path, Path], dict[str, Any]]:
    return SCENARIOS.register(fn.__name__)(fn)


# ---------------------------------------------------------------------------------------------------------- helpers


def one_process(precision: str = "32-true") -> Fabric:
    """The reference: one Fabric process on the CPU (no process group, whatever torchrun started)."""
    fabric = Fabric(accelerator="cpu", devices=1, strategy=SingleDeviceStrategy(device="cpu"), precision=precision)
    fabric.launch()
    return fabric


_REFERENCES: dict[str, Any] = {}


def shared_reference(out: Path, key: str, compute: Callable[[], Any]) -> Any:
    """The single-process reference ``key`` (``compute()``, which trains with :func:`one_process`): computed once per
    launch, on rank 0 only, and read by the other ranks from ``out``. Every rank would otherwise train the same
    reference on the same cores; cases that share one (the same model, data and optimizer) compute it once."""
    if key not in _REFERENCES:
        path, failed = out / f"reference_{key}.pt", out / f"reference_{key}.failed"
        if RANK == 0:
            try:
                _REFERENCES[key] = compute()
            except Exception:
                failed.touch()  # the other ranks stop waiting and raise too
                raise
            staged = path.with_name(f".{path.name}.partial")
            torch.save(_REFERENCES[key], staged)
            os.replace(staged, path)  # whole, or not there
        else:
            deadline = time.monotonic() + TIMEOUT.total_seconds()
            while not path.exists():  # rank 0 trains it meanwhile
                if failed.exists():
                    raise RuntimeError(f"rank 0 failed to compute the reference {key!r} (its traceback says why)")
                if time.monotonic() > deadline:
                    raise TimeoutError(f"rank 0 did not write the reference {path} in {TIMEOUT}")
                time.sleep(0.05)
            _REFERENCES[key] = torch.load(path, weights_only=False)
    return _REFERENCES[key]


def sharded(precision: str = "32-true", **strategy_kwargs: Any) -> Fabric:
    strategy = TensorParallelStrategy(timeout=TIMEOUT, **strategy_kwargs)
    fabric = Fabric(accelerator="cpu", devices=WORLD_SIZE, strategy=strategy, precision=precision)
    fabric.launch()
    return fabric


def dp_slice(fabric: Fabric, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """This rank's part of a global batch (the whole batch on one process)."""
    strategy = fabric.strategy
    if not isinstance(strategy, TensorParallelStrategy):
        return batch
    size, rank = strategy.dp_mesh.size(), strategy.dp_mesh.get_local_rank()
    return {key: value.chunk(size)[rank] for key, value in batch.items()}


def train(
    fabric: Fabric,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    batches: list[dict[str, torch.Tensor]],
    *,
    clip: float | None = None,
) -> dict[str, list[float]]:
    """The user's loop: forward, ``fabric.backward``, ``fabric.clip_gradients``, step. Losses are the mean over the
    data-parallel ranks (``fabric.all_reduce``), so equal to one process's loss on the global batch."""
    losses, norms = [], []
    for batch in batches:
        loss = model(**dp_slice(fabric, batch)).loss
        fabric.backward(loss)
        if clip is not None:
            norms.append(fabric.clip_gradients(model, optimizer, max_norm=clip).item())
        optimizer.step()
        optimizer.zero_grad()
        losses.append(fabric.all_reduce(loss.detach(), reduce_op="mean").item())
    return {"losses": losses, "norms": norms}


def qwen3() -> torch.nn.Module:
    return build_causal_lm(tiny_config("qwen3"))


def adamw(model: torch.nn.Module) -> torch.optim.Optimizer:
    # foreach=False: under TP alone the norms stay plain tensors and foreach refuses the mix (see NOTES).
    return torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2, foreach=False)


def sgd(model: torch.nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)


def full_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The whole model's weights on every rank (gathered DTensors), for comparing with one process."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    if not any(isinstance(p, torch.distributed.tensor.DTensor) for p in model.parameters()):
        return {k: v.detach().clone() for k, v in model.state_dict().items()}
    state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=False))
    return {k: v.detach().clone() for k, v in state.items()}


def max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys(), sorted(a.keys() ^ b.keys())
    return max((a[k].float() - b[k].float()).abs().max().item() for k in a)


# ---------------------------------------------------------------------------------------------------------- cases


def _qwen3_adamw_clip(batches: list) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """The tiny Qwen3 trained by AdamW with clipping that bites on one process: its losses and norms, its weights."""
    fabric = one_process()
    model = qwen3()
    model, optimizer = fabric.setup(model, adamw(model))
    reference = train(fabric, model, optimizer, batches, clip=0.5)
    return reference, full_state(model)


@case
def adamw_clip(out: Path, checkpoints: Path) -> dict[str, Any]:
    """``fabric.setup(model, optimizer)`` with the optimizer built before sharding; AdamW; clipping that bites."""
    batches = lm_batches(STEPS)
    reference, reference_state = shared_reference(out, "qwen3_adamw_clip", lambda: _qwen3_adamw_clip(batches))

    fabric = sharded(tp_size=2, activation_checkpointing=WORLD_SIZE == 4)  # recomputed in 2-D: the same numbers
    model = qwen3()
    model, optimizer = fabric.setup(model, adamw(model))
    result = train(fabric, model, optimizer, batches, clip=0.5)
    decisions = [
        fabric.strategy.reduce_boolean_decision(True),
        fabric.strategy.reduce_boolean_decision(fabric.global_rank == 0, all=True),
        fabric.strategy.reduce_boolean_decision(fabric.global_rank == 0, all=False),
    ]
    dp_sum = fabric.all_reduce(torch.tensor(1.0), reduce_op="sum").item()
    return {
        "reference": reference,
        **result,
        "state_diff": max_diff(full_state(model), reference_state),
        "optimizer_params_are_model_params": {id(p) for g in optimizer.param_groups for p in g["params"]}
        == {id(p) for p in model.parameters()},
        "sharded": sum(isinstance(p, torch.distributed.tensor.DTensor) for p in model.parameters()),
        "decisions": decisions,
        "dp_sum": dp_sum,
        "dp_size": fabric.strategy.dp_mesh.size(),
        "activation_checkpointing": model.module.is_activation_checkpointing,
    }


def _deep_llama() -> torch.nn.Module:
    config = tiny_config("llama")
    config.num_hidden_layers = 4
    return build_causal_lm(config)


def _deep_llama_adamw_clip(batches: list) -> dict[str, Any]:
    fabric = one_process()
    model = _deep_llama()
    model, optimizer = fabric.setup(model, adamw(model))
    return train(fabric, model, optimizer, batches, clip=0.5)


@case
def pipeline(out: Path, checkpoints: Path) -> dict[str, Any]:
    """pp 2: ``fabric.setup(model, optimizer)`` with the optimizer built on the whole model (each rank keeps its
    stages' parameters), AdamW, clipping over both stages; ``fabric.save`` and ``fabric.load`` on pp 2 go on exactly
    (the last step again after loading the state saved before it)."""
    batches = lm_batches(STEPS)
    reference = shared_reference(out, "deep_llama_adamw_clip", lambda: _deep_llama_adamw_clip(batches))
    fabric = sharded(tp_size=1, pp_size=2)
    model = _deep_llama()
    model, optimizer = fabric.setup(model, adamw(model))
    result = train(fabric, model, optimizer, batches[:-1], clip=0.5)
    path = out / "pp2_fabric"
    fabric.save(path, {"model": model, "optimizer": optimizer})
    last = train(fabric, model, optimizer, batches[-1:], clip=0.5)
    fabric.load(path, {"model": model, "optimizer": optimizer})
    again = train(fabric, model, optimizer, batches[-1:], clip=0.5)
    return {
        "reference": reference,
        "losses": result["losses"] + last["losses"],
        "norms": result["norms"] + last["norms"],
        "again": again,
        "held": sorted(n for n, _ in model.named_parameters()),
        "optimizer_params_are_model_params": {id(p) for g in optimizer.param_groups for p in g["params"]}
        == {id(p) for p in model.parameters()},
    }


@case
def dataloader(out: Path, checkpoints: Path) -> dict[str, Any]:
    """``fabric.setup_dataloaders`` samples over the data-parallel ranks only: the ranks of a TP group see the same
    samples; the data-parallel ranks split the global batch; losses over the global batch equal one process's."""
    samples = [
        {"index": torch.tensor(i), **{k: v[j] for k, v in batch.items()}}
        for i, (batch, j) in enumerate((b, j) for b in lm_batches(STEPS) for j in range(4))
    ]

    def run(fabric: Fabric, batch_size: int) -> dict[str, Any]:
        model = qwen3()
        model, optimizer = fabric.setup(model, sgd(model))
        loader = fabric.setup_dataloaders(DataLoader(samples, batch_size=batch_size, shuffle=False))
        losses, norms, seen = [], [], []
        for batch in loader:
            seen.append(batch.pop("index").tolist())
            loss = model(**batch).loss
            fabric.backward(loss)
            norms.append(fabric.clip_gradients(model, optimizer, max_norm=1e6).item())  # measures, clips nothing
            optimizer.step()
            optimizer.zero_grad()
            losses.append(fabric.all_reduce(loss.detach(), reduce_op="mean").item())
        return {"losses": losses, "norms": norms, "seen": seen}

    reference = shared_reference(out, "dataloader", lambda: run(one_process(), 4))
    fabric = sharded(tp_size=2)
    dp_size = fabric.strategy.dp_mesh.size()
    result = run(fabric, 4 // dp_size)
    return {"reference": reference, **result, "dp_rank": fabric.strategy.dp_mesh.get_local_rank(), "dp_size": dp_size}


def _qwen3_sgd(batches: list, precision: str = "32-true") -> dict[str, Any]:
    """The tiny Qwen3 trained by SGD on one process (clipping measures, clips nothing)."""
    fabric = one_process(precision)
    model = qwen3()
    model, optimizer = fabric.setup(model, sgd(model))
    return train(fabric, model, optimizer, batches, clip=1e6)


@case
def bf16_mixed(out: Path, checkpoints: Path) -> dict[str, Any]:
    """``Fabric(precision="bf16-mixed")``: autocast over fp32 weights, FSDP2 gathering fp32 and reducing in fp32, as
    one process's bf16-mixed."""
    batches = lm_batches(STEPS)
    reference = shared_reference(out, "qwen3_sgd_bf16_mixed", lambda: _qwen3_sgd(batches, "bf16-mixed"))

    fabric = sharded("bf16-mixed", tp_size=2)
    model = qwen3()
    model, optimizer = fabric.setup(model, sgd(model))
    result = train(fabric, model, optimizer, batches, clip=1e6)
    dtypes = sorted({str(p.dtype) for p in model.parameters()})
    return {"reference": reference, **result, "dtypes": dtypes}


@case
def accumulate(out: Path, checkpoints: Path) -> dict[str, Any]:
    """Two micro-batches per step, the first under ``fabric.no_backward_sync``: the same as one process on the whole
    batch, with FSDP2 reduce-scattering every micro-batch (``accumulate_grads="sharded"``, the default) and once per
    step (``"unsharded"``). Counted: the reduce-scatters of each."""
    batches = lm_batches(STEPS)
    result: dict[str, Any] = {"reference": shared_reference(out, "qwen3_sgd", lambda: _qwen3_sgd(batches))}
    for accumulate_grads in ("sharded", "unsharded"):
        fabric = sharded(tp_size=2, accumulate_grads=accumulate_grads)
        model = qwen3()
        model, optimizer = fabric.setup(model, sgd(model))
        scatters = _ReduceScatters()
        try:
            losses, norms = _accumulate(fabric, model, optimizer, batches)
            in_steps = scatters.calls
            # A backward outside any `no_backward_sync` after the last `enabled=False` block still reduces
            # (Lightning's own control left the sync off there).
            fabric.backward(model(**dp_slice(fabric, batches[0])).loss)
            optimizer.zero_grad()
        finally:
            dist.reduce_scatter_single = scatters.original
        result[accumulate_grads] = {
            "losses": losses,
            "norms": norms,
            "reduce_scatters": in_steps,
            "reduce_scatters_after": scatters.calls - in_steps,
        }
    result["fsdp_units"] = sum(isinstance(m, FSDPModule) for m in model.modules())
    return result


def _accumulate(fabric: Fabric, model: Any, optimizer: Any, batches: list) -> tuple[list[float], list[float]]:
    """Each batch as two micro-batches, the first under `no_backward_sync`; the losses and pre-clip norms."""
    losses, norms = [], []
    for batch in batches:
        halves = {key: value.chunk(2) for key, value in batch.items()}
        micro = [{key: parts[index] for key, parts in halves.items()} for index in range(2)]
        total = 0.0
        for index, part in enumerate(micro):
            with fabric.no_backward_sync(model, enabled=index < len(micro) - 1):
                loss = model(**dp_slice(fabric, part)).loss
                fabric.backward(loss / len(micro))
            total += loss.detach() / len(micro)
        norms.append(fabric.clip_gradients(model, optimizer, max_norm=1e6).item())
        optimizer.step()
        optimizer.zero_grad()
        losses.append(fabric.all_reduce(total, reduce_op="mean").item())
    return losses, norms


class _ReduceScatters:
    """Counts ``dist.reduce_scatter_single`` calls (FSDP2's gradient reduce-scatters) until ``original`` is put back."""

    def __init__(self) -> None:
        self.calls = 0
        self.original = dist.reduce_scatter_single

        def counting(*args: Any, **kwargs: Any) -> Any:
            self.calls += 1
            return self.original(*args, **kwargs)

        dist.reduce_scatter_single = counting


@case
def meta_load(out: Path, checkpoints: Path) -> dict[str, Any]:
    """``fabric.init_module(empty_init=True)`` + ``lightning_tp.from_pretrained``: built on meta, loaded sharded (tied
    embeddings), against Transformers' own load on one process."""
    from transformers import AutoModelForCausalLM

    batches = lm_batches(STEPS)

    def one() -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
        fabric = one_process()
        model = AutoModelForCausalLM.from_pretrained(checkpoints / "tied", dtype=torch.float32).train()
        model, optimizer = fabric.setup(model, sgd(model))
        return train(fabric, model, optimizer, batches), full_state(model)

    reference, reference_state = shared_reference(out, "tied_loaded_sgd", one)
    raw = out / "meta_load_raw.pt"
    if RANK == 0:
        torch.save(reference_state, raw)

    fabric = sharded(tp_size=2)
    with fabric.init_module(empty_init=True):
        model = lightning_tp.from_pretrained(checkpoints / "tied", dtype=torch.float32).train()
    on_meta = all(p.is_meta for p in model.parameters())
    model, optimizer = fabric.setup(model, sgd(model))  # an optimizer over meta parameters, pointed at the shards
    result = train(fabric, model, optimizer, batches)
    inner = model.module
    tied = inner.lm_head.weight is inner.model.embed_tokens.weight
    fabric.barrier()  # rank 0 wrote `raw`
    fabric.load_raw(raw, model)  # a plain state-dict file into the shards
    return {
        "reference": reference,
        **result,
        "built_on_meta": on_meta,
        "tied": tied,
        "load_raw_diff": max_diff(full_state(model), reference_state),
    }


@case
def lora(out: Path, checkpoints: Path) -> dict[str, Any]:
    """PEFT LoRA on every linear layer (column- and row-wise), adapters sharded with their base layers."""
    from peft import LoraConfig, get_peft_model

    def build() -> torch.nn.Module:
        config = LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", init_lora_weights=False)
        return get_peft_model(qwen3(), config)

    batches = lm_batches(STEPS)

    def one() -> dict[str, Any]:
        fabric = one_process()
        model = build()
        model, optimizer = fabric.setup(model, adamw(model))
        return train(fabric, model, optimizer, batches, clip=0.5)

    reference = shared_reference(out, "qwen3_lora_adamw_clip", one)

    fabric = sharded(tp_size=2)
    model = fabric.setup_module(build())
    optimizer = fabric.setup_optimizers(adamw(model))
    result = train(fabric, model, optimizer, batches, clip=0.5)
    frozen = [n for n, p in model.named_parameters() if "lora_" not in n and p.requires_grad]
    return {"reference": reference, **result, "trainable_base": frozen}


@case
def sequence_loss_parallel(out: Path, checkpoints: Path) -> dict[str, Any]:
    """Sequence and loss parallelism: the loss of ``model(..., labels=...)`` computed on vocabulary shards."""
    batches = lm_batches(STEPS)
    reference, _ = shared_reference(out, "qwen3_adamw_clip", lambda: _qwen3_adamw_clip(batches))

    fabric = sharded(tp_size=2, sequence_parallel=True, loss_parallel=True)
    model = qwen3()
    model, optimizer = fabric.setup(model, adamw(model))
    result = train(fabric, model, optimizer, batches, clip=0.5)
    return {"reference": reference, **result}


def _resume(
    out: Path, *, first: dict[str, Any], second: dict[str, Any], url: bool = False, kind: str = "qwen3"
) -> dict[str, Any]:
    """Train 2 steps on the layout ``first``, ``fabric.save``; build a fresh model on the layout ``second``,
    ``fabric.load``, train 2 more: the losses equal 4 uninterrupted steps on one process. Then export the
    checkpoint: its weights are the saved ones, and close to the one process's after 2 steps."""
    from lightning_tp.tools.export import export_checkpoint

    batches = lm_batches(4)

    def one() -> tuple[dict[str, Any], dict[str, torch.Tensor], dict[str, Any]]:
        fabric = one_process()
        model = build_causal_lm(tiny_config(kind))
        model, optimizer = fabric.setup(model, adamw(model))
        head = train(fabric, model, optimizer, batches[:2], clip=0.5)
        return head, full_state(model), train(fabric, model, optimizer, batches[2:], clip=0.5)

    reference_head, reference_at_save, reference_tail = shared_reference(out, f"resume_{kind}", one)

    path = out / f"resume_{'_'.join(f'{k}{v}' for k, v in first.items())}{'_url' if url else ''}.ckpt"
    target = f"local://{path}" if url else path  # fsspec: committed by a marker, as on an object store
    fabric = sharded(**first)
    model = build_causal_lm(tiny_config(kind))
    model, optimizer = fabric.setup(model, adamw(model))
    head = train(fabric, model, optimizer, batches[:2], clip=0.5)
    at_save = full_state(model)  # a collective: on every rank
    if fabric.strategy.pp_group is not None:  # each rank holds its stages: every stage's weights
        stages: list[Any] = [None] * dist.get_world_size(fabric.strategy.pp_group)
        dist.all_gather_object(stages, at_save, group=fabric.strategy.pp_group)
        at_save = {key: value for part in stages for key, value in part.items()}
    fabric.save(target, {"model": model, "optimizer": optimizer, "step": 2, "note": "two steps"})
    leftovers = sorted(p.name for p in path.parent.iterdir() if p.name.startswith(f".{path.name}"))

    fabric = sharded(**second)
    torch.manual_seed(123)  # other initial weights: everything must come from the checkpoint
    model = build_causal_lm(tiny_config(kind), seed=123)
    model, optimizer = fabric.setup(model, adamw(model))
    state = {"model": model, "optimizer": optimizer, "step": 0}
    remainder = fabric.load(target, state)
    tail = train(fabric, model, optimizer, batches[2:], clip=0.5)

    export_diff = reference_diff = None
    if fabric.global_rank == 0:
        from transformers import AutoModelForCausalLM

        exported = export_checkpoint(target, out / f"{path.name}_export")
        loaded = AutoModelForCausalLM.from_pretrained(exported, dtype=torch.float32)
        export_diff = max_diff(loaded.state_dict(), at_save)
        reference_diff = max_diff(loaded.state_dict(), reference_at_save)
    fabric.barrier()
    return {
        "reference": {"losses": reference_head["losses"] + reference_tail["losses"]},
        "losses": head["losses"] + tail["losses"],
        "step": state["step"],
        "remainder": remainder,
        "leftovers": leftovers,
        "is_file": path.is_file(),
        "committed": (path / ".lightning_tp_complete").is_file(),
        "export_diff": export_diff,
        "reference_diff": reference_diff,
    }


@case
def resume_tp_to_fsdp(out: Path, checkpoints: Path) -> dict[str, Any]:
    """Saved on TP 2, resumed on FSDP2 over the same 2 ranks (tp_size=1)."""
    return _resume(out, first={"tp_size": 2}, second={"tp_size": 1})


@case
def resume_full_file(out: Path, checkpoints: Path) -> dict[str, Any]:
    """Saved as one full file by rank 0 (``save_distributed_checkpoint=False``) on TP 2, resumed on FSDP2."""
    return _resume(out, first={"tp_size": 2, "save_distributed_checkpoint": False}, second={"tp_size": 1})


@case
def resume_pp_file_to_tp(out: Path, checkpoints: Path) -> dict[str, Any]:
    """Saved as one file on pp 2 (each stage's tensors gathered on rank 0, the optimizer's state by parameter name, as
    Fabric writes it), resumed on TP 2 by Lightning's own loader."""
    single_file = {"save_distributed_checkpoint": False}
    return _resume(out, first={"tp_size": 1, "pp_size": 2, **single_file}, second={"tp_size": 2})


@case
def resume_file_to_pp(out: Path, checkpoints: Path) -> dict[str, Any]:
    """Saved as one file on TP 2, resumed on pp 2: each stage takes its own entries of the file."""
    return _resume(out, first={"tp_size": 2, "save_distributed_checkpoint": False}, second={"tp_size": 1, "pp_size": 2})


@case
def resume_at_url(out: Path, checkpoints: Path) -> dict[str, Any]:
    """Saved at a ``local://`` URL (fsspec, as an object store) on FSDP2 over 2 ranks, resumed on TP 2."""
    return _resume(out, first={"tp_size": 1}, second={"tp_size": 2}, url=True)


@case
def resume_2d_to_hsdp(out: Path, checkpoints: Path) -> dict[str, Any]:
    """Saved on dp_shard 2 x tp 2, resumed on dp_replicate 2 x tp 2 (4 ranks)."""
    return _resume(out, first={"tp_size": 2}, second={"tp_size": 2, "dp_shard_size": 1, "dp_replicate_size": 2})


@case
def resume_cp_to_tp(out: Path, checkpoints: Path) -> dict[str, Any]:
    """Context parallelism: trained and saved at cp 2 (each sequence split over the 2 ranks), resumed on TP 2."""
    return _resume(out, first={"cp_size": 2, "tp_size": 1}, second={"tp_size": 2})


@case
def resume_ep_to_tp(out: Path, checkpoints: Path) -> dict[str, Any]:
    """Expert parallelism: the tiny Qwen3-MoE trained and saved at ep 2 (whole experts per rank), resumed with its
    experts split TP-wise (ep 1), then exported."""
    return _resume(out, first={"tp_size": 2, "ep_size": 2}, second={"tp_size": 2}, kind="qwen3_moe")


@case
def context_parallel_2d(out: Path, checkpoints: Path) -> dict[str, Any]:
    """cp 2 x tp 2 with sequence and loss parallelism, padded batches of an odd length."""
    batches = padded_lm_batches(STEPS)
    reference = shared_reference(out, "qwen3_padded_adamw_clip", lambda: _qwen3_adamw_clip(batches)[0])

    fabric = sharded(tp_size=2, cp_size=2, sequence_parallel=True, loss_parallel=True)
    model = qwen3()
    model, optimizer = fabric.setup(model, adamw(model))
    return {"reference": reference, **train(fabric, model, optimizer, batches, clip=0.5)}


@case
def bad_input(out: Path, checkpoints: Path) -> dict[str, Any]:
    """Mistakes raise a ValueError on every rank, before any collective (the next case still runs)."""
    errors = {}
    fabric = sharded(tp_size=2)
    try:
        fabric.setup_module(torch.nn.Linear(4, 4))  # not a Transformers model and no tp_plan
    except ValueError as err:
        errors["no_plan"] = str(err)
    model = qwen3()
    model, optimizer = fabric.setup(model, adamw(model))
    try:
        fabric.load(fabric.broadcast(str(out / "does_not_exist")), {"model": model, "optimizer": optimizer})
    except (ValueError, FileNotFoundError) as err:
        errors["missing_checkpoint"] = f"{type(err).__name__}: {err}"
    return {"errors": errors}


def main() -> None:
    out, checkpoints, names = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3:]
    # A case that raises ends the launch (its peers may be waiting in a collective); torchrun reports its traceback.
    SCENARIOS.check(names)  # an unknown name fails on every rank before any collective
    results = {name: SCENARIOS.run(name, out, checkpoints) for name in names}
    torch.save(results, out / f"rank{RANK}.pt")


if __name__ == "__main__":
    main()
