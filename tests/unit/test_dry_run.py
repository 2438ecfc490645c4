"""The dry run (issue 47's engine, begun): the real ``parallelize`` at the real world size in one process, on a fake
process group, the model on the meta device (``device="meta"``): every check and every shard's shape as on the
GPUs, nothing allocated. The fake group is a tool here, never a parity check."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import lightning_tp
from lightning_tp.layout import ParallelLayout

CONFIGS = Path(__file__).resolve().parents[1] / "data" / "configs"


@pytest.fixture
def world_of_64():
    """Rank 0 of a fake process group of 64 ranks (collectives return at once, leaving tensors as they are)."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", rank=0, world_size=64, store=FakeStore())
    try:
        yield 64
    finally:
        dist.destroy_process_group()


def _meta_model(name: str) -> torch.nn.Module:
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText

    config = AutoConfig.from_pretrained(CONFIGS / name)
    auto = AutoModelForImageTextToText if config.get_text_config() is not config else AutoModelForCausalLM
    with torch.device("meta"):
        return auto.from_config(config, dtype=torch.bfloat16)


def _dry_run(model: torch.nn.Module, mesh) -> None:
    """``parallelize`` as a dry run, then the process-wide patches it installed given up (a mixture-of-experts
    model's router loss under data parallelism), as a strategy's teardown would."""
    from lightning_tp.strategies.shared import release_process_wide_patches

    try:
        lightning_tp.parallelize(model, mesh=mesh, device="meta")
    finally:
        release_process_wide_patches(model)


def _local_bytes(model: torch.nn.Module) -> int:
    from lightning_tp.dryrun.engine import local_bytes

    return local_bytes(model.parameters())


def test_a_70b_model_at_64_ranks_holds_a_64th_on_each_rank_and_nothing_is_allocated(world_of_64):
    model = _meta_model("llama-3.1-70b")
    whole = sum(math.prod(p.shape) * p.element_size() for p in model.parameters())
    norms = sum(math.prod(p.shape) * p.element_size() for p in model.parameters() if p.dim() == 1)
    mesh = ParallelLayout.resolve(world_of_64, tp_size=8).build_device_mesh("cpu")[0]
    _dry_run(model, mesh)
    state = lightning_tp.parallel_state(model)
    assert (state.layout.tp_size, state.layout.dp_shard_size) == (8, 8)
    # Every weight of Llama is split over tp x dp_shard but its norms, replicated over tp and sharded by FSDP2 alone.
    assert _local_bytes(model) == (whole - norms) // 64 + norms // 8
    assert all(p.is_meta for p in model.parameters()) and all(b.is_meta for b in model.buffers())


@pytest.mark.parametrize("name", ["llama-3.1-8b", "qwen3-32b", "qwen3-235b-a22b", "deepseek-v3", "gemma-3-27b"])
def test_each_real_config_dry_runs_at_64_ranks(world_of_64, name):
    model = _meta_model(name)
    whole = sum(math.prod(p.shape) * p.element_size() for p in model.parameters())
    mesh = ParallelLayout.resolve(world_of_64, tp_size=8).build_device_mesh("cpu")[0]
    _dry_run(model, mesh)
    local = _local_bytes(model)
    # At least a 64th (what is replicated over tp adds to it), far below the whole.
    assert whole / 64 <= local < whole / 32, (local, whole)


def test_the_dry_run_refuses_what_the_strategy_refuses_with_its_message(world_of_64):
    from lightning_tp.composition import BY_KEY

    model = _meta_model("gemma-3-27b")
    mesh = ParallelLayout.resolve(world_of_64, tp_size=8, cp_size=2).build_device_mesh("cpu")[0]
    rule = BY_KEY["cp+composite"]
    with pytest.raises(ValueError, match=rule.fix.removesuffix(".")):
        _dry_run(model, mesh)


# The engine, the agreement check and the command (issue 47). Each simulated rank is a world of its own: no fixture.

WORKLOAD = dict(batch_size=2, seq_len=16)


def _tiny(kind: str = "llama"):
    from tests.helpers.models import build_causal_lm, tiny_config

    return lambda: build_causal_lm(tiny_config(kind))


