"""What composes with what: one table of rules, each a combination of features (mesh axes, options, model traits)
with its verdict (``allowed``, ``refused``, ``ignored``), the reason and, where it is allowed, the evidence (the
parity cases). The checks read their messages from it (:func:`refusal`, :func:`problem`, :func:`ignored`): a check
names what was given, the rule says why and what to do. The rules are data in ``rules.py``; the documentation's
composition tables are rendered from it (:func:`render`; ``python -m lightning_tp.composition docs/*.md`` rewrites
the blocks between ``<!-- composition: NAME -->`` and ``<!-- /composition -->``, and tests/unit/test_composition.py
fails when a page differs from the table).

The lowest layer: imports nothing of the package.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path

from lightning_tp.composition.rule import Rule, Verdict
from lightning_tp.composition.rules import RULES

#: The rules by key.
BY_KEY: dict[str, Rule] = {rule.key: rule for rule in RULES}
assert len(BY_KEY) == len(RULES), "a rule's key is used twice"


def refusal(key: str, detail: str) -> ValueError:
    """The ``ValueError`` of refused rule ``key``: ``detail`` (the inputs, as given), its reason and its fix.

    Args:
        key: a refused rule's key.
        detail: what was given (names and values), the message's start.

    Raises:
        KeyError: an unknown key (an internal mistake, not a user's).
    """
    rule = BY_KEY[key]
    assert rule.verdict == "refused", key
    return ValueError(f"{detail}: {rule.reason} {rule.fix}")


def problem(key: str, detail: str) -> str:
    """Why a model cannot run as refused rule ``key`` says, as the end of a sentence that the check frames
    (``f"cp_size=2: {problem}."``): ``detail`` (the model, and what it has), the rule's reason and its fix.

    Args:
        key: a refused rule's key.
        detail: the model and what it has, the message's start.

    Raises:
        KeyError: an unknown key (an internal mistake, not a user's).
    """
    rule = BY_KEY[key]
    assert rule.verdict == "refused", key
    return f"{detail}: {rule.reason} {rule.fix}".removesuffix(".")


def ignored(key: str, setting: str, *, context: str = "") -> str:
    """The warning of ignored rule ``key``: ``setting`` (as given) is ignored (``context``: where), why, and the fix.

    Args:
        key: an ignored rule's key.
        setting: the setting as given, the message's start.
        context: the layout or precision it is ignored in, if the rule's reason does not say it.

    Raises:
        KeyError: an unknown key (an internal mistake, not a user's).
    """
    rule = BY_KEY[key]
    assert rule.verdict == "ignored", key
    return f"{setting} is ignored{' ' + context if context else ''}: {rule.reason} {rule.fix}"


#: The documentation's tables by name: the header, which rules are rows, and a row's cells.
_TABLES: dict[str, tuple[str, Callable[[Rule], bool], Callable[[Rule], tuple[str, ...]]]] = {
    "pp": (
        "| next to pp 2 | ranks | status | how |",
        lambda r: r.axes[0] == "pp" and r.verdict == "allowed",
        lambda r: (r.when, r.ranks, r.evidence, r.reason),
    ),
    "cp": (
        "| cp_comm | ranks | status | how |",
        lambda r: r.axes == ("cp",) and r.verdict == "allowed",
        lambda r: (r.when, r.ranks, r.evidence, r.reason),
    ),
    **{
        f"{axis}-refused": (
            f"| with {axis} | verdict | why | instead |",
            lambda r, axis=axis: axis in r.axes and r.verdict != "allowed",
            lambda r: (r.when, r.verdict, r.reason, r.fix),
        )
        for axis in ("pp", "cp", "ep", "sp", "tp")
    },
}


def render(name: str) -> str:
    """The markdown table named ``name`` (one of :data:`_TABLES`: ``"pp"``, what composes with pipeline parallelism;
    ``"cp"``, how context parallelism exchanges keys and values; ``"pp-refused"``, ``"cp-refused"``, ``"ep-refused"``,
    ``"sp-refused"``, ``"tp-refused"``, what each axis refuses or ignores), rendered from :data:`RULES`.

    Args:
        name: the table's name.

    Raises:
        ValueError: an unknown name.
    """
    if name not in _TABLES:
        raise ValueError(f"no composition table named {name!r}; the known ones: {sorted(_TABLES)}")
    header, is_row, cells = _TABLES[name]
    columns = header.count("|") - 1
    lines = [header, "|" + "---|" * columns]
    lines += ["| " + " | ".join(cells(rule)) + " |" for rule in RULES if is_row(rule)]
    return "\n".join(lines)


_BLOCK = re.compile(r"(<!-- composition: ([\w-]+) -->\n)(.*?)\n?<!-- /composition -->", re.DOTALL)


def rendered(text: str) -> str:
    """``text`` with each composition block's table rendered anew from :data:`RULES`.

    Args:
        text: a markdown page.

    Raises:
        ValueError: a block names an unknown table.
    """
    return _BLOCK.sub(lambda m: f"{m.group(1)}{render(m.group(2))}\n<!-- /composition -->", text)


def main(argv: list[str]) -> int:
    """``python -m lightning_tp.composition PAGE...``: rewrite the pages' composition blocks; print what changed."""
    for page in map(Path, argv):
        text = page.read_text()
        new = rendered(text)
        if new != text:
            page.write_text(new)
            print(f"{page}: composition tables rewritten")
    return 0


__all__ = ["BY_KEY", "RULES", "Rule", "Verdict", "ignored", "problem", "refusal", "render", "rendered"]
