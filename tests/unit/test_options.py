"""Each strategy argument is defined once, in lightning_tp/options.py; every other place that names it agrees: the
Trainer's and Fabric's constructors (names, order, types, defaults), their docstrings, Fabric's refusal of the
Trainer-only ones, the defaults of ``StrategyOptions`` and ``ParallelOptions``, and the table of docs/arguments.md.
Each failure names the option and the place that disagrees."""

from __future__ import annotations

import ast
import dataclasses
import inspect
import json
import re
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest

from lightning_tp.options import OPTIONS, TRAINER_ONLY, options_of
from lightning_tp.parallel_options import ParallelOptions
from lightning_tp.strategies import fabric, trainer
from lightning_tp.strategies.shared import StrategyOptions

ROOT = Path(__file__).resolve().parents[2]
DEFINITIONS = "lightning_tp/options.py"
ARGUMENTS = ROOT / "docs" / "arguments.md"
STRATEGIES = {"trainer": trainer.TensorParallelStrategy, "fabric": fabric.TensorParallelStrategy}
BY_NAME = {option.name: option for option in OPTIONS}
#: Fields of the option dataclasses that are no constructor argument.
NOT_ARGUMENTS = {ParallelOptions: {"precision"}, StrategyOptions: {"parallel"}}


def _where(function: Callable) -> str:
    path = Path(inspect.getsourcefile(function) or "?").resolve()
    path_name = path.relative_to(ROOT).as_posix() if path.is_relative_to(ROOT) else str(path)
    return f"{path_name} ({function.__qualname__})"


def _same(a: Any, b: Any) -> bool:
    return type(a) is type(b) and a == b


def _annotation(annotation: Any) -> str:
    text = annotation if isinstance(annotation, str) else inspect.formatannotation(annotation)
    return ast.unparse(ast.parse(text, mode="eval"))  # quotes and spaces as the parser writes them


def signature_problems(init: Callable, strategy: str) -> list[str]:
    """How ``init``'s parameters differ from the definitions of ``strategy``'s arguments."""
    where = _where(init)
    expected = [option.name for option in options_of(strategy)]
    parameters = [
        p for p in inspect.signature(init).parameters.values() if p.name != "self" and p.kind is not p.VAR_KEYWORD
    ]
    names = [p.name for p in parameters]
    problems = []
    for parameter in parameters:
        option = BY_NAME.get(parameter.name)
        if option is None:
            problems.append(f"`{parameter.name}`: a parameter of {where}, but no Option in {DEFINITIONS} (add one)")
            continue
        if parameter.name not in expected:
            problems.append(
                f"`{parameter.name}`: Trainer-only in {DEFINITIONS} (`trainer_only=...`), but {where} takes it"
            )
        if parameter.default is parameter.empty:
            problems.append(f"`{parameter.name}`: no default in {where}; {DEFINITIONS} says {option.default!r}")
        elif not _same(parameter.default, option.default):
            problems.append(
                f"`{parameter.name}`: default {parameter.default!r} in {where}, {option.default!r} in {DEFINITIONS}"
            )
        if parameter.annotation is parameter.empty or _annotation(parameter.annotation) != _annotation(option.type):
            problems.append(
                f"`{parameter.name}`: type {parameter.annotation!r} in {where}, {option.type!r} in {DEFINITIONS}"
            )
        kind = parameter.POSITIONAL_OR_KEYWORD if parameter.name == OPTIONS[0].name else parameter.KEYWORD_ONLY
        if parameter.kind is not kind:
            problems.append(f"`{parameter.name}`: must be {kind.description} in {where} (only `tp_size` is positional)")
    for name in expected:
        if name not in names:
            problems.append(
                f"`{name}`: defined in {DEFINITIONS} for the {strategy} strategy, but not a parameter of {where}"
            )
    common = [name for name in names if name in expected]
    if common != [name for name in expected if name in names]:
        problems.append(f"{where} lists the arguments in another order than {DEFINITIONS}: {common}")
    return problems


