"""The public surface: ``lightning_tp.__all__`` holds the entry points a user calls; internals it exported before
answer from their modules with a warning for one release."""

from __future__ import annotations

import pytest

import lightning_tp


def test_the_public_names_are_entry_points_and_resolve():
    for name in lightning_tp.__all__:
        assert getattr(lightning_tp, name) is not None, name
    assert not set(lightning_tp.__all__) & set(lightning_tp._MOVED)
    assert {"parallelize", "TensorParallelStrategy", "parallel_state", "clip_grad_norm_"} <= set(lightning_tp.__all__)


@pytest.mark.parametrize("name", sorted(lightning_tp._MOVED))
def test_a_moved_internal_still_answers_with_a_warning_naming_its_module(name: str):
    import importlib

    module = lightning_tp._MOVED[name]
    with pytest.warns(FutureWarning, match=f"import it from `{module}`"):
        value = getattr(lightning_tp, name)
    assert value is getattr(importlib.import_module(module), name)


def test_an_unknown_name_is_an_attribute_error():
    with pytest.raises(AttributeError, match="no attribute 'nothing_here'"):
        lightning_tp.nothing_here  # noqa: B018


def test_every_public_callable_documents_its_arguments_and_errors():
    """Google-style ``Args:`` (where it takes any) and ``Raises:`` on every function and class of the public surface
    (exceptions aside), the Fabric strategy's included."""
    import inspect

    from lightning_tp.fabric import TensorParallelStrategy as FabricStrategy

    missing = []
    for name, value in [*((n, getattr(lightning_tp, n)) for n in lightning_tp.__all__), ("fabric", FabricStrategy)]:
        if not callable(value) or (inspect.isclass(value) and issubclass(value, BaseException)):
            continue
        doc = inspect.getdoc(value) or ""
        if inspect.isclass(value) and value.__init__ is not object.__init__:
            doc += inspect.getdoc(value.__init__) or ""
        target = value.__init__ if inspect.isclass(value) else value
        plain = (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)
        takes = [n for n, p in inspect.signature(target).parameters.items() if n != "self" and p.kind not in plain]
        missing += [f"{name}: {s}" for s in ("Args:", "Raises:") if s not in doc and (s == "Raises:" or takes)]
    assert not missing, missing


def test_importing_the_package_leaves_the_warning_filters_alone():
    """What warns is the caller's to filter: importing lightning_tp (and its strategies) adds no filter from its own
    code (its dependencies add theirs at import, as they do without it)."""
    import subprocess
    import sys

    code = """
import sys, warnings
calls = []
def recording(original):
    def record(*args, **kwargs):
        calls.append(sys._getframe(1).f_code.co_filename)
        return original(*args, **kwargs)
    return record
warnings.filterwarnings = recording(warnings.filterwarnings)
warnings.simplefilter = recording(warnings.simplefilter)
import lightning_tp, lightning_tp.fabric
print([f for f in calls if "lightning_tp" in f])
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.stdout.strip() == "[]", done.stdout + done.stderr[-3000:]
