"""``lightning_tp.strategies.fabric.TensorParallelStrategy`` against one Fabric process, in two launches: 2 processes
(TP 2) and 4 processes (dp_shard 2 x tp 2). The reference runs in the same worker (see fabric_worker.py)."""

from __future__ import annotations

from functools import partial
from pathlib import Path

import pytest
import torch

from tests.helpers.launch import workers
from tests.helpers.models import ParityModule, build_causal_lm, lm_batches, reference_run, tiny_config
from tests.helpers.tolerances import assert_step_gaps, cross_entropy_scale, parity_tolerances

WORKER = Path(__file__).with_name("fabric_worker.py")

TP2_CASES = [
    "adamw_clip",
    "dataloader",
    "meta_load",
    "lora",
    "sequence_loss_parallel",
    "resume_tp_to_fsdp",
    "resume_full_file",
    "resume_pp_file_to_tp",
    "resume_file_to_pp",
    "resume_at_url",
    "resume_cp_to_tp",
    "resume_ep_to_tp",
    "pipeline",
    "bad_input",
]
TWO_D_CASES = ["adamw_clip", "dataloader", "bf16_mixed", "accumulate", "resume_2d_to_hsdp", "context_parallel_2d"]

#: fp32, a few AdamW steps: TP reorders sums (see NOTES: ~1e-5 after 3 AdamW steps).
LOSS_TOL = 2e-5


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("fabric_checkpoints")
    build_causal_lm(tiny_config("tied")).save_pretrained(path / "tied")
    return path


def _launch(out: Path, nprocs: int, checkpoints: Path, cases: list[str]) -> list[dict]:
    workers(WORKER, nprocs, str(out), str(checkpoints), *cases)
    return [torch.load(out / f"rank{rank}.pt", weights_only=False) for rank in range(nprocs)]


@pytest.fixture(scope="module")
def tp2(tmp_path_factory: pytest.TempPathFactory, checkpoints: Path) -> list[dict]:
    return _launch(tmp_path_factory.mktemp("fabric_tp2"), 2, checkpoints, TP2_CASES)


@pytest.fixture(scope="module")
def two_d(tmp_path_factory: pytest.TempPathFactory, checkpoints: Path) -> list[dict]:
    return _launch(tmp_path_factory.mktemp("fabric_2d"), 4, checkpoints, TWO_D_CASES)


def _assert_parity(result: dict, *, norms: bool = True) -> None:
    reference = result["reference"]
    assert len(result["losses"]) == len(reference["losses"]) > 0
    assert result["losses"] == pytest.approx(reference["losses"], abs=LOSS_TOL)
    if norms:
        assert len(result["norms"]) == len(reference["norms"]) > 0
        assert result["norms"] == pytest.approx(reference["norms"], rel=1e-4)


def test_tp2_setup_model_and_optimizer_clip_and_collectives(tp2: list[dict]) -> None:
    for result in (r["adamw_clip"] for r in tp2):
        _assert_parity(result)
        assert min(result["reference"]["norms"]) > 0.5  # clipping changed every step
        assert result["state_diff"] < 1e-3  # AdamW at lr 1e-2 amplifies reordered sums
        assert result["optimizer_params_are_model_params"]  # the optimizer was pointed at the sharded parameters
        assert result["sharded"] > 0
        assert result["decisions"] == [True, False, True]
        assert result["dp_size"] == 1 and result["dp_sum"] == 1.0  # TP ranks are one data-parallel replica


def test_pipeline_setup_clip_save_and_load(tp2: list[dict]) -> None:
    """pp 2 in a Fabric loop: one process's losses and clipped norms (over both stages); each rank's optimizer holds
    its stages' parameters only; a save and load on pp 2 repeats the last step exactly."""
    held = [set(r["pipeline"]["held"]) for r in tp2]
    assert held[0] and held[1] and not held[0] & held[1]
    for result in (r["pipeline"] for r in tp2):
        _assert_parity(result)
        assert result["optimizer_params_are_model_params"]
        assert result["again"]["losses"] == result["losses"][-1:]
        assert result["again"]["norms"] == result["norms"][-1:]


def test_2d_setup_model_and_optimizer_clip_collectives_and_activation_checkpointing(two_d: list[dict]) -> None:
    for result in (r["adamw_clip"] for r in two_d):
        _assert_parity(result)
        assert result["state_diff"] < 1e-3  # AdamW at lr 1e-2 amplifies reordered sums
        assert result["decisions"] == [True, False, True]
        assert result["dp_size"] == 2 and result["dp_sum"] == 2.0  # the data-parallel group, not the world's 4
        assert result["activation_checkpointing"]


@pytest.mark.parametrize("layout", ["tp2", "two_d"])
def test_dataloader_samples_over_data_parallel_ranks(layout: str, request: pytest.FixtureRequest) -> None:
    results = [r["dataloader"] for r in request.getfixturevalue(layout)]
    for result in results:
        _assert_parity(result)
    reference_batches = results[0]["reference"]["seen"]
    by_dp_rank: dict[int, list] = {}
    for result in results:  # the ranks of one TP group read the same samples
        assert by_dp_rank.setdefault(result["dp_rank"], result["seen"]) == result["seen"]
    assert len(by_dp_rank) == results[0]["dp_size"]
    for step, global_batch in enumerate(reference_batches):  # the data-parallel ranks split each global batch
        assert sorted(i for seen in by_dp_rank.values() for i in seen[step]) == sorted(global_batch)


