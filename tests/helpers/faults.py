"""Launches that are meant to fail (a preemption, a fault): return how they ended instead of failing the test, and
measure when every process of the job is gone."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from tests.helpers.launch import ROOT, child_env


@dataclass
class Ended:
    returncode: int
    output: str
    ended_at: float  # time.time() when the launcher returned


def launch(script: str | Path, *args: str, nprocs: int | None = None, timeout: float = 300) -> Ended:
    """``torchrun --standalone`` on ``nprocs`` processes, or ``python script`` (Lightning starts the other processes)
    when ``nprocs`` is None. A launch that outlives ``timeout`` fails the test: that is a hang."""
    if nprocs is None:
        cmd = [sys.executable, str(script), *args]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nprocs}"]
        cmd += [str(script), *args]
    try:
        proc = subprocess.run(cmd, env=child_env(), cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as err:
        raise AssertionError(f"{cmd} did not finish in {timeout} s (a hang):\n{err.stdout}\n{err.stderr}") from err
    return Ended(proc.returncode, proc.stdout + proc.stderr, time.time())


def alive(pid: int) -> bool:
    """Whether ``pid`` still runs (a zombie, dead but not yet reaped by its parent, counts as gone)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def wait_gone(pids: list[int], *, timeout: float) -> float:
    """Wait until none of ``pids`` runs; return when that was (time.time()), or fail naming the survivors."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        if not any(alive(pid) for pid in pids):
            return time.time()
        time.sleep(0.2)
    survivors = [pid for pid in pids if alive(pid)]
    for pid in survivors:  # do not leave them running after the test
        try:
            os.kill(pid, 9)
        except ProcessLookupError:
            pass
    raise AssertionError(f"processes {survivors} still ran {timeout} s after their launcher returned")
