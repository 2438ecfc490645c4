"""Launch a script on several CPU processes with torchrun (gloo), once per group of cases."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def run_script(script: str | Path, *args: str, timeout: float = 600) -> str:
    """Run ``script`` as a user would (``python script ...``, Lightning starting any other process); return its
    standard output, or fail the test with everything it printed."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, str(script), *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout


def torchrun(script: str | Path, nprocs: int, *args: str, timeout: float = 600, env: dict | None = None) -> str:
    """Run ``script`` on ``nprocs`` processes; return its output, or fail the test with it."""
    env = {
        **os.environ,
        **(env or {}),
        "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
        "OMP_NUM_THREADS": "1",
    }
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={nprocs}",
        str(script),
        *args,
    ]
    try:
        proc = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as err:  # a hang is a failure, not a stuck CI job
        raise AssertionError(f"{cmd} did not finish in {timeout} s:\n{err.stdout}\n{err.stderr}") from err
    output = proc.stdout + proc.stderr
    if proc.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)} failed ({proc.returncode}):\n{output[-20000:]}")
    return output
