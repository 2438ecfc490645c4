"""What a benchmark imports beyond lightning_tp's runtime and test dependencies, checked when the script starts: a
missing package fails at once, naming the install that brings it, instead of after the measurement (``scaling.py``
draws its plot after ten minutes of runs).

    from benchmarks.requirements import require

    require("matplotlib", why="the plot")  # in main(), after the arguments are parsed (`--help` needs nothing)

Standard library only, so a script can check before it imports torch.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

#: What installs the packages the benchmarks need beyond the test extra (pyproject.toml's ``bench`` extra).
INSTALL = 'pip install -e ".[bench]"'


def missing(*modules: str) -> list[str]:
    """The ``modules`` that cannot be imported here (found without importing them)."""
    absent = []
    for name in modules:
        try:
            found = importlib.util.find_spec(name) is not None
        except (ImportError, ValueError):  # a missing parent package; a module set to None in sys.modules
            found = False
        if not found:
            absent.append(name)
    return absent


def require(*modules: str, why: str) -> None:
    """Return if every one of ``modules`` can be imported; else exit (status 1) with a message that names the missing
    ones, what they are for (``why``) and :data:`INSTALL`."""
    absent = missing(*modules)
    if absent:
        script = Path(sys.argv[0]).name or "this benchmark"
        raise SystemExit(
            f"{script} needs {', '.join(absent)} ({why}), which is not installed: run `{INSTALL}` (the benchmarks' "
            "extra) and start it again. Nothing was measured."
        )
