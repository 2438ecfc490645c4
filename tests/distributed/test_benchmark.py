"""``benchmarks/run.py --quick`` as CI runs it: the JSON it writes, and the collectives of the strategy's TP step
against the count the plan implies (the step's real communication, measured with ``benchmarks.comm``)."""

from __future__ import annotations

import json

import pytest

from tests.helpers.launch import run_script


@pytest.fixture(scope="module")
def report(tmp_path_factory: pytest.TempPathFactory) -> dict:
    out = tmp_path_factory.mktemp("bench") / "results.json"
    run_script("benchmarks/run.py", "--quick", "--out", str(out), timeout=300)
    assert out.with_name("results.md").read_text().startswith("Llama-style")
    return json.loads(out.read_text())


def test_quick_benchmark_writes_every_run(report: dict) -> None:
    assert set(report) >= {"machine", "config", "runs", "ratios"}
    names = [run["name"] for run in report["runs"]]
    assert names[:5] == ["single", "tp2", "hand_tp2", "hand_tp2_prepared", "hf_native_tp2"]
    assert {"tp2_sp", "tp2_loss_parallel", "tp2_sp_lp"} <= set(names)
    for run in report["runs"]:
        # Every run happened: a skip (the strategy refusing a variant's option) would hide a missing feature.
        assert "skipped" not in run, run
        assert run["step_time_s"] > 0 and run["tokens_per_s"] > 0, run["name"]
        assert 0 < run["step_time_min_s"] <= run["step_time_best_round_s"] <= max(run["step_time_per_round_s"])
        assert len(run["peak_mem_mb"]) == run["ranks"]
        for kind, value in run["collectives"].items():
            assert set(value) == {"count", "bytes"} and value["count"] > 0, (run["name"], kind)
        assert run["theory"] is not None
        # Same model, same batches: every run computes the same losses.
        assert run["loss_max_abs_diff_vs_first"] < 1e-4, run["name"]
    assert "tp2_over_hand_tp2" in report["ratios"]


def test_tp2_collectives_per_step_match_the_plan(report: dict) -> None:
    """For 2 decoder layers, forward: the embedding's partial sums and o_proj/down_proj per layer (5 all-reduces of
    one activation) and lm_head's gathered logits (1 all-gather); backward: one input gradient per attention and MLP
    and lm_head's (5 all-reduces), where Transformers' layers and a plain hand plan reduce one per projection (11)."""
    cfg = report["config"]
    assert cfg["layers"] == 2
    activation = cfg["batch_size"] * cfg["seq_len"] * cfg["hidden"] * 4  # fp32
    logits = cfg["batch_size"] * cfg["seq_len"] * cfg["vocab"] * 4
    runs = {run["name"]: run for run in report["runs"]}
    tp2 = runs["tp2"]
    assert tp2["collectives_by_phase"]["forward"] == {
        "all_gather": {"count": 1, "bytes": logits},
        "all_reduce": {"count": 5, "bytes": 5 * activation},
    }
    assert tp2["collectives_by_phase"]["backward"] == {"all_reduce": {"count": 5, "bytes": 5 * activation}}
    assert tp2["optimizer"] == "AdamW(lr=1e-4)" and not tp2["collectives_by_phase"]["optimizer"]
    assert tp2["theory_matches"] and tp2["collectives_stable_over_rounds_and_ranks"]
    assert runs["hand_tp2_prepared"]["collectives"] == tp2["collectives"]
    for name in ("hand_tp2", "hf_native_tp2"):
        assert runs[name]["collectives_by_phase"]["backward"]["all_reduce"]["count"] == 11, name
    # Sequence and loss parallelism: every run happened and issued what the theory says, counts and bytes.
    for name in ("tp2_sp", "tp2_loss_parallel", "tp2_sp_lp"):
        assert "skipped" not in runs[name] and runs[name]["theory_matches"], (name, runs[name].get("collectives"))
    assert "all_gather" not in runs["tp2_loss_parallel"]["collectives_by_phase"]["forward"]


def test_counter_sees_dtensor_and_plain_collectives(report: dict) -> None:
    """DTensor's collectives (Transformers' native TP issues only those in training) and plain ``torch.distributed``
    calls (Lightning's per-step SIGTERM broadcast; the preemption flag's all-reduce, which replaces Lightning's
    broadcast under this strategy) are both counted. The ThroughputMonitor's reduce is not in the counted step: it
    reduces only where the loggers write."""
    runs = {run["name"]: run for run in report["runs"]}
    assert runs["hf_native_tp2"]["collectives_by_phase"]["forward"] == runs["tp2"]["collectives_by_phase"]["forward"]
    after_step = runs["tp2"]["collectives_by_phase"]["after_step"]
    assert list(after_step) == ["all_reduce"] and after_step["all_reduce"]["count"] == 1, after_step
    assert runs["hand_tp2"]["collectives_by_phase"]["after_step"] == {"broadcast": {"count": 1, "bytes": 8}}


def test_expert_parallel_benchmark_counts_the_theory(tmp_path) -> None:
    """benchmarks/expert_parallel.py, tiny: each layout's all-to-alls per step (mean over the ranks) are the theory's
    to the byte, and each rank computes with 1/ep of the experts under EP, every expert under FSDP2 alone."""
    from tests.helpers.launch import ROOT, torchrun

    out = tmp_path / "ep.json"
    sizes = ["--layers", "1", "--seq", "32", "--batch", "4", "--steps", "1", "--hidden", "64", "--experts", "4"]
    torchrun(ROOT / "benchmarks/expert_parallel.py", 2, *sizes, "--expert-width", "32", "--out", str(out))
    report = json.loads(out.read_text())
    for name in ("moe_tp_experts", "ep2_tp2", "ep2_dp2", "fsdp2"):
        run = report[name]
        assert run["all_to_all"]["count"] == run["all_to_all_theory"]["count"], name
        assert run["all_to_all"]["bytes"] == run["all_to_all_theory"]["bytes"], name
        assert run["expert_fraction"] == 0.5 and run["step_time_s"] > 0, name
    whole = report["fsdp2"]["expert_bytes_computed_per_rank"]
    assert report["ep2_dp2"]["expert_bytes_computed_per_rank"] == whole // 2
    assert report["ep2_tp2"]["all_to_all"]["count"] > 0