def docstring_problems(cls: type, strategy: str) -> list[str]:
    """The ``Args:`` of ``cls``'s docstring name the definitions of ``strategy``'s arguments, in order."""
    doc = inspect.getdoc(cls) or ""
    args = doc.split("\nArgs:\n", 1)[1].split("\nRaises:\n", 1)[0] if "\nArgs:\n" in doc else ""
    documented = re.findall(r"^    (\w+): ", args, flags=re.MULTILINE)
    expected = [option.name for option in options_of(strategy)]
    if documented == expected:
        return []
    return [
        f"the docstring of {_where(cls)} documents {documented}, not {expected} (decorate the class with "
        f"`@lightning_tp.options.document({strategy!r})`)"
    ]


def dataclass_problems(cls: type) -> list[str]:
    """The fields of an option dataclass, and ``build``'s keyword defaults, are options with the same defaults."""
    problems = []
    defaults = {f.name: f.default for f in dataclasses.fields(cls)}
    where = f"{_where(cls)} fields"
    if hasattr(cls, "build"):
        parameters = inspect.signature(cls.build).parameters.values()
        signature = {p.name: p.default for p in parameters if p.kind is p.KEYWORD_ONLY}
        checked = [(where, defaults), (_where(cls.build), signature)]
    else:
        checked = [(where, defaults)]
    for place, values in checked:
        for name, default in values.items():
            option = BY_NAME.get(name)
            if option is None:
                if name not in NOT_ARGUMENTS.get(cls, set()):
                    problems.append(f"`{name}`: in {place}, but no Option in {DEFINITIONS} (nor in NOT_ARGUMENTS)")
            elif default not in (dataclasses.MISSING, inspect.Parameter.empty) and not _same(default, option.default):
                problems.append(f"`{name}`: default {default!r} in {place}, {option.default!r} in {DEFINITIONS}")
    return problems


def shown(value: Any) -> str:
    """A default as docs/arguments.md shows it (Python, strings in double quotes)."""
    if isinstance(value, str):
        return json.dumps(value)
    if isinstance(value, tuple):
        return "(" + ", ".join(shown(v) for v in value) + ("," if len(value) == 1 else "") + ")"
    if isinstance(value, timedelta):
        seconds = int(value.total_seconds())
        for unit, size in (("days", 86400), ("hours", 3600), ("minutes", 60)):
            if seconds % size == 0:
                return f"timedelta({unit}={seconds // size})"
        return f"timedelta(seconds={seconds})"
    return repr(value)


def table_rows(text: str) -> list[tuple[str, str]]:
    """(first cell, second cell) of each row of the markdown table whose header starts with ``| argument |``."""
    lines = text.splitlines()
    starts = [i for i, line in enumerate(lines) if re.match(r"\|\s*argument\s*\|", line)]
    assert len(starts) == 1, "docs/arguments.md must hold one table whose header starts with `| argument |`"
    rows = []
    for line in lines[starts[0] + 2 :]:
        if not line.startswith("|"):
            break
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        rows.append((cells[0], cells[1] if len(cells) > 1 else ""))
    return rows


def table_problems(text: str) -> list[str]:
    """The table of docs/arguments.md has one row per argument, in the definitions' order, each default as
    :func:`shown` writes the definition's, and the text outside it names the Trainer-only arguments."""
    place = "docs/arguments.md's argument table"
    problems = []
    rows = table_rows(text)
    names = []
    for cell, default in rows:
        match = re.fullmatch(r"`(\w+)`", cell)
        if match is None:
            problems.append(f"{place}: the row {cell!r} does not hold one argument name in backticks")
            continue
        name = match.group(1)
        names.append(name)
        option = BY_NAME.get(name)
        if option is None:
            problems.append(f"`{name}`: a row of {place}, but no Option in {DEFINITIONS} (remove the row)")
        elif default != f"`{shown(option.default)}`":
            problems.append(
                f"`{name}`: {place} shows the default {default}, {DEFINITIONS} says `{shown(option.default)}`"
            )
    for option in OPTIONS:
        if option.name not in names:
            problems.append(
                f"`{option.name}`: no row in {place} (add `| `{option.name}` | `{shown(option.default)}` | ... |`)"
            )
    order = [option.name for option in OPTIONS if option.name in names]
    if [name for name in names if name in BY_NAME] != order:
        problems.append(f"{place}: the rows are not in the order of {DEFINITIONS}: {order}")
    outside = "\n".join(line for line in text.splitlines() if not line.startswith("|"))
    for name in TRAINER_ONLY:
        if f"`{name}`" not in outside:
            problems.append(f"`{name}`: Trainer-only in {DEFINITIONS}, but docs/arguments.md does not say so")
    return problems


