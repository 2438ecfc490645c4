"""The scripts run on GPUs (tests/gpu/), kept working on the CPU: a few of multi_gpu.py's checks on 2 CPU processes with
gloo (``--cpu``), which exercise its parity and resume/export code paths (its RNG and offload checks need CUDA); and
run_all.py, the one call a lent GPU gets, with its first script, check_blockwise_cuda.py, on the CPU's kernels."""

from __future__ import annotations

import json
from pathlib import Path

from tests.helpers.launch import run_script, torchrun

SCRIPT = Path(__file__).resolve().parents[1] / "gpu" / "multi_gpu.py"
RUN_ALL = Path(__file__).resolve().parents[1] / "gpu" / "run_all.py"


def test_gpu_script_passes_its_checks_on_cpu(tmp_path: Path) -> None:
    out = torchrun(
        SCRIPT,
        2,
        "--cpu",
        "--skip-monitor",
        "--only",
        "qwen3_sgd,qwen3_sp_lp,resume_export",
        "--out",
        str(tmp_path),
    )
    results = json.loads((tmp_path / "results.json").read_text())["results"]
    names = [r["check"] for r in results]
    assert names == ["env", "tp2:qwen3_sgd", "tp2:qwen3_sp_lp_adamw_clip", "tp2:resume_export"], out[-2000:]
    failed = [r for r in results if not r["ok"]]
    assert failed == [], failed


def test_the_gpu_checks_run_in_one_call_and_the_kernels_check_on_cpu() -> None:
    """`run_all.py --cpu` with check_blockwise_cuda.py only (check_cuda.py's CPU variant takes a minute of fits; the
    test above runs multi_gpu.py): the tiles against fp64 and SDPA on the CPU's kernels in bf16 and fp32, and a split
    step, each line naming the device, summed up at the end."""
    out = run_script(RUN_ALL, "--cpu", "--skip", "check_cuda", "--skip", "multi_gpu", timeout=300)
    lines = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    checks = [line for line in lines if "check" in line]
    assert [c["check"] for c in checks] == ["parity_bfloat16", "parity_float32", "cp_step_syncs"], out[-3000:]
    assert all(c["ok"] and c["device"] == "cpu" for c in checks), checks
    assert lines[-1] == {
        "run_all": "summary",
        "device": "cpu",
        "scripts": {
            "check_blockwise_cuda": {"exit_code": 0, "seconds": lines[-1]["scripts"]["check_blockwise_cuda"]["seconds"]}
        },
        "failed": [],
    }
