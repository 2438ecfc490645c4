"""Do the simulated ranks issue the same collectives? Each group's members must issue the same collectives (kind,
shapes, dtype) in the same order, and each send must meet its receive, or the job hangs. Compared rank by rank over
the runs of :func:`lightning_tp.dryrun.engine.simulate_rank`; the first difference is named as the hang it would be."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Sequence

from lightning_tp.dryrun.record import Call
from lightning_tp.layout import EXPERT_MESH_AXES, ParallelLayout

#: The point-to-point kinds: matched send to receive, not compared over a group.
POINT_TO_POINT = ("send", "recv")


class CollectiveMismatch(RuntimeError):
    """Two ranks of a group would issue different collectives at the same position: the job would hang there (or
    exchange the wrong bytes). Names both ranks, the group and the first differing call of each.

    Args:
        message: the description.
        ranks: the two ranks.
        index: the position in the group's sequence where they differ.
    """

    def __init__(self, message: str, *, ranks: tuple[int, int], index: int) -> None:
        super().__init__(message)
        self.ranks = ranks
        self.index = index


def _describe(call: Call | None) -> str:
    return call.describe() if call is not None else "nothing more (it has left the group's collectives)"


def check_agreement(runs: Iterable[tuple[int, Sequence[Call]]]) -> int:
    """Compare the collectives of the simulated ranks group by group; return how many groups had two or more
    simulated members.

    Args:
        runs: ``(rank, calls)`` of each simulated rank (:attr:`RankRun.calls <lightning_tp.dryrun.engine.RankRun>`).

    Raises:
        CollectiveMismatch: two members of a group differ (the first difference, in the order of the groups'
            smallest ranks), or a send has no matching receive on a simulated peer.
    """
    runs = dict(runs)
    sequences: dict[tuple[int, ...], dict[int, list[Call]]] = defaultdict(dict)
    for rank, calls in runs.items():
        for call in calls:
            if call.kind not in POINT_TO_POINT:
                sequences[call.group].setdefault(rank, []).append(call)
    compared = 0
    for group in sorted(sequences, key=lambda g: (min(g), len(g))):
        members = [rank for rank in sorted(group) if rank in runs]
        if len(members) < 2:
            continue
        compared += 1
        first = members[0]
        reference = sequences[group].get(first, [])
        for other in members[1:]:
            calls = sequences[group].get(other, [])
            for index in range(max(len(reference), len(calls))):
                mine = reference[index] if index < len(reference) else None
                theirs = calls[index] if index < len(calls) else None
                if mine is None or theirs is None or mine.signature != theirs.signature:
                    axis = (mine or theirs).axis
                    raise CollectiveMismatch(
                        f"Ranks {first} and {other} would hang: collective #{index + 1} on {axis} (ranks "
                        f"{list(group)}) differs. Rank {first} issues {_describe(mine)}; rank {other} issues "
                        f"{_describe(theirs)}. Every rank of a group must issue the same collectives in the same "
                        "order: a collective issued on some ranks only (decided from a rank's own data, say) waits "
                        "forever for the others.",
                        ranks=(first, other),
                        index=index,
                    )
    _check_point_to_point(runs)
    return compared


def _check_point_to_point(runs: dict[int, Sequence[Call]]) -> None:
    sent: dict[tuple[int, int], list[Call]] = defaultdict(list)
    received: dict[tuple[int, int], list[Call]] = defaultdict(list)
    for rank, calls in runs.items():
        for call in calls:
            if call.kind == "send" and call.peer is not None:
                sent[(rank, call.peer)].append(call)
            elif call.kind == "recv" and call.peer is not None:
                received[(call.peer, rank)].append(call)
    for source, target in sorted(sent.keys() | received.keys()):
        if source not in runs or target not in runs:
            continue
        sends, receives = sent.get((source, target), []), received.get((source, target), [])
        for index in range(max(len(sends), len(receives))):
            send = sends[index] if index < len(sends) else None
            receive = receives[index] if index < len(receives) else None
            if send is None or receive is None or send.shapes != receive.shapes or send.dtype != receive.dtype:
                raise CollectiveMismatch(
                    f"Ranks {source} and {target} would hang: message #{index + 1} from {source} to {target} does "
                    f"not meet its receive. Rank {source} issues {_describe(send)}; rank {target} issues "
                    f"{_describe(receive)}.",
                    ranks=(source, target),
                    index=index,
                )


def representative_ranks(layout: ParallelLayout, *, both_ends: bool = True) -> list[int]:
    """The ranks whose collectives decide agreement for ``layout`` without simulating every rank: rank 0 and the last
    rank, and on each axis (the mesh's and the expert mesh's) the ranks that differ from either of them in that
    coordinate alone, at the other end and next to it. Every group of rank 0 and of the last rank then has two or more
    simulated members, each of them at the first or the last position of the group and a neighbour of it.

    Args:
        layout: the sizes of every axis.
        both_ends: the last rank's groups too; ``False``: rank 0's only (fewer ranks, for a quick check).

    Raises:
        Nothing: every layout has these ranks.
    """
    last = layout.world_size - 1
    ranks = {0, last} if both_ends else {0}
    meshes = [(layout.mesh_axes, [getattr(layout, f"{axis}_size") for axis in layout.mesh_axes])]
    if layout.ep_size > 1:
        sizes = [layout.dp_replicate_size, layout.efsdp_size, layout.ep_size]
        meshes.append((EXPERT_MESH_AXES, sizes))
    for _, sizes in meshes:
        strides = [1] * len(sizes)
        for i in range(len(sizes) - 2, -1, -1):
            strides[i] = strides[i + 1] * sizes[i + 1]
        for size, stride in zip(sizes, strides, strict=True):
            for position in {1, size - 1}:
                if 0 < position < size:
                    ranks.add(position * stride)  # rank 0's neighbour and far end on this axis
                    if both_ends:
                        ranks.add(last - position * stride)  # the last rank's
    return sorted(ranks)
