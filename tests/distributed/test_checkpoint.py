"""Checkpoints: exact resume (mid-epoch, with dropout; single-file), resume on other layouts
(1 -> TP 2, TP 2 -> 1, TP 2 -> 2-D, TP 4 with replicated KV heads -> 2-D and -> 1), a save killed midway, a
truncated checkpoint, and export round trips; the families whose mixers TP 2 splits by heads (Qwen3.5's Gated DeltaNet,
DeepSeek-V3's latent attention, Nemotron-H's Mamba2) resume on one process and export.

Four launches in all: TP 2 (most cases), a TP 2 run killed during a save, one process and 4 processes resuming from
what the killed run left. The TP 2 launch runs only the scenarios of the selected tests (their
``@pytest.mark.scenarios("ckpt_tp2", ...)``; see tests/helpers/selection.py). The reference is one process with a plain
Lightning Trainer."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from lightning_tp.checkpoint.publish import partial_path
from lightning_tp.checkpoint.validation import IncompleteCheckpointError, check_checkpoint, stored_entries
from tests.helpers.launch import workers
from tests.helpers.models import build_causal_lm, quiet_trainer, tiny_config
from tests.helpers.resume import (
    MIXER_KINDS,
    ROWS,
    STEPS,
    ResumeModule,
    SaveAt,
    fp32_loss_bounds,
    fp32_resume_counts,
    probe_logits,
)
from tests.helpers.selection import selected_scenarios
from tests.helpers.tolerances import fp32_logits_gap, fp32_roundings

WORKER = Path(__file__).with_name("checkpoint_worker.py")
#: The scenarios of the TP 2 launch (tests/distributed/checkpoint_worker.py), in the order a full run runs them.
TP2_SCENARIOS = [
    *["dropout", "full", "final", "from_single", "lora", "tied", "tied_resume", "vlm", "cp", "pp", "ep", "compiled"],
    *[f"mixers:{kind}" for kind in MIXER_KINDS],
]
#: The same layout resuming its own checkpoint: a save and a load change no value, and the resumed steps run the
#: uninterrupted run's operations on the same values in the same order, so bit for bit. Another layout sums in
#: another order: its losses and logits are within fp32's bounds (:func:`fp32_loss_bounds`, :func:`_assert_logits`).
IDENTICAL = 0.0


def _load(out: Path, phase: str, nprocs: int) -> list[dict[str, Any]]:
    results = [torch.load(out / f"{phase}_rank{rank}.pt", weights_only=False) for rank in range(nprocs)]
    for rank, result in enumerate(results):
        assert "crash" not in result, f"rank {rank}:\n{result['crash']}"
    return results


def _after(losses: dict[int, float], step: int) -> dict[int, float]:
    return {s: v for s, v in losses.items() if s > step}


def _assert_close(actual: dict[int, float], expected: dict[int, float], tol: float | dict[int, float]) -> None:
    """Each step's loss within ``tol`` (a bound per step, or one for all) of ``expected``'s."""
    assert sorted(actual) == sorted(expected), (sorted(actual), sorted(expected))
    gaps = {step: abs(actual[step] - expected[step]) for step in expected}
    bounds = tol if isinstance(tol, dict) else dict.fromkeys(expected, tol)
    assert all(gaps[step] <= bounds[step] for step in expected), (gaps, bounds)


def _assert_logits(
    got: torch.Tensor,
    expected: torch.Tensor,
    model: torch.nn.Module,
    *,
    steps: int = 0,
    rows: int = 0,
    msg: str | None = None,
) -> None:
    """Logits of another layout within fp32's bound (:func:`fp32_logits_gap`) of ``expected``: a forward of
    ``model``'s weights, after ``steps`` training steps of ``rows`` rows on the two layouts (their roundings counted
    too)."""
    forward, step = fp32_roundings([v.shape for v in model.state_dict().values()], rows)
    bound = fp32_logits_gap(forward + steps * step, expected.abs().max().item())
    torch.testing.assert_close(got, expected, atol=bound, rtol=0, msg=msg)


def _single_process_fit(ckpt_path: Path | None = None, callbacks=(), kind: str = "qwen3") -> ResumeModule:
    module = ResumeModule(stateful_data=False, kind=kind)
    trainer = quiet_trainer(accelerator="cpu", devices=1, max_steps=STEPS, callbacks=list(callbacks))
    trainer.fit(module, ckpt_path=ckpt_path)
    return module


@pytest.fixture(scope="module")
def single(tmp_path_factory: pytest.TempPathFactory, _checkpoint_env: None) -> dict[str, Any]:
    """One process, plain Trainer: a checkpoint file written at the end of epoch 0, and the losses of the run
    resumed from it: the reference for every resume at that point, on any layout.

    Not the uninterrupted run's: Lightning 2.6 resumes from an end-of-epoch checkpoint into epoch 2 (it counts the
    finished epoch twice), so the next epoch's data order is epoch 2's, with this strategy or without."""
    out = tmp_path_factory.mktemp("single")
    return _one_process_reference(out, kind="qwen3")


def _one_process_reference(out: Path, *, kind: str) -> dict[str, Any]:
    """One process of ``kind``: uninterrupted with an epoch-0 checkpoint file, and resumed from it (see
    :func:`single`); the outputs' scale at the trained weights counted for the bounds as well."""
    uninterrupted = _single_process_fit(callbacks=[SaveAt(epochs={0: out / "epoch0.ckpt"})], kind=kind)
    resumed = _single_process_fit(out / "epoch0.ckpt", kind=kind)
    fp32_resume_counts(kind, resumed.model.state_dict())
    return {"uninterrupted": uninterrupted.losses, "resumed": resumed.losses, "checkpoint": out / "epoch0.ckpt"}


