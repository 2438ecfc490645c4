"""Post-training on a sharded policy: examples/grpo.py at TP 2 and dp 2 x tp 2 against one process, its reward rising,
the weights streamed to a stand-in engine in another process; ``stream_weights`` against the model's own saves at TP
2, dp 2 x tp 2 and pp 2 x dp 2 x tp 2 (tests/distributed/stream_checks.py)."""

from __future__ import annotations

import json
import math
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.helpers.launch import ROOT, child_env, run_script
from tests.helpers.selection import scenario_result as _result
from tests.helpers.tolerances import FP32, SIGMAS, fp32_roundings, rounding_gap, unit_roundoff

GRPO = ROOT / "examples" / "grpo.py"
ENGINE = ROOT / "examples" / "engine.py"
#: Steps compared with one process: sampling is exact only while the runs' logits agree to well within the gaps
#: between sampled scores, which a longer run's drift (rounding, then Adam) could close.
PARITY_STEPS = 4


def _grpo(out: Path, *args: str) -> dict[tuple[int, int], dict]:
    """Run examples/grpo.py with ``args``; each (step, prompt index)'s record, from every rank."""
    run_script(GRPO, "--record", str(out), *args)
    return _grpo_records(out)


def _model_shapes() -> list[tuple[int, ...]]:
    sys.path.insert(0, str(ROOT / "examples"))
    try:
        from sort_task import tiny_qwen3_config
    finally:
        sys.path.pop(0)
    from transformers import AutoModelForCausalLM

    return [tuple(p.shape) for p in AutoModelForCausalLM.from_config(tiny_qwen3_config()).parameters()]


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict]:
    """One process (the reference), TP 2 over the example's default 60 steps, and dp 2 x tp 2 with its weights
    streamed to the stand-in engine after each step."""
    root = tmp_path_factory.mktemp("grpo")
    out = {
        "single": _grpo(root / "single", "--devices", "1", "--steps", str(PARITY_STEPS)),
        "tp2": _grpo(root / "tp2", "--devices", "2"),
    }
    address = "127.0.0.1:29653"
    engine_out = root / "engine.json"
    engine = subprocess.Popen(
        [sys.executable, str(ENGINE), "--address", address, "--out", str(engine_out)],
        env=child_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        time.sleep(0.5)
        stdout = run_script(
            GRPO,
            "--record",
            str(root / "2d"),
            "--devices",
            "4",
            "--tp-size",
            "2",
            "--steps",
            "3",
            "--engine",
            address,
        )
        engine_log, _ = engine.communicate(timeout=120)
    finally:
        engine.kill()
    assert engine.returncode == 0, engine_log
    out["2d"] = {"stdout": stdout, "engine": json.loads(engine_out.read_text())}
    out["2d_steps"] = _grpo_records(root / "2d")
    return out


def _grpo_records(out: Path) -> dict[tuple[int, int], dict]:
    """Each (step, prompt index)'s record of a run's ``--record`` directory: its group's completions and rewards, and
    the step's losses, gradient norms and mean reward (the whole batch's: every rank's alike)."""
    steps: dict[tuple[int, int], dict] = {}
    for file in sorted(out.glob("rank*.json")):
        for step, record in enumerate(json.loads(file.read_text())):
            group = len(record["completions"]) // len(record["index"])
            for i, index in enumerate(record["index"]):
                rows = slice(i * group, (i + 1) * group)
                steps[(step, index)] = {
                    "completions": record["completions"][rows],
                    "rewards": record["rewards"][rows],
                    **{k: record[k] for k in ("mean_reward", "losses", "grad_norms", "loss_scales")},
                }
    return steps


@pytest.mark.parametrize("layout", ["tp2", "2d"])
def test_grpo_matches_one_process(runs: dict, layout: str) -> None:
    """The same prompts, completions and rewards as one process at every step compared, and the losses and gradient
    norms within fp32's bound for a run whose steps round differently (tests/helpers/tolerances.py): step ``t``
    carries the roundings of the ``t`` steps before it."""
    single, sharded = runs["single"], runs[f"{layout}_steps" if layout == "2d" else layout]
    steps = sorted({step for step, _ in sharded} & {step for step, _ in single})
    assert len(steps) >= 3, steps
    shapes = _model_shapes()
    for step in steps:
        keys = sorted(k for k in single if k[0] == step)
        assert keys == sorted(k for k in sharded if k[0] == step), f"step {step}: other prompts"
        for key in keys:
            assert sharded[key]["completions"] == single[key]["completions"], f"step {step}, prompt {key[1]}"
            assert sharded[key]["rewards"] == single[key]["rewards"], key
        ref, got = single[keys[0]], sharded[keys[0]]
        rows = len(keys) * len(ref["completions"]) * 12  # the tokens of a step's forwards (prompt and completion)
        _, step_roundings = fp32_roundings(shapes, rows)
        rho = rounding_gap(FP32, (step + 1) * step_roundings)
        for loss, ref_loss, scale in zip(got["losses"], ref["losses"], ref["loss_scales"], strict=True):
            assert abs(loss - ref_loss) <= SIGMAS * rho * scale + 2 * unit_roundoff(FP32) * abs(ref_loss), (step, loss)
        for norm, ref_norm in zip(got["grad_norms"], ref["grad_norms"], strict=True):
            assert abs(norm - ref_norm) <= (SIGMAS * rho + 2 * unit_roundoff(FP32)) * ref_norm, (step, norm, ref_norm)
        assert math.isclose(got["mean_reward"], ref["mean_reward"], rel_tol=1e-6), step


def test_grpo_reward_rises(runs: dict) -> None:
    """The example's default run (TP 2, 60 steps): the mean reward of the last 10 steps is well above the first 10's."""
    by_step: dict[int, float] = {step: record["mean_reward"] for (step, _), record in runs["tp2"].items()}
    assert len(by_step) == 60
    first = sum(by_step[s] for s in range(10)) / 10
    last = sum(by_step[s] for s in range(50, 60)) / 10
    assert last > first + 0.15, (first, last)


def test_engine_receives_the_weights_and_generates_what_the_policy_generates(runs: dict) -> None:
    """After each step (dp 2 x tp 2) the stand-in engine, another process, receives every weight and its greedy
    completions of the probe prompts are the policy's."""
    engine, stdout = runs["2d"]["engine"], runs["2d"]["stdout"]
    policy = [line.split(": ", 1)[1].split("  (")[0] for line in stdout.splitlines() if line.startswith("policy step")]
    assert len(engine) == len(policy) == 3, stdout
    assert [" ".join(update["completions"]) for update in engine] == policy
    assert all(update["tensors"] == 25 for update in engine)  # every tensor of the tiny Qwen3 (untied: 2 + 11 x 2 + 1)


@pytest.mark.parametrize("layout", ["tp2", "2d", "3d"])
@pytest.mark.scenarios("{layout}", "stream_weights")
def test_stream_weights(layout_results: list[dict], layout: str) -> None:
    """Every rank's streamed tensors equal the model's own ``save_pretrained`` (and a LoRA model's merged ones equal
    ``save_merged``'s within the rounding of the delta's r-term sums; its base ones the unmerged model's), together
    every name of the save once (pp: each stage its own, the tied head once); the stream holds at most one whole
    tensor above the shards, plus one slice's gather; only the targets receive; a rank whose loop raises makes every
    other raise instead of hang."""
    results = [_result(layout_results, "stream_weights", rank=rank) for rank in range(len(layout_results))]
    for rank, result in enumerate(results):
        for kind in ("plain", "lora_base"):
            assert result[kind]["differ"] == [], (rank, kind, result[kind]["differ"])
        # pp 2 runs a model with tied embeddings: its head is the embedding, streamed once (under its first name).
        tied = {"lm_head.weight"} if layout == "3d" else set()
        assert set(result["plain"]["all_names"]) == set(result["plain"]["saved_names"]) - tied
        assert set(result["lora"]["all_names"]) == set(result["lora"]["saved_names"]) - tied
        assert result["lora_base"]["differs_from_merged"]
        # The merge's only difference from save_merged's: the order of the r-term sums of B @ A, and a rounding.
        bound = (result["lora"]["rank"] + 2) * unit_roundoff(FP32) * result["lora"]["max_value"]
        assert result["lora"]["max_gap"] <= bound, result["lora"]
        memory = result["memory"]
        # One whole tensor, and one slice's gather: its shard, the gathered slice and the collectives' buffers for
        # it (over each mesh axis in turn under 2-D), set by `chunk_bytes`, not by the tensor: measured on gloo up to
        # 4.25 slices, bounded by 5.
        slices = 5 * memory["chunk"]
        assert 0 < memory["peak"] <= memory["largest"] + slices, memory
        lora_memory = result["lora_memory"]
        assert lora_memory["peak"] <= memory["largest"] + slices + lora_memory["adapters"], lora_memory
        assert result["plain"]["on_cpu"]
        assert result["failure"] == ("raised here" if rank == 1 else result["failure"])
        if rank != 1:
            assert "stopped on another rank" in result["failure"], result["failure"]
    pp = results[0]["coords"].get("pp") is not None
    stage_count = {}
    for result in results:
        coords = result["coords"]
        stage = coords.get("pp", 0)
        count = result["memory"]["count"]
        stage_count.setdefault(stage, count)
        replica_first = coords["tp"] == 0 and coords["cp"] == 0
        assert result["targets"]["replicas"] == (count if replica_first else 0), coords
        first = replica_first and coords["dp_shard"] == 0 and coords["dp_replicate"] == 0
        assert result["targets"]["first"] == (count if first else 0), coords
    assert sum(stage_count.values()) == len(results[0]["plain"]["all_names"]) or not pp
    if layout == "tp2":
        for result in results:
            assert result["consumer_parts_differ"] == []
            assert "does not divide" in result["consumer_error"]