def test_a_simulated_rank_holds_its_share_and_records_each_collective_with_its_axis():
    from lightning_tp.dryrun.engine import Workload, local_bytes, simulate_rank

    run = simulate_rank(_tiny(), ParallelLayout.resolve(4, tp_size=2), 1, workload=Workload(**WORKLOAD))
    whole = local_bytes(_tiny()().parameters())
    # tp 2 x dp_shard 2: a quarter of every weight (FSDP2 pads a shard; the norms are split by FSDP2 alone).
    assert whole // 4 <= run.memory.parameters <= whole // 4 + 1024
    assert run.memory.gradients == run.memory.parameters
    assert run.memory.optimizer > 2 * run.memory.parameters  # AdamW: two moments and a step count per tensor
    held = run.memory.parameters + run.memory.optimizer + run.memory.activations
    assert run.memory.activations > 0 and run.memory.peak >= held
    assert run.coordinates == {"dp_replicate": 0, "dp_shard": 0, "cp": 0, "tp": 1}
    axes = {(call.kind, call.axis, call.phase) for call in run.calls}
    assert ("all_reduce", "tp", "forward") in axes  # the row-wise layers' partial sums
    assert ("all_gather", "dp_shard", "forward") in axes  # FSDP2's unshard
    assert ("reduce_scatter", "dp_shard", "backward") in axes  # FSDP2's gradients
    assert all(call.group in {(0, 1), (1, 3), (0, 1, 2, 3)} for call in run.calls), {c.group for c in run.calls}


def test_a_collective_issued_on_one_rank_only_is_named_as_the_hang_it_would_be():
    """A test hook issues an all-reduce on rank 1 alone, as a decision from a rank's own data would: the agreement
    check names ranks 0 and 1, the group and the first differing call."""
    from lightning_tp.dryrun.agreement import CollectiveMismatch, check_agreement
    from lightning_tp.dryrun.engine import Workload, simulate_rank

    def build():
        model = _tiny()()

        def on_rank_one(module, args, output):
            if dist.get_rank() == 1:
                dist.all_reduce(torch.ones(3, device=output[0].device))

        model.model.layers[1].register_forward_hook(on_rank_one)
        return model

    layout = ParallelLayout.resolve(4, tp_size=2)
    runs = [simulate_rank(build, layout, rank, workload=Workload(**WORKLOAD)) for rank in (0, 1)]
    with pytest.raises(CollectiveMismatch, match=r"Ranks 0 and 1 would hang") as found:
        check_agreement((run.rank, run.calls) for run in runs)
    message = str(found.value)
    assert "rank 1 issues all_reduce(float32[3])" in message.replace("Rank", "rank")
    # Where: the module running (a forward hook runs after the module has left: its parent, the decoder stack).
    assert "in forward at model" in message and "nothing more" in message
    assert found.value.ranks == (0, 1)
    # The same model without the hook agrees.
    runs = [simulate_rank(_tiny(), layout, rank, workload=Workload(**WORKLOAD)) for rank in (0, 1, 2)]
    assert check_agreement((run.rank, run.calls) for run in runs) >= 2


def test_the_representative_ranks_cover_every_axis_of_rank_zero():
    from lightning_tp.dryrun.agreement import representative_ranks

    # tp 8 x dp_shard 8: rank 0's tp neighbours 1 and 7 and dp_shard ones 8 and 56; the last rank's 62, 56, 55, 7.
    assert representative_ranks(ParallelLayout.resolve(64, tp_size=8)) == [0, 1, 7, 8, 55, 56, 62, 63]
    # pp 2 x dp_shard 2 x tp 2: every rank but one; each group of rank 0 and of rank 7 has two simulated members.
    assert representative_ranks(ParallelLayout.resolve(8, tp_size=2, pp_size=2)) == [0, 1, 2, 3, 4, 5, 6, 7]
    assert representative_ranks(ParallelLayout.resolve(64, tp_size=8), both_ends=False) == [0, 1, 7, 8, 56]


def test_the_plan_command_ranks_layouts_offline_from_a_local_config(tmp_path, monkeypatch, capsys):
    """``python -m lightning_tp.plan`` on a config.json alone, with the hub unreachable: ranked layouts, each with its
    memory and collectives, the best one checked for hangs."""
    import json

    from lightning_tp.tools.plan import main
    from tests.helpers.models import tiny_config

    tiny_config("llama").save_pretrained(tmp_path)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    code = main(["--model", str(tmp_path / "config.json"), "--gpus", "8", "--seq", "32", "--gpu-memory", "1GiB"])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "dp_shard 4 x tp 2" in out and "fits:" in out and "Hang check:" in out and "agree" in out
    code = main(
        ["--model", str(tmp_path), "--gpus", "8", "--seq", "32", "--tp", "4", "--pp", "1", "--json", "--no-hang-check"]
    )
    layouts = json.loads(capsys.readouterr().out)["layouts"]
    assert code == 0 and [layout["sizes"]["tp"] for layout in layouts] == [4]
    only = layouts[0]
    assert only["fits"] is True and only["memory"]["peak"] >= only["memory"]["parameters"] > 0
    assert only["collectives"]["tp"]["count"] > 0 and only["calls"]
    # A memory too small for any layout: exit code 1, every layout said not to fit (checkpointing tried too).
    code = main(["--model", str(tmp_path), "--gpus", "2", "--seq", "32", "--gpu-memory", "0.0001GiB", "--json"])
    layouts = json.loads(capsys.readouterr().out)["layouts"]
    assert code == 1 and all(layout["fits"] is False for layout in layouts)
    assert {layout["activation_checkpointing"] for layout in layouts} == {False, True}