@pytest.fixture(scope="module")
def single_moe(tmp_path_factory: pytest.TempPathFactory, _checkpoint_env: None) -> dict[str, Any]:
    """:func:`single` for the tiny Qwen3-MoE."""
    return _one_process_reference(tmp_path_factory.mktemp("single_moe"), kind="qwen3_moe")


@pytest.fixture(scope="module")
def single_tied(tmp_path_factory: pytest.TempPathFactory, _checkpoint_env: None) -> dict[str, Any]:
    """:func:`single` for the tiny model with tied embeddings."""
    return _one_process_reference(tmp_path_factory.mktemp("single_tied"), kind="tied")


@pytest.fixture(scope="module")
def tp2(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    out = tmp_path_factory.mktemp("ckpt_tp2")
    scenarios = selected_scenarios(request.session.items, launch="ckpt_tp2", fixture="tp2", default=TP2_SCENARIOS)
    source = []
    if {"from_single", "cp", "pp", "compiled"} & set(scenarios):  # the one-process checkpoint they resume from
        source = ["--from", str(request.getfixturevalue("single")["checkpoint"])]
    if "ep" in scenarios:
        source += ["--from-moe", str(request.getfixturevalue("single_moe")["checkpoint"])]
    _write_tiny_checkpoints(request, [s.split(":", 1)[1] for s in scenarios if s.startswith("mixers:")])
    workers(WORKER, 2, str(out), *scenarios, "--label", "tp2", *source)
    return {"out": out, "ranks": _load(out, "tp2", 2)}


def _write_tiny_checkpoints(request: pytest.FixtureRequest, kinds: list[str]) -> None:
    """The tiny checkpoints of these kinds, next to the session's (tests/distributed/conftest.py writes the others)."""
    directory = request.getfixturevalue("checkpoint")
    for kind in kinds:
        if not (directory / kind).is_dir():
            build_causal_lm(tiny_config(kind)).save_pretrained(directory / kind)


@pytest.fixture(scope="module")
def crashed(tmp_path_factory: pytest.TempPathFactory, _checkpoint_env: None) -> Path:
    """A TP 2 run that saved ``last`` at the end of epoch 0, then was killed while replacing it at step 6."""
    out = tmp_path_factory.mktemp("ckpt_crash")
    with pytest.raises(AssertionError, match="failed"):
        workers(WORKER, 2, str(out), "crash", "--label", "crash")
    return out


@pytest.fixture(scope="module")
def truncated(crashed: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    copy = tmp_path_factory.mktemp("truncated") / "last"
    shutil.copytree(crashed / "last", copy)
    shard = sorted(copy.glob("*.distcp"))[-1]
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    return copy


@pytest.mark.scenarios("ckpt_tp2", "dropout")
def test_exact_resume_mid_epoch_with_dropout(tp2: dict[str, Any]) -> None:
    for result in tp2["ranks"]:
        reference = result["dropout"]["reference"]
        assert sorted(reference) == list(range(1, STEPS + 1))
        _assert_close(result["dropout"]["mid"], _after(reference, 6), IDENTICAL)
        _assert_close(result["dropout"]["last_batch"], _after(reference, 4), IDENTICAL)  # epoch 1 whole, as it ran
        _assert_close(result["dropout"]["limited"], _after(result["dropout"]["limited_reference"], 3), IDENTICAL)


@pytest.mark.scenarios("ckpt_tp2", "full")
def test_exact_resume_from_a_single_file_checkpoint(tp2: dict[str, Any]) -> None:
    for result in tp2["ranks"]:
        _assert_close(result["full"]["mid"], _after(result["full"]["reference"], 5), IDENTICAL)


@pytest.mark.scenarios("ckpt_tp2", "from_single")
def test_one_process_checkpoint_resumes_on_tp2(tp2: dict[str, Any], single: dict[str, Any]) -> None:
    for result in tp2["ranks"]:
        _assert_close(result["from_single"], single["resumed"], fp32_loss_bounds(single["resumed"]))


@pytest.mark.scenarios("ckpt_tp2", "cp")
@pytest.mark.scenarios("ckpt_one", "from_cp2")
def test_context_parallel_checkpoints_resume_across_cp_sizes(
    tp2: dict[str, Any], single: dict[str, Any], four: list[dict[str, Any]], one_process: dict[str, Any]
) -> None:
    """cp 2 trains as one process does; its epoch-0 checkpoint resumes on TP 2 and on one process; the one-process
    checkpoint resumes on cp 2; a TP 2 checkpoint resumes on cp 2 x tp 2; each within fp32 rounding of one process
    resuming its own."""
    for result in tp2["ranks"]:
        _assert_close(result["cp_uninterrupted"], single["uninterrupted"], fp32_loss_bounds(single["uninterrupted"]))
        _assert_close(result["cp_to_tp2"], single["resumed"], fp32_loss_bounds(single["resumed"]))
        _assert_close(result["single_to_cp"], single["resumed"], fp32_loss_bounds(single["resumed"]))
    for result in four:
        _assert_close(result["cp_tp2"], single["resumed"], fp32_loss_bounds(single["resumed"]))
    _assert_close(one_process["from_cp2"]["resumed"], single["resumed"], fp32_loss_bounds(single["resumed"]))
    # Both ranks' logits of a forward without labels are the whole sequence's, and they agree.
    torch.testing.assert_close(tp2["ranks"][0]["cp_logits"], tp2["ranks"][1]["cp_logits"], atol=0, rtol=0)


@pytest.mark.scenarios("ckpt_tp2", "pp")
@pytest.mark.scenarios("ckpt_one", "from_pp2")
def test_pipeline_checkpoints_resume_across_pp_sizes(
    tp2: dict[str, Any], single: dict[str, Any], one_process: dict[str, Any]
) -> None:
    """pp 2 trains as one process does; its epoch-0 checkpoint resumes on pp 2, on TP 2 (pp 1) and on one process,
    and a TP 2 checkpoint resumes on pp 2, each as one process resuming its own: each stage loads its own keys of a
    checkpoint of any layout. The same as one file (every stage gathered on rank 0, the optimizer's state keyed by
    one process's parameter order, which TP 2 reads with Lightning's own loader), and one process's file on pp 2."""
    for result in tp2["ranks"]:
        for uninterrupted in ("pp_uninterrupted", "pp_file_uninterrupted"):
            _assert_close(result[uninterrupted], single["uninterrupted"], fp32_loss_bounds(single["uninterrupted"]))
        for resumed in ("pp_to_pp", "pp_to_tp2", "tp2_to_pp", "file_pp_to_pp", "file_pp_to_tp2", "file_single_to_pp"):
            _assert_close(result[resumed], single["resumed"], fp32_loss_bounds(single["resumed"]))
    _assert_close(one_process["from_pp2"]["resumed"], single["resumed"], fp32_loss_bounds(single["resumed"]))


@pytest.mark.scenarios("ckpt_tp2", "tied_resume")
def test_tied_embeddings_resume_exactly_and_across_pp_sizes(tp2: dict[str, Any], single_tied: dict[str, Any]) -> None:
    """One tensor under two names (the input embedding and the head): TP 2 resumes its own mid-run checkpoint bit for
    bit (the tensor's optimizer state included); pp 2, whose first and last stages each hold a copy, trains as one
    process does, and its checkpoint resumes on pp 2 and on TP 2, and TP 2's on pp 2, as one process resumes its own;
    the same as one file (the tensor's optimizer state once, under the embedding's name)."""
    bounds = fp32_loss_bounds(single_tied["resumed"], kind="tied")
    for result in tp2["ranks"]:
        _assert_close(result["tied_resume"]["mid"], _after(result["tied_resume"]["uninterrupted"], 6), IDENTICAL)
        expected = single_tied["uninterrupted"]
        _assert_close(result["tied_resume"]["pp_uninterrupted"], expected, fp32_loss_bounds(expected, kind="tied"))
        for resumed in ("pp_to_pp", "pp_to_tp2", "tp2_to_pp", "file_pp_to_pp", "file_pp_to_tp2"):
            _assert_close(result["tied_resume"][resumed], single_tied["resumed"], bounds)


@pytest.mark.scenarios("ckpt_tp2", "compiled")
def test_compiled_checkpoints_resume_uncompiled_and_back(tp2: dict[str, Any], single: dict[str, Any]) -> None:
    """`compile=True` (each decoder layer compiled in place, Lightning #21357 broke this for compiled TP models):
    trains as one process does, its checkpoint holds the model's own names (no `_orig_mod`) and resumes uncompiled,
    and a one-process checkpoint resumes compiled, each within fp32 rounding of one process resuming its own."""
    for result in tp2["ranks"]:
        _assert_close(
            result["compiled_uninterrupted"], single["uninterrupted"], fp32_loss_bounds(single["uninterrupted"])
        )
        _assert_close(result["compiled_to_plain"], single["resumed"], fp32_loss_bounds(single["resumed"]))
        _assert_close(result["single_to_compiled"], single["resumed"], fp32_loss_bounds(single["resumed"]))
        names = result["compiled_names"]
        assert "state_dict.model.model.layers.0.self_attn.q_proj.weight" in names, names[:5]
        assert not [n for n in names if "_orig_mod" in n], names


@pytest.mark.scenarios("ckpt_tp2", "ep")
@pytest.mark.scenarios("ckpt_one", "from_ep2")
def test_expert_parallel_checkpoints_resume_across_ep_sizes(
    tp2: dict[str, Any], single_moe: dict[str, Any], one_process: dict[str, Any]
) -> None:
    """ep 2 trains the tiny Qwen3-MoE as one process does; its epoch-0 checkpoint resumes on ep 2 and on one process;
    the one-process checkpoint resumes on ep 2 over the TP group and over the data-parallel ranks (where each rank's
    loss is its half of the batch: their mean is the global one)."""
    for result in tp2["ranks"]:
        _assert_close(
            result["ep_uninterrupted"],
            single_moe["uninterrupted"],
            fp32_loss_bounds(single_moe["uninterrupted"], "qwen3_moe"),
        )
        _assert_close(result["ep_to_ep"], single_moe["resumed"], fp32_loss_bounds(single_moe["resumed"], "qwen3_moe"))
        _assert_close(
            result["single_to_ep"], single_moe["resumed"], fp32_loss_bounds(single_moe["resumed"], "qwen3_moe")
        )
    halves = [r["single_to_ep_dp"] for r in tp2["ranks"]]
    _assert_close(
        {step: (halves[0][step] + halves[1][step]) / 2 for step in halves[0]},
        single_moe["resumed"],
        fp32_loss_bounds(single_moe["resumed"], "qwen3_moe"),
    )
    _assert_close(
        one_process["from_ep2"]["resumed"], single_moe["resumed"], fp32_loss_bounds(single_moe["resumed"], "qwen3_moe")
    )


@pytest.mark.scenarios("ckpt_tp2", "ep")
def test_tp_split_experts_resume_from_any_checkpoint(tp2: dict[str, Any], single_moe: dict[str, Any]) -> None:
    """The experts split TP-wise (`moe_tp_experts`: the packed gate/up weight and its AdamW states are `_StridedShard`s,
    which DCP and torch's full-state loader misplace; see lightning_tp/checkpoint/dcp_layouts.py) resume from an ep 2
    checkpoint, from their own sharded checkpoint and from a one-process checkpoint file, within fp32 rounding of one
    process. All three were off by ~3e-3 in the first resumed loss before (and a sharded save of such a weight
    failed in DCP's own planner)."""
    for result in tp2["ranks"]:
        _assert_close(result["ep_to_tp2"], single_moe["resumed"], fp32_loss_bounds(single_moe["resumed"], "qwen3_moe"))
        _assert_close(result["tp2_moe"], single_moe["resumed"], fp32_loss_bounds(single_moe["resumed"], "qwen3_moe"))
        _assert_close(
            result["single_to_tp2_moe"], single_moe["resumed"], fp32_loss_bounds(single_moe["resumed"], "qwen3_moe")
        )


@pytest.mark.scenarios("ckpt_tp2", "lora")
def test_lora_resume_without_frozen_weights(tp2: dict[str, Any]) -> None:
    stored = stored_entries(tp2["out"] / "lora_mid")
    # The model entries are exactly the adapters (the trainable parameters), no frozen weight.
    module = ResumeModule(lora=True)
    module.configure_model()
    trainable = {f"state_dict.{name}" for name, p in module.named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in key for key in trainable)
    assert {k for k in stored if k.startswith("state_dict.")} == trainable
    for result in tp2["ranks"]:
        _assert_close(result["lora"]["mid"], _after(result["lora"]["reference"], 6), IDENTICAL)


@pytest.mark.scenarios("ckpt_tp2", "dropout", "full")
def test_exact_resume_from_urls_on_disk(tp2: dict[str, Any]) -> None:
    """Through fsspec and the commit marker on 2 processes; the second save at the URL replaced the first."""
    from lightning_tp.checkpoint.remote import COMMIT_MARKER

    for result in tp2["ranks"]:
        _assert_close(result["url"], _after(result["dropout"]["reference"], 6), IDENTICAL)
        _assert_close(result["full"]["url"], _after(result["full"]["reference"], 5), IDENTICAL)
    directory = tp2["out"] / "url_mid"
    (data,) = [p for p in directory.iterdir() if p.name != COMMIT_MARKER]
    assert sorted(p.name for p in directory.iterdir()) == sorted([COMMIT_MARKER, data.name])
    assert torch.load(data / "meta.pt", weights_only=True)["global_step"] == 6
    assert (tp2["out"] / "url_full.ckpt").is_file()


def test_killed_save_leaves_the_previous_checkpoint(crashed: Path) -> None:
    check_checkpoint(crashed / "last")  # whole
    assert partial_path(crashed / "last").is_dir()  # the unfinished save, under its hidden name
    assert torch.load(crashed / "last" / "meta.pt", weights_only=True)["global_step"] == 4


@pytest.mark.scenarios("ckpt_one", "from_tp2")
def test_tp2_checkpoint_resumes_on_one_process(one_process: dict[str, Any], single: dict[str, Any]) -> None:
    _assert_close(one_process["from_tp2"]["resumed"], single["resumed"], fp32_loss_bounds(single["resumed"]))


@pytest.fixture(scope="module")
def four(crashed: Path, truncated: Path) -> list[dict[str, Any]]:
    """One 4-process launch: the killed run's checkpoint resumed on 2-D (and its truncated copy), then a TP 4 run
    with replicated KV heads (its checkpoint resumed on 2-D)."""
    workers(
        WORKER,
        4,
        str(crashed),
        "2d",
        "tp4",
        "cp_2d",
        "pp_2d_file",
        "--label",
        "2d",
        "--from",
        str(crashed / "last"),
        "--truncated",
        str(truncated),
    )
    return _load(crashed, "2d", 4)


#: Checkpoints of other layouts resumed on one process, by label: the worker's scenario and where the checkpoint is.
ONE_PROCESS = {
    "from_tp2": "one",  # the killed TP 2 run's last whole checkpoint
    "from_cp2": "one",
    "from_pp2": "one",
    "from_ep2": "one_moe",
    "from_tp4": "one",
    # The head-split mixers' mid-epoch TP 2 checkpoints (the `mixers:KIND` scenarios).
    **{f"from_tp2:{kind}": f"one:{kind}" for kind in MIXER_KINDS},
}


def _one_process_source(label: str, request: pytest.FixtureRequest) -> Path:
    if label == "from_tp2":
        return request.getfixturevalue("crashed") / "last"
    if label == "from_tp4":
        request.getfixturevalue("four")  # the TP 4 run writes it
        return request.getfixturevalue("crashed") / "tp4_epoch0"
    if label.startswith("from_tp2:"):
        return request.getfixturevalue("tp2")["out"] / f"{label.split(':', 1)[1]}_mid"
    return (
        request.getfixturevalue("tp2")["out"]
        / {"from_cp2": "cp2_epoch0", "from_pp2": "pp2_epoch0", "from_ep2": "ep2_epoch0"}[label]
    )


@pytest.fixture(scope="module")
def one_process(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """What each selected label's checkpoint gave on one process (``resumed``: the resumed losses), by label: one
    launch for all of them (a cold start costs more than a resume)."""
    items = request.session.items
    labels = selected_scenarios(items, launch="ckpt_one", fixture="one_process", default=list(ONE_PROCESS))
    runs = {label: f"{ONE_PROCESS[label]}@{_one_process_source(label, request)}" for label in labels}
    out = tmp_path_factory.mktemp("ckpt_one")
    workers(WORKER, 1, str(out), *runs.values(), "--label", "one")
    (result,) = _load(out, "one", 1)
    return {label: result[run] for label, run in runs.items()}


def _dp_mean(ranks: list[dict[str, Any]], key: str, dp_key: str) -> dict[int, float]:
    """Each data-parallel rank trains on half of each global batch: their mean is the global loss."""
    by_dp = {r[dp_key]: r[key] for r in ranks}
    return {step: sum(losses[step] for losses in by_dp.values()) / len(by_dp) for step in by_dp[0]}


@pytest.mark.scenarios("ckpt_one", "from_tp4")
def test_tp4_with_replicated_kv_heads_trains_resumes_on_2d_and_one_process_and_exports(
    four: list[dict[str, Any]], crashed: Path, single: dict[str, Any], one_process: dict[str, Any]
) -> None:
    """TP 4 over 2 KV heads (each rank computes the KV head its query head reads): the same losses as one process;
    its checkpoint resumes on dp 2 x tp 2 and on one process, and its save_pretrained reloads with its logits."""
    from transformers import AutoModelForCausalLM

    # 1 query head per rank reading 1 KV head (grouping 1); each rank stores 1/4 of k_proj's 2 x 16 rows.
    assert four[1]["tp4_kv_heads"] == [(1, (8, 64))]
    _assert_close(four[0]["uninterrupted"], single["uninterrupted"], fp32_loss_bounds(single["uninterrupted"]))
    _assert_close(_dp_mean(four, "resumed_2d", "dp_rank_2d"), single["resumed"], fp32_loss_bounds(single["resumed"]))
    _assert_close(one_process["from_tp4"]["resumed"], single["resumed"], fp32_loss_bounds(single["resumed"]))
    model = AutoModelForCausalLM.from_pretrained(crashed / "tp4_pretrained")
    _assert_logits(probe_logits(model), four[0]["tp4_logits"], model)


def test_pp2_dp2_single_file_resumes_on_pp2_dp2_and_on_2d(four: list[dict[str, Any]], single: dict[str, Any]) -> None:
    """One file from pp 2 x dp 2, where FSDP2 shards each stage's weights and optimizer states: each data-parallel
    rank's losses averaged, as one process's over the whole batch, before and after resuming on both layouts."""
    bounds = fp32_loss_bounds(single["uninterrupted"])
    _assert_close(_dp_mean(four, "pp_file_uninterrupted", "pp_dp_rank"), single["uninterrupted"], bounds)
    resumed_bounds = fp32_loss_bounds(single["resumed"])
    _assert_close(_dp_mean(four, "pp_file_resumed", "pp_dp_rank"), single["resumed"], resumed_bounds)
    _assert_close(_dp_mean(four, "pp_file_to_2d", "dp_rank_2d"), single["resumed"], resumed_bounds)


def test_tp2_checkpoint_resumes_on_2d_and_truncated_fails_on_every_rank(
    four: list[dict[str, Any]], single: dict[str, Any]
) -> None:
    ranks = four
    _assert_close(_dp_mean(ranks, "resumed", "dp_rank"), single["resumed"], fp32_loss_bounds(single["resumed"]))
    for result in ranks:
        assert result["truncated"]["type"] == IncompleteCheckpointError.__name__, result["truncated"]
        assert "holds" in result["truncated"]["message"] and ".distcp" in result["truncated"]["message"]


def test_truncated_and_missing_checkpoints_name_what_is_wrong(crashed: Path, truncated: Path, tmp_path: Path) -> None:
    with pytest.raises(IncompleteCheckpointError, match=r"__\d_\d\.distcp holds \d+ bytes, the index needs"):
        check_checkpoint(truncated)
    copy = tmp_path / "no_meta"
    shutil.copytree(crashed / "last", copy)
    (copy / "meta.pt").unlink()
    with pytest.raises(IncompleteCheckpointError, match="meta.pt missing"):
        check_checkpoint(copy)
    with pytest.raises(FileNotFoundError, match="No checkpoint at"):
        check_checkpoint(crashed / "never_published")
    partial_path(crashed / "never_published").mkdir()
    with pytest.raises(FileNotFoundError, match="Only an unfinished save"):
        check_checkpoint(crashed / "never_published")
    cut = tmp_path / "cut.ckpt"
    cut.write_bytes(b"PK\x03\x04 not a whole archive")
    with pytest.raises(IncompleteCheckpointError, match="not a complete torch.save archive"):
        check_checkpoint(cut)


@pytest.mark.scenarios("ckpt_tp2", "final")
def test_save_pretrained_inside_the_run(tp2: dict[str, Any]) -> None:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tp2["out"] / "pretrained")
    _assert_logits(probe_logits(model), tp2["ranks"][0]["final_logits"], model)


@pytest.mark.scenarios("ckpt_tp2", "final")
def test_a_save_into_a_run_directory_is_refused_on_every_rank(tp2: dict[str, Any]) -> None:
    """Before the fix the directory was moved aside and deleted; the run went on with the next saves either way."""
    for result in tp2["ranks"]:
        error = result["save_into_run_dir"]
        assert error is not None and error.startswith("IsADirectoryError: Cannot save a checkpoint to"), error
        assert "notes.txt" in error
    run_dir = tp2["out"] / "run_dir"
    assert [p.name for p in run_dir.iterdir()] == ["notes.txt"] and (run_dir / "notes.txt").read_text() == "mine"
    assert not [p for p in tp2["out"].iterdir() if p.name.startswith(".run_dir")]


@pytest.mark.parametrize("name", ["tied_pretrained", "tied_merged"])
@pytest.mark.scenarios("ckpt_tp2", "tied")
def test_a_tied_sharded_model_saves_transformers_keys(tp2: dict[str, Any], name: str) -> None:
    """`save_pretrained` and `save_merged` of a tied model sharded over TP 2 against Transformers' own save of the
    same model on one process (the fixture's `tied` directory; the merged model saved by `merge_and_unload`): same
    keys, the same values bit for bit (each tensor gathered whole, and merged on rank 0 with PEFT's own delta, as the
    reference merges it), the same file size. Before the fix `lm_head.weight` was written too."""
    import os

    from safetensors import safe_open

    from tests.helpers.cases import CHECKPOINT_ENV

    ours = tp2["out"] / name / "model.safetensors"
    if name == "tied_pretrained":
        reference = Path(os.environ[CHECKPOINT_ENV]) / "tied" / "model.safetensors"
    else:
        reference = tp2["out"] / "tied_merged_reference" / "model.safetensors"
    with safe_open(ours, framework="pt") as mine, safe_open(reference, framework="pt") as theirs:
        assert set(mine.keys()) == set(theirs.keys()) and "lm_head.weight" not in set(mine.keys())
        for key in theirs.keys():
            torch.testing.assert_close(mine.get_tensor(key), theirs.get_tensor(key), atol=IDENTICAL, rtol=0, msg=key)
    assert abs(ours.stat().st_size - reference.stat().st_size) < 1024


@pytest.mark.parametrize(
    ("name", "scenario"),
    [pytest.param("final", "final", id="final"), pytest.param("final_full.ckpt", "full", id="final_full.ckpt")],
)
@pytest.mark.scenarios("ckpt_tp2", "{scenario}")
def test_export_round_trip(tp2: dict[str, Any], name: str, scenario: str, tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    from lightning_tp.tools.export import export_checkpoint

    out = export_checkpoint(tp2["out"] / name, tmp_path / "exported")
    expected = tp2["ranks"][0]["final_full_logits" if name.endswith(".ckpt") else "final_logits"]
    model = AutoModelForCausalLM.from_pretrained(out)
    _assert_logits(probe_logits(model), expected, model)


@pytest.mark.scenarios("ckpt_tp2", "final")
def test_export_from_a_file_url(tp2: dict[str, Any], tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    from lightning_tp.tools.export import main

    assert main([f"local://{tp2['out'] / 'url_final'}", str(tmp_path / "exported")]) == 0
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "exported")
    _assert_logits(probe_logits(model), tp2["ranks"][0]["final_logits"], model)


@pytest.mark.scenarios("ckpt_tp2", "lora")
def test_export_lora_run_adapter_and_merged(tp2: dict[str, Any], tmp_path: Path) -> None:
    """The LoRA run left its frozen base out of the checkpoint: export reads it from where the run loaded it."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from lightning_tp.tools.export import export_checkpoint
    from tests.helpers.cases import _checkpoint

    expected = tp2["ranks"][0]["lora_logits"]
    adapter = export_checkpoint(tp2["out"] / "lora_final", tmp_path / "adapter")
    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(_checkpoint("qwen3")), adapter)
    _assert_logits(probe_logits(model), expected, model)
    merged = export_checkpoint(tp2["out"] / "lora_final", tmp_path / "merged", merge=True)
    _assert_logits(probe_logits(AutoModelForCausalLM.from_pretrained(merged)), expected, model)


@pytest.mark.scenarios("ckpt_tp2", "vlm")
def test_vision_language_model_resumes_exactly_and_exports(tp2: dict[str, Any], tmp_path: Path) -> None:
    """LLaVA at TP 2: resumed from a sharded checkpoint at step 2, steps 3 and 4 repeat the uninterrupted run's
    losses; the final checkpoint exports to a directory `AutoModelForImageTextToText` loads with the same logits."""
    from transformers import AutoModelForImageTextToText

    from lightning_tp.tools.export import export_checkpoint
    from tests.helpers.models import vlm_batches

    result = tp2["ranks"][0]["vlm"]
    assert len(result["resumed"]) == 2
    torch.testing.assert_close(
        torch.tensor(result["resumed"]), torch.tensor(result["reference"][2:]), atol=IDENTICAL, rtol=0
    )
    model = AutoModelForImageTextToText.from_pretrained(export_checkpoint(tp2["out"] / "vlm_final", tmp_path / "x"))
    with torch.no_grad():
        logits = model.eval()(**vlm_batches("llava", 1)[0]).logits
    _assert_logits(logits, result["logits"], model)


@pytest.mark.parametrize("kind", list(MIXER_KINDS))
@pytest.mark.scenarios("ckpt_tp2", "mixers:{kind}")
def test_head_split_mixer_checkpoints_resume_exactly(tp2: dict[str, Any], kind: str) -> None:
    """Qwen3.5 (Gated DeltaNet), DeepSeek-V3 (latent attention, a MoE layer) and Nemotron-H (Mamba2) at TP 2, their
    mixers split by heads: the split parameters are ``Shard(0)`` DTensors (not left whole), and a sharded checkpoint
    mid-epoch 1 resumes on TP 2 with the uninterrupted run's losses and final weights (its logits)."""
    for result in tp2["ranks"]:
        result = result[f"mixers:{kind}"]
        for name in MIXER_KINDS[kind]:  # each rank holds half of dim 0
            placements, local, whole = result["sharded"][name]
            assert placements == "(Shard(dim=0),)" and local == (whole[0] // 2, *whole[1:]), (name, result["sharded"])
        assert sorted(result["reference"]) == list(range(1, STEPS + 1))
        _assert_close(result["resumed"], _after(result["reference"], 6), IDENTICAL)
        torch.testing.assert_close(result["resumed_logits"], result["logits"], atol=IDENTICAL, rtol=0)


@pytest.mark.parametrize("kind", list(MIXER_KINDS))
@pytest.mark.scenarios("ckpt_tp2", "mixers:{kind}")
@pytest.mark.scenarios("ckpt_one", "from_tp2:{kind}")
def test_head_split_mixer_checkpoints_resume_on_one_process(
    tp2: dict[str, Any], one_process: dict[str, Any], kind: str
) -> None:
    """The same mid-epoch TP 2 checkpoint resumes on one process (the packed blocks, stored as one ``Shard(0)`` tensor
    in the model's own layout, read whole): the losses of the uninterrupted TP 2 run after it, within fp32 rounding,
    and its final weights (its logits)."""
    from transformers import AutoModelForCausalLM

    reference = tp2["ranks"][0][f"mixers:{kind}"]
    resumed = one_process[f"from_tp2:{kind}"]
    trained = AutoModelForCausalLM.from_pretrained(tp2["out"] / f"{kind}_pretrained")
    expected = _after(reference["reference"], 6)
    _assert_close(resumed["resumed"], expected, fp32_loss_bounds(expected, kind, trained.state_dict()))
    # The weights of steps 7 and 8 are each layout's own: their roundings counted.
    _assert_logits(resumed["logits"], reference["logits"], trained, steps=STEPS - 6, rows=ROWS)


@pytest.mark.parametrize("kind", list(MIXER_KINDS))
@pytest.mark.scenarios("ckpt_tp2", "mixers:{kind}")
def test_head_split_mixers_save_pretrained_and_export(tp2: dict[str, Any], kind: str, tmp_path: Path) -> None:
    """save_pretrained of the sharded model (on every rank) and the export of its final sharded checkpoint reload in
    Transformers whole (no key missing, unexpected or of another shape), with the same tensors and the sharded
    model's logits. (Their names may differ: save_pretrained writes DeepSeek-V3's experts one by one, as on the Hub;
    export keeps the model's own fused names.)"""
    from transformers import AutoModelForCausalLM

    from lightning_tp.tools.export import export_checkpoint

    expected = tp2["ranks"][0][f"mixers:{kind}"]["logits"]
    exported = export_checkpoint(tp2["out"] / f"{kind}_final", tmp_path / "exported")
    weights = []
    for directory in (tp2["out"] / f"{kind}_pretrained", Path(exported)):
        model, info = AutoModelForCausalLM.from_pretrained(directory, output_loading_info=True)
        assert not any(info.values()), (directory.name, info)
        _assert_logits(probe_logits(model), expected, model, msg=directory.name)
        weights.append(model.state_dict())
    pretrained, export = weights
    assert sorted(pretrained) == sorted(export)
    for name, tensor in pretrained.items():
        torch.testing.assert_close(export[name], tensor, atol=0, rtol=0, msg=name)