@pytest.mark.parametrize("strategy", sorted(STRATEGIES))
def test_the_constructor_takes_the_defined_arguments(strategy: str) -> None:
    problems = signature_problems(STRATEGIES[strategy].__init__, strategy)
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("strategy", sorted(STRATEGIES))
def test_the_docstring_documents_the_defined_arguments(strategy: str) -> None:
    problems = docstring_problems(STRATEGIES[strategy], strategy)
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("name", sorted(TRAINER_ONLY))
def test_fabric_refuses_each_trainer_only_argument_with_its_reason(name: str) -> None:
    with pytest.raises(ValueError, match=re.escape(f"`{name}` is an argument of the Trainer's")) as raised:
        fabric.TensorParallelStrategy(1, **{name: BY_NAME[name].default})
    assert TRAINER_ONLY[name] in str(raised.value)


@pytest.mark.parametrize("cls", [ParallelOptions, StrategyOptions], ids=lambda cls: cls.__name__)
def test_the_option_dataclasses_default_as_defined(cls: type) -> None:
    problems = dataclass_problems(cls)
    assert not problems, "\n".join(problems)


def test_the_docs_table_lists_each_argument_with_its_default() -> None:
    assert ARGUMENTS.exists(), "docs/arguments.md (the argument table) is missing"
    problems = table_problems(ARGUMENTS.read_text())
    assert not problems, "\n".join(problems)


def test_the_definitions_are_well_formed() -> None:
    assert len(BY_NAME) == len(OPTIONS), "an option is defined twice"
    for option in OPTIONS:
        ast.parse(option.type, mode="eval")  # a valid annotation
        assert option.doc.strip() and "\n" not in option.doc, f"`{option.name}`: the doc is one non-empty paragraph"
    assert OPTIONS[0].name == "tp_size" and not OPTIONS[0].trainer_only


def test_the_checks_catch_disagreements() -> None:
    """The checks above fail, naming the option and the place, on a parameter, a default or a row that disagrees
    (so that their passing means something)."""

    def init(self, tp_size: int | None = None, *, tp_plan: str = "auto", fake_option: int = 0) -> None: ...

    problems = "\n".join(signature_problems(init, "fabric"))
    assert "`fake_option`: a parameter of tests/unit/test_options.py" in problems
    assert "`tp_plan`: type 'str'" in problems and "`dp_shard_size`: defined in" in problems

    def trainer_only(self, tp_size: int | None = 2, *, step_timeout: Any = "auto") -> None: ...

    problems = "\n".join(signature_problems(trainer_only, "fabric"))
    assert "`tp_size`: default 2" in problems and "`step_timeout`: Trainer-only" in problems

    table = "| argument | default | meaning |\n| --- | --- | --- |\n| `tp_size` | `1` | x |\n| `fake` | `0` | x |\n"
    problems = "\n".join(table_problems(table))
    assert "`tp_size`: docs/arguments.md's argument table shows the default `1`" in problems
    assert "`fake`: a row of" in problems and "`timeout`: no row in" in problems
    assert shown(timedelta(minutes=30)) == "timedelta(minutes=30)" and shown(("SIGTERM",)) == '("SIGTERM",)'
