"""Checks of loss parallelism on an initialised process group (2 ranks): ``vocab_parallel_cross_entropy`` against
``F.cross_entropy`` on the full logits, and a tiny Qwen3 with a vocabulary-sharded ``lm_head`` against the same model
unsharded.

Standalone: ``OMP_NUM_THREADS=1 python -m torch.distributed.run --standalone --nproc_per_node=2
tests/distributed/loss_parallel_checks.py``. Or call :func:`run_loss_parallel_checks` from a torchrun worker.

Each check is registered in :data:`CHECKS` under its name, raises AssertionError on a failure, and returns a record:
its name, what it measured and the bounds it held them to (the test checks the records again, and that every check
ran).
"""

from __future__ import annotations

import itertools
from functools import partial
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from lightning_tp.parallel.loss_parallel import (
    causal_lm_loss,
    install_loss_parallel,
    lm_head_style,
    vocab_parallel_cross_entropy,
)
from tests.helpers.scenarios import Scenarios
from tests.helpers.tolerances import unit_roundoff

FP32_TOL = 1e-6
#: Check name -> function(mesh) -> record.
CHECKS = Scenarios("tests/distributed/loss_parallel_checks.py")


def _loss_tol(ref: torch.Tensor) -> float:
    """1e-6, relative above 1: a sum of a few losses of ~5 is already ~70, where one fp32 step is 7.6e-6."""
    return FP32_TOL * max(1.0, ref.detach().abs().max().item())


def run_loss_parallel_checks(names: list[str] | None = None) -> list[dict[str, Any]]:
    """Run the named checks (all by default) on the default process group; return one record per check, raise
    AssertionError on a failure."""
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")
    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    names = list(CHECKS) if names is None else names
    CHECKS.check(names)
    return [{"check": name, **CHECKS.run(name, mesh)} for name in names]


def _cross_entropy_name(vocab: int, *, ignore: bool, reduction: str, dtype: torch.dtype) -> str:
    dtype_name = str(dtype).removeprefix("torch.")
    return f"cross_entropy vocab={vocab} ignore={ignore} reduction={reduction} dtype={dtype_name}"


#: Every combination, and the unreduced loss once.
CROSS_ENTROPY_CASES = [
    {"vocab": vocab, "ignore": ignore, "reduction": reduction, "dtype": dtype}
    for vocab, ignore, reduction, dtype in itertools.product(
        (16, 11), (False, True), ("mean", "sum"), (torch.float32, torch.bfloat16)
    )
] + [{"vocab": 11, "ignore": True, "reduction": "none", "dtype": torch.float32}]


