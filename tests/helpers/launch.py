"""Launch a script on several CPU processes (gloo), once per group of cases: the suite's workers with
:func:`workers` (torchrun's environment, the imports made once: :mod:`tests.helpers.forkrun`), what a user launches
with :func:`torchrun` (the real one).

Every launch arms the hang tripwire (see :mod:`tests.helpers.tripwire`): the workers get a short process-group timeout
(``LIGHTNING_TP_TEST_TIMEOUT``) and ``PYTHONFAULTHANDLER=1``; if the launch itself outlives ``timeout``, every process
it started gets SIGABRT, so faulthandler prints each rank's stack into the failure message before the processes are
killed.
"""

from __future__ import annotations

import atexit
import functools
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from tests.helpers.tripwire import TIMEOUT_ENV, tripwire_timeout

ROOT = Path(__file__).resolve().parents[2]

#: Each launch of this pytest process: (wall seconds, what ran). ``pytest --durations`` shows only a test's setup and
#: call, and a launch shared by many tests hides inside one of them; the root conftest prints these at the end.
WALL_TIMES: list[tuple[float, str]] = []
#: The line prefix a worker prints (rank 0) after each scenario: ``<prefix> <seconds> <name>``.
SCENARIO_SECONDS = "LIGHTNING_TP_SCENARIO_SECONDS"
#: Each scenario a launch of this pytest process ran: (seconds, name), from those lines.
SCENARIO_TIMES: list[tuple[float, str]] = []


def _label(cmd: list[str]) -> str:
    """A launch's short name: its script, process count and arguments (a test's temporary paths left out)."""
    scripts = [i for i, arg in enumerate(cmd) if arg.endswith(".py")]
    if not scripts:
        return " ".join(cmd)[-160:]
    procs = next((arg.split("=", 1)[1] for arg in cmd if arg.startswith("--nproc_per_node=")), None)
    if procs is None:  # forkrun's: `-m tests.helpers.forkrun NPROCS script`
        procs = cmd[scripts[0] - 1] if "tests.helpers.forkrun" in cmd else "1"
    args = [arg for arg in cmd[scripts[0] + 1 :] if os.sep not in arg]
    return f"{Path(cmd[scripts[0]]).name} x{procs} {' '.join(args)}"[:160]


@functools.cache
def _inductor_cache() -> str:
    """One torch.compile cache for this pytest session's launches: the first launch compiles, later ones reuse it, and
    no kernel comes from another run (a cache filled under other settings, e.g. ``ATEN_CPU_CAPABILITY``, is keyed the
    same and can crash the run that reuses it)."""
    path = tempfile.mkdtemp(prefix="lightning_tp_inductor_")
    atexit.register(shutil.rmtree, path, ignore_errors=True)  # made by mkdtemp above: ours, whatever it holds
    return path


def child_env(extra: dict | None = None) -> dict:
    """The environment of a process a test starts: this checkout first on the path (not an installed copy), one
    thread, faulthandler, the tripwire's timeout, the session's compile cache."""
    return {
        # Inductor compiles in the worker itself: a pool of compile processes per rank only competes for the cores.
        "TORCHINDUCTOR_COMPILE_THREADS": "1",
        **os.environ,
        **(extra or {}),
        # Always the session's: importing inductor in this process sets the variable to its shared default.
        "TORCHINDUCTOR_CACHE_DIR": _inductor_cache(),
        "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
        "OMP_NUM_THREADS": "1",
        "PYTHONFAULTHANDLER": "1",  # a fatal signal (the SIGABRT below included) prints every thread's stack
        TIMEOUT_ENV: os.environ.get(TIMEOUT_ENV, str(int(tripwire_timeout().total_seconds()))),
    }


def _descendants(pid: int) -> list[int]:
    """Every process below ``pid`` (torchrun starts its workers in sessions of their own, out of reach of killpg)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):  # not a process, or one that just ended
            continue
        children.setdefault(int(fields[1]), []).append(int(entry.name))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def _run(cmd: list[str], *, env: dict, timeout: float) -> subprocess.CompletedProcess:
    """``subprocess.run``; on timeout, SIGABRT to every process it started (faulthandler prints their stacks), then
    SIGKILL to what is left."""
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:  # a hang is a failure with every rank's stack, not a stuck CI job
        tree = [proc.pid, *_descendants(proc.pid)]
        for target in reversed(tree):  # the workers first, before their launcher notices and kills them
            try:
                os.kill(target, signal.SIGABRT)
            except ProcessLookupError:
                pass
        try:
            stdout, stderr = proc.communicate(timeout=20)
        except subprocess.TimeoutExpired:
            for target in tree:
                try:
                    os.kill(target, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            stdout, stderr = proc.communicate()
        raise AssertionError(
            f"{' '.join(cmd)} did not finish in {timeout} s; the stacks of its processes:\n{(stdout + stderr)[-30000:]}"
        ) from None
    finally:
        WALL_TIMES.append((time.perf_counter() - start, _label(cmd)))
    return subprocess.CompletedProcess(cmd, proc.returncode, stdout, stderr)


def run_script(script: str | Path, *args: str, timeout: float = 600) -> str:
    """Run ``script`` as a user would (``python script ...``, Lightning starting any other process); return its
    standard output, or fail the test with everything it printed."""
    proc = _run([sys.executable, str(script), *args], env=child_env(), timeout=timeout)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout


def torchrun(script: str | Path, nprocs: int, *args: str, timeout: float = 600, env: dict | None = None) -> str:
    """Run ``script`` on ``nprocs`` processes with the real ``torchrun --standalone`` (what a user types: the examples,
    the benchmarks, the tripwire's own test); return its output, or fail the test with it."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nprocs}"]
    return _launch(cmd, script, nprocs, *args, timeout=timeout, env=env)


def workers(script: str | Path, nprocs: int, *args: str, timeout: float = 600, env: dict | None = None) -> str:
    """Run one of the suite's worker scripts on ``nprocs`` processes as torchrun would, with the heavy imports made
    once and the ranks forked from them (:mod:`tests.helpers.forkrun`); return its output, or fail the test."""
    cmd = [sys.executable, "-m", "tests.helpers.forkrun", str(nprocs)]
    return _launch(cmd, script, nprocs, *args, timeout=timeout, env=env)


def _launch(cmd: list[str], script: str | Path, nprocs: int, *args: str, timeout: float, env: dict | None) -> str:
    cmd = [*cmd, str(script), *args]
    proc = _run(cmd, env=child_env(env), timeout=timeout)
    output = proc.stdout + proc.stderr
    for line in proc.stdout.splitlines():
        if line.startswith(f"{SCENARIO_SECONDS} "):
            _, seconds, name = line.split(" ", 2)
            SCENARIO_TIMES.append((float(seconds), f"{name} ({Path(script).name} x{nprocs})"))
    if proc.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)} failed ({proc.returncode}):\n{output[-20000:]}")
    return output