def test_2d_bf16_mixed_has_the_numerics_of_one_process_bf16_mixed(two_d: list[dict]) -> None:
    """Losses and gradient norms of ``Fabric(precision="bf16-mixed")`` on dp 2 x tp 2 within bounds derived from
    bf16's unit roundoff and what the layout rounds differently (tests/helpers/tolerances.py). Whether it rounds as
    one process does (autocast over fp32 weights, not FSDP2's bf16 copies) shows in the trained weights: checked on the
    Trainer's 2-D run (tests/distributed/test_tp_parity.py)."""
    steps = len(two_d[0]["bf16_mixed"]["reference"]["losses"])
    module = ParityModule(partial(build_causal_lm, tiny_config("qwen3")))  # the worker's model, batches and SGD
    trained = reference_run(module, lm_batches(steps), precision="bf16-mixed")["state"]
    module.configure_model()
    scale = cross_entropy_scale(module.model, lm_batches(steps), precision="bf16-mixed", states=(trained,))
    layers = module.model.config.num_hidden_layers
    bounds = parity_tolerances(torch.bfloat16, layers, tp=2, dp=2, steps=steps, loss_scale=scale)
    for result in (r["bf16_mixed"] for r in two_d):
        reference = result["reference"]
        assert result["dtypes"] == ["torch.float32"]  # autocast over fp32 weights
        assert_step_gaps(result["norms"], reference["norms"], bounds["grad_norm_rel"], relative=True, what="norms")
        assert_step_gaps(result["losses"], reference["losses"], bounds["loss"], relative=False, what="losses")


def test_2d_gradient_accumulation_with_no_backward_sync(two_d: list[dict]) -> None:
    """Both `accumulate_grads` at parity; "sharded" reduce-scatters each of the 2 micro-batches, "unsharded" once."""
    for result in (r["accumulate"] for r in two_d):
        assert result["fsdp_units"] > 0
        for mode, micro_batches in (("sharded", 2), ("unsharded", 1)):
            _assert_parity({"reference": result["reference"], **result[mode]})
            steps = len(result[mode]["losses"])
            assert result[mode]["reduce_scatters"] == steps * micro_batches * result["fsdp_units"], (mode, result)
            assert result[mode]["reduce_scatters_after"] == result["fsdp_units"], (mode, result)


def test_meta_init_and_from_pretrained_load_sharded_and_load_raw(tp2: list[dict]) -> None:
    for result in (r["meta_load"] for r in tp2):
        assert result["built_on_meta"]
        assert result["tied"]
        _assert_parity(result, norms=False)
        assert result["load_raw_diff"] == 0.0  # `fabric.load_raw` of one process's weights


def test_lora(tp2: list[dict]) -> None:
    for result in (r["lora"] for r in tp2):
        _assert_parity(result)
        assert result["trainable_base"] == []


def test_sequence_and_loss_parallel(tp2: list[dict]) -> None:
    for result in (r["sequence_loss_parallel"] for r in tp2):
        _assert_parity(result)


@pytest.mark.parametrize(
    ("layout", "name"),
    [
        ("tp2", "resume_tp_to_fsdp"),
        ("tp2", "resume_full_file"),
        ("tp2", "resume_pp_file_to_tp"),
        ("tp2", "resume_file_to_pp"),
        ("tp2", "resume_at_url"),
        ("tp2", "resume_cp_to_tp"),
        ("tp2", "resume_ep_to_tp"),
        ("two_d", "resume_2d_to_hsdp"),
    ],
)
def test_resume_on_another_layout_and_export(layout: str, name: str, request: pytest.FixtureRequest) -> None:
    results = [r[name] for r in request.getfixturevalue(layout)]
    for rank, result in enumerate(results):
        assert result["losses"] == pytest.approx(result["reference"]["losses"], abs=LOSS_TOL)
        assert result["step"] == 2  # plain values come back into the state dict
        assert result["remainder"] == {"note": "two steps"}  # what the state did not ask for is returned
        assert result["leftovers"] == []  # published by rename: no partial directory left
        assert result["is_file"] == (name in ("resume_full_file", "resume_pp_file_to_tp", "resume_file_to_pp"))
        assert result["committed"] == (name == "resume_at_url")  # a URL's directory is committed by its marker
        if rank == 0:
            assert result["export_diff"] == 0.0  # `python -m lightning_tp.export` reads a Fabric checkpoint
            assert result["reference_diff"] < 1e-3  # AdamW at lr 1e-2 amplifies reordered sums


def test_context_parallel_with_tp_sequence_and_loss_parallelism(two_d: list[dict]) -> None:
    """cp 2 x tp 2 in Fabric: each padded sequence split over the CP ranks, the same losses and norms as one
    process."""
    for result in (r["context_parallel_2d"] for r in two_d):
        _assert_parity(result)


def test_bad_input_raises_on_every_rank(tp2: list[dict]) -> None:
    for result in (r["bad_input"] for r in tp2):
        assert "tp_plan" in result["errors"]["no_plan"]
        assert "does_not_exist" in result["errors"]["missing_checkpoint"]
