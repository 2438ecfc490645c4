"""The benchmarks check what they import beyond the runtime and test dependencies (``benchmarks/requirements.py``)
before they measure: a missing package fails at once, naming the ``bench`` extra, instead of after the run."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from benchmarks.requirements import INSTALL, missing, require

ROOT = Path(__file__).resolve().parents[2]


def test_require_returns_when_everything_is_there() -> None:
    assert missing("json", "os.path") == []
    require("json", "os.path", why="nothing")


def test_require_exits_naming_what_is_missing_and_the_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # as if not installed
    assert missing("json", "matplotlib", "lightning_tp_no_such_module", "no_such_parent.child") == [
        "matplotlib",
        "lightning_tp_no_such_module",
        "no_such_parent.child",
    ]
    with pytest.raises(SystemExit) as exit_info:
        require("json", "matplotlib", why="the plot")
    message = str(exit_info.value.code)
    assert "needs matplotlib (the plot)" in message
    assert INSTALL == 'pip install -e ".[bench]"' and INSTALL in message


# A script run with matplotlib hidden: `sys.modules["matplotlib"] = None` makes it unimportable.
_HIDDEN = (
    "import runpy, sys; sys.modules['matplotlib'] = None; script = sys.argv[1]; sys.argv = sys.argv[1:]; "
    "runpy.run_path(script, run_name='__main__')"
)


@pytest.mark.parametrize(
    "script",
    [
        "benchmarks/scaling.py",  # would launch benchmarks/run.py for every point first
        "benchmarks/context_parallel.py",  # would start its process group first (and fail: no torchrun here)
    ],
)
def test_a_benchmark_without_matplotlib_fails_before_measuring(script: str, tmp_path: Path) -> None:
    out = tmp_path / "result.json"
    started = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-c", _HIDDEN, str(ROOT / script), "--out", str(out)],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 1, done.stderr
    assert "needs matplotlib (the plot" in done.stderr and INSTALL in done.stderr, done.stderr
    assert "Traceback" not in done.stderr and done.stdout == ""  # nothing measured, nothing printed
    assert not out.exists()
    assert time.monotonic() - started < 100
