"""tests/gpu/multi_gpu.py, the script run by hand on GPUs, kept working: a few of its checks on 2 CPU processes with
gloo (``--cpu``), which exercise its parity and resume/export code paths (its RNG and offload checks need CUDA)."""

from __future__ import annotations

import json
from pathlib import Path

from tests.helpers.launch import torchrun

SCRIPT = Path(__file__).resolve().parents[1] / "gpu" / "multi_gpu.py"


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