def test_a_pipelined_layout_is_counted_but_its_step_is_not_traced_and_says_why():
    from lightning_tp.dryrun.engine import PIPELINE_NOT_TRACED, Workload, simulate_rank

    run = simulate_rank(_tiny(), ParallelLayout.resolve(4, tp_size=2, pp_size=2), 2, workload=Workload(**WORKLOAD))
    assert run.not_traced == PIPELINE_NOT_TRACED and run.memory.peak is None
    assert run.memory.parameters > 0 and run.memory.optimizer > 0


#: The layouts and options of the distributed suite's cases (tests/helpers/cases.py), each scaled to 64 ranks.
def _suite_layouts() -> list[tuple[dict, dict]]:
    from tests.helpers.cases import CASES

    sizes_keys = ("tp_size", "cp_size", "ep_size", "pp_size", "dp_replicate_size")
    option_keys = ("sequence_parallel", "loss_parallel", "activation_checkpointing", "cp_comm", "reshard_after_forward")
    seen = {}
    for case in CASES.values():
        kwargs = case.strategy_kwargs
        if "tp_plan" in kwargs:  # a plain module's own plan: not a decoder's step
            continue
        sizes = {key: kwargs[key] for key in sizes_keys if key in kwargs}
        sizes.setdefault("tp_size", 2)
        options = {key: kwargs[key] for key in option_keys if key in kwargs}
        seen[repr((sorted(sizes.items()), sorted(options.items())))] = (sizes, options)
    return list(seen.values())


@pytest.mark.slow
def test_every_layout_of_the_distributed_suite_agrees_at_64_simulated_ranks():
    """Each layout and option set the distributed suite trains, scaled to 64 ranks (the data-parallel axis takes the
    rest), on a tiny decoder (a mixture of experts under ep): the representative ranks' collectives agree."""
    from lightning_tp.dryrun.agreement import representative_ranks
    from lightning_tp.dryrun.engine import Workload
    from lightning_tp.dryrun.layouts import check_hangs
    from lightning_tp.parallel_options import ParallelOptions

    layouts = _suite_layouts()
    assert len(layouts) >= 25
    for sizes, options in layouts:
        layout = ParallelLayout.resolve(64, **sizes)
        build = _tiny("qwen3_moe" if sizes.get("ep_size", 1) > 1 else "llama")
        # Rank 0's groups (the command checks the last rank's too): the suite's time.
        ranks = representative_ranks(layout, both_ends=False)
        options_ = ParallelOptions(**options)
        compared = check_hangs(build, layout, options=options_, workload=Workload(**WORKLOAD), ranks=ranks)
        # A traced step has collectives on some group; an untraced one (pp, cp, a mixture of experts' routing) may
        # have none at setup (tp 1).
        traced = layout.pp_size == layout.cp_size == layout.ep_size == 1
        assert compared >= 1 or not traced, (sizes, options)


def test_fsdp2_alone_under_bf16_mixed_steps_on_the_newest_torch():
    """Found by the dry run: FSDP2 alone (tp_size=1) under bf16-mixed failed in its backward on torch 2.15, where the
    zero gradient given to a parameter without one must take the parameter's ``grad_dtype`` (float32 for FSDP2's
    bfloat16 copy of a float32 weight). A real gloo run failed the same way; the dry run is one process."""
    from lightning_tp.dryrun.engine import Workload, simulate_rank
    from lightning_tp.parallel_options import ParallelOptions

    run = simulate_rank(
        _tiny(),
        ParallelLayout.resolve(2, tp_size=1),
        0,
        options=ParallelOptions(precision="bf16-mixed"),
        workload=Workload(**WORKLOAD),
    )
    assert run.not_traced is None and run.memory.gradients == run.memory.parameters  # float32 gradients
