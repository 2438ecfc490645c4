"""A rule of the composition table: a combination of features and its verdict, reason, fix and evidence.

The lowest layer: imports nothing of the package.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

#: What a rule decides: allowed (tested at parity), refused (a ``ValueError`` before anything moves), or ignored
#: (a warning: the setting has no effect in that layout).
Verdict = Literal["allowed", "refused", "ignored"]


@dataclass(frozen=True)
class Rule:
    """One combination and its verdict.

    Args:
        key: the rule's name, unique (``"pp+compile+split_backward"``).
        axes: the features combined (``"pp"``, ``"cp"``, ``"compile"``, ...): the tables it appears in.
        verdict: ``allowed``, ``refused`` or ``ignored``.
        when: the combination, in words (a table's first column).
        reason: how it works (allowed), or why it cannot (refused, ignored): the message's body.
        fix: what to do instead (refused, ignored).
        ranks: the process counts its tests run on (allowed).
        evidence: what shows it (allowed: the parity cases).

    Raises:
        ValueError: an unknown verdict, or a refusal without its fix.
    """

    key: str
    axes: tuple[str, ...]
    verdict: Verdict
    when: str
    reason: str
    fix: str = ""
    ranks: str = ""
    evidence: str = ""

    def __post_init__(self) -> None:
        if self.verdict not in ("allowed", "refused", "ignored"):
            raise ValueError(f"rule {self.key!r}: unknown verdict {self.verdict!r}")
        if self.verdict == "refused" and not self.fix:
            raise ValueError(f"rule {self.key!r}: a refusal names its fix")


__all__ = ["Rule", "Verdict"]