def _inputs(mesh: DeviceMesh, vocab: int, *, ignore: bool, dtype: torch.dtype, seed: int = 0):
    """Full logits and labels, the same on every rank (same seed), spread over both ranks' vocabulary slices."""
    g = torch.Generator().manual_seed(seed)
    full = (3 * torch.randn(3, 5, vocab, generator=g)).to(dtype)
    labels = torch.randint(0, vocab, (3, 5), generator=g)
    labels[0, :3] = torch.tensor([0, vocab - 1, (vocab + 1) // 2])  # both ends and the first of the second slice
    if ignore:
        labels[1] = -100  # a whole sequence ignored
        labels[2, 1::2] = -100
    device = mesh.device_type
    return full.to(device), labels.to(device)


def _same_on_every_rank(t: torch.Tensor) -> bool:
    gathered = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, t.contiguous())
    return all(torch.equal(g, gathered[0]) for g in gathered)


def _check_cross_entropy(
    mesh: DeviceMesh, *, vocab: int, ignore: bool, reduction: str, dtype: torch.dtype
) -> dict[str, Any]:
    full, labels = _inputs(mesh, vocab, ignore=ignore, dtype=dtype)
    ref_in = full.clone().requires_grad_()
    # The reference upcasts like Transformers' ForCausalLMLoss does.
    ref = F.cross_entropy(ref_in.float().view(-1, vocab), labels.view(-1), reduction=reduction)
    ref = ref.view(labels.shape) if reduction == "none" else ref
    ref.sum().backward()

    sharded = distribute_tensor(full, mesh, [Shard(-1)]).requires_grad_()
    loss = vocab_parallel_cross_entropy(sharded, labels, reduction=reduction)
    loss.sum().backward()
    case = f"vocab={vocab} ignore={ignore} reduction={reduction} dtype={str(dtype).removeprefix('torch.')}"
    assert not isinstance(loss, DTensor) and loss.dtype == torch.float32, f"{case}: loss is {type(loss)} {loss.dtype}"
    assert _same_on_every_rank(loss.detach()), f"{case}: loss differs between ranks"
    assert isinstance(sharded.grad, DTensor) and sharded.grad.placements == (Shard(2),), f"{case}: grad layout"
    grad = sharded.grad.full_tensor()
    assert grad.dtype == dtype, f"{case}: grad dtype {grad.dtype}"
    loss_diff = (loss - ref).abs().max().item()
    grad_diff = (grad.float() - ref_in.grad.float()).abs().max().item()
    # bf16: both losses are computed in fp32 from the same bf16 logits; both gradients are fp32 values rounded to
    # bf16, which may land one bf16 step apart: up to eps = 2 u (2^-7) of the value, the largest gradient's at most.
    largest = ref_in.grad.float().abs().max().item()
    grad_tol = FP32_TOL if dtype == torch.float32 else 2 * unit_roundoff(dtype) * largest
    assert loss_diff <= _loss_tol(ref), f"{case}: loss differs by {loss_diff}"
    assert grad_diff <= grad_tol, f"{case}: grad differs by {grad_diff}"
    return {"loss_diff": loss_diff, "loss_tol": _loss_tol(ref), "grad_diff": grad_diff, "grad_tol": grad_tol}


for _case in CROSS_ENTROPY_CASES:
    CHECKS.add(_cross_entropy_name(**_case), partial(_check_cross_entropy, **_case))


@CHECKS.register("all_ignored")
def _check_all_ignored(mesh: DeviceMesh) -> dict[str, Any]:
    """As torch: mean over no rows is nan, and every gradient is 0."""
    full, labels = _inputs(mesh, 11, ignore=False, dtype=torch.float32)
    labels.fill_(-100)
    ref_in = full.clone().requires_grad_()
    ref = F.cross_entropy(ref_in.view(-1, 11), labels.view(-1))
    ref.backward()
    sharded = distribute_tensor(full, mesh, [Shard(-1)]).requires_grad_()
    loss = vocab_parallel_cross_entropy(sharded, labels)
    loss.backward()
    assert ref.isnan() and loss.isnan(), f"all ignored: loss {loss.item()} (torch: {ref.item()})"
    grad = sharded.grad.full_tensor()
    assert torch.equal(grad, ref_in.grad) and not grad.any(), "all ignored: gradients are not all 0"
    return {"loss_is_nan": bool(loss.isnan()), "grad_diff": 0.0, "grad_tol": 0.0}


@CHECKS.register("local_api")
def _check_local_api(mesh: DeviceMesh) -> dict[str, Any]:
    """Plain local shards with `group` and `vocab_start`, uneven vocabulary (11: 6 + 5)."""
    full, labels = _inputs(mesh, 11, ignore=True, dtype=torch.float32)
    ref_in = full.clone().requires_grad_()
    ref = F.cross_entropy(ref_in.view(-1, 11), labels.view(-1))
    ref.backward()
    rank = mesh.get_local_rank()
    start = [0, 6][rank]
    local = full[..., start : start + [6, 5][rank]].clone().requires_grad_()
    loss = vocab_parallel_cross_entropy(local, labels, group=mesh.get_group(), vocab_start=start, vocab_size=11)
    loss.backward()
    loss_diff = (loss - ref).abs().item()
    grad_diff = (local.grad - ref_in.grad[..., start : start + local.shape[-1]]).abs().max().item()
    assert loss_diff <= _loss_tol(ref) and grad_diff <= FP32_TOL, f"local api: {loss_diff} {grad_diff}"
    return {"loss_diff": loss_diff, "loss_tol": _loss_tol(ref), "grad_diff": grad_diff, "grad_tol": FP32_TOL}


@CHECKS.register("second_backward")
def _check_second_backward(mesh: DeviceMesh) -> dict[str, Any]:
    """fp32 reuses the saved softmax as the gradient, so a second backward must raise, not return garbage."""
    full, labels = _inputs(mesh, 11, ignore=True, dtype=torch.float32)
    sharded = distribute_tensor(full, mesh, [Shard(-1)]).requires_grad_()
    loss = vocab_parallel_cross_entropy(sharded, labels)
    loss.backward(retain_graph=True)
    try:
        loss.backward()
    except RuntimeError as error:
        assert "retain_graph" in str(error), error
        return {"raised": type(error).__name__}
    raise AssertionError("a second backward through an fp32 loss did not raise")


@CHECKS.register("causal_lm_loss")
def _check_causal_lm_loss(mesh: DeviceMesh) -> dict[str, Any]:
    """Against Transformers' ForCausalLMLoss: default shift, `num_items_in_batch`, and given `shift_labels`."""
    from transformers.loss.loss_utils import ForCausalLMLoss

    full, labels = _inputs(mesh, 11, ignore=True, dtype=torch.bfloat16)
    shift = labels.roll(-1, dims=1)
    diffs, tols = [], []
    for kwargs in ({}, {"num_items_in_batch": torch.tensor(7)}, {"shift_labels": shift}):
        ref_in = full.clone().requires_grad_()
        ref = ForCausalLMLoss(ref_in, labels, 11, **kwargs)
        ref.backward()
        sharded = distribute_tensor(full, mesh, [Shard(-1)]).requires_grad_()
        loss = causal_lm_loss(sharded, labels, 11, **kwargs)
        loss.backward()
        diffs.append((loss - ref).abs().item())
        tols.append(_loss_tol(ref))
        grad_diff = (sharded.grad.full_tensor().float() - ref_in.grad.float()).abs().max().item()
        assert diffs[-1] <= _loss_tol(ref), f"causal_lm_loss {list(kwargs)}: loss differs by {diffs[-1]}"
        assert grad_diff <= 2**-8 * ref_in.grad.float().abs().max().item(), f"causal_lm_loss grad: {grad_diff}"
    return {"variants": len(diffs), "loss_diff": max(diffs), "loss_tol": min(tols)}


@CHECKS.register("qwen3")
def _check_qwen3(mesh: DeviceMesh) -> dict[str, Any]:
    """A tiny Qwen3 (odd vocabulary) with only its lm_head sharded, against the same model unsharded."""
    from torch.distributed.tensor.parallel import parallelize_module

    from tests.helpers.models import build_causal_lm, tiny_config

    vocab = 97
    config = tiny_config("qwen3", vocab_size=vocab)
    device = torch.device(mesh.device_type)
    reference = build_causal_lm(config, seed=0).to(device)
    model = build_causal_lm(config, seed=0).to(device)
    parallelize_module(model, mesh, {"lm_head": lm_head_style()})
    install_loss_parallel(model)

    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, vocab, (2, 12), generator=g).to(device)
    labels = ids.clone()
    labels[:, :3] = -100
    labels[1, 7:9] = -100
    ref_out = reference(input_ids=ids, labels=labels)
    ref_out.loss.backward()
    out = model(input_ids=ids, labels=labels)
    out.loss.backward()

    assert not isinstance(out.loss, DTensor), "qwen3: the loss is a DTensor"
    # The output's logits are the lm_head's: a DTensor sharded on the vocabulary.
    assert isinstance(out.logits, DTensor) and out.logits.placements == (Shard(2),), "qwen3: logits not sharded"
    loss_diff = (out.loss - ref_out.loss).abs().item()
    logits_diff = (out.logits.full_tensor() - ref_out.logits).abs().max().item()
    grads = dict(reference.named_parameters())
    grad_diff = 0.0
    for name, param in model.named_parameters():
        grad = param.grad.full_tensor() if isinstance(param.grad, DTensor) else param.grad
        grad_diff = max(grad_diff, (grad - grads[name].grad).abs().max().item())
    head_diff = (model.lm_head.weight.grad.full_tensor() - reference.lm_head.weight.grad).abs().max().item()
    assert loss_diff <= _loss_tol(ref_out.loss), f"qwen3: loss differs by {loss_diff}"
    assert logits_diff <= FP32_TOL, f"qwen3: logits differ by {logits_diff}"
    assert grad_diff <= FP32_TOL, f"qwen3: a gradient differs by {grad_diff} (lm_head: {head_diff})"

    # Without labels (generate, predict) the logits come back gathered, as plain tensors.
    prompt = ids[:, :6]
    with torch.no_grad():
        plain = model(input_ids=prompt).logits
        generated = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=4, do_sample=False)
        expected = reference.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=4, do_sample=False)
    assert not isinstance(plain, DTensor), "qwen3: logits without labels are still a DTensor"
    assert torch.equal(generated, expected), f"qwen3: generate gives {generated.tolist()}, not {expected.tolist()}"
    return {
        "loss_diff": loss_diff,
        "loss_tol": _loss_tol(ref_out.loss),
        "grad_diff": grad_diff,
        "grad_tol": FP32_TOL,
        "logits_diff": logits_diff,
        "lm_head_grad_diff": head_diff,
        "generate_equal": True,
    }


@CHECKS.register("collectives")
def _check_collectives(mesh: DeviceMesh) -> dict[str, Any]:
    """One forward and backward: two all-reduces (row max; exp-sums with target logits), nothing else."""
    from torch.distributed.tensor.debug import CommDebugMode

    full, labels = _inputs(mesh, 11, ignore=True, dtype=torch.float32)
    sharded = distribute_tensor(full, mesh, [Shard(-1)]).requires_grad_()
    with CommDebugMode() as comm:
        vocab_parallel_cross_entropy(sharded, labels).backward()
    counts = {str(op).rpartition(".")[2]: n for op, n in comm.get_comm_counts().items()}
    assert comm.get_total_counts() == 2, f"collectives: {counts}"
    return {"total": comm.get_total_counts(), "counts": counts}


if __name__ == "__main__":
    import faulthandler
    from datetime import timedelta

    faulthandler.enable(all_threads=True)
    dist.init_process_group("gloo", timeout=timedelta(seconds=120))  # a hang fails fast, with the stacks
    try:
        for record in run_loss_parallel_checks():
            if dist.get_rank() == 0:
                print(record, flush=True)
    finally:
        dist.destroy_process_group()
