"""``torchrun --standalone`` for the suite's own workers, importing torch, Lightning and Transformers once per launch.

Usage: ``python -m tests.helpers.forkrun NPROCS SCRIPT [ARGS...]``

Each process torchrun starts imports torch, Lightning (3.5 s of the 4.5 s) and Transformers anew; on this project's
2-core machines four processes importing at once take 10.7 s, eight 19 s, against 4.5 s for one. This launcher imports
them once, then forks one process per rank and runs the script in each as ``__main__`` with the environment torchrun
gives its workers (``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ``LOCAL_WORLD_SIZE``, ``GROUP_RANK``, ``MASTER_ADDR``,
``MASTER_PORT``, ``TORCHELASTIC_RUN_ID``, ...), so Lightning detects torchelastic and the process group starts from
the environment exactly as under torchrun. The one value read from the environment at import time (Lightning's
``rank_zero_only.rank``) is set in each child as its import would have.

Like torchrun, the first rank that fails ends the others (SIGTERM, then SIGKILL), and the launcher's exit status is
non-zero; a launcher told to stop (SIGTERM, SIGHUP) or failing itself ends its ranks the same way. The tripwire of
:mod:`tests.helpers.launch` reaches the ranks as before: they are this process's children.

Only the suite's parity workers run this way. What a user launches (the examples, the tripwire's own test, the
fault, preemption and multi-node workers) keeps the real torchrun.
"""

from __future__ import annotations

import os
import runpy
import signal
import socket
import sys
import time
import uuid
from pathlib import Path

#: Seconds the other ranks get to end after the first failure, before SIGKILL.
GRACE_S = 10


def _free_port() -> int:
    """A port nothing listens on now. Rank 0's store binds it a moment later: another process could take it in
    between (torchrun's agent holds its own store instead), a risk the suite, which runs one launch at a time, takes."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("", 0))
        return sock.getsockname()[1]


def _child(rank: int, nprocs: int, port: int, run_id: str, script: Path, args: list[str]) -> None:
    """Become rank ``rank``: torchrun's environment, then the script as ``__main__``; never returns."""
    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # a rank ends on SIGTERM as under torchrun, not as its launcher
    signal.signal(signal.SIGHUP, signal.SIG_DFL)
    os.environ.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(nprocs),
        LOCAL_WORLD_SIZE=str(nprocs),
        GROUP_RANK="0",
        GROUP_WORLD_SIZE="1",
        ROLE_RANK=str(rank),
        ROLE_WORLD_SIZE=str(nprocs),
        ROLE_NAME="default",
        MASTER_ADDR="localhost",
        MASTER_PORT=str(port),
        TORCHELASTIC_RUN_ID=run_id,
        TORCHELASTIC_RESTART_COUNT="0",
        TORCHELASTIC_MAX_RESTARTS="0",
        TORCHELASTIC_USE_AGENT_STORE="False",  # no agent: rank 0 hosts the store, as a plain env:// start does
        TORCH_NCCL_ASYNC_ERROR_HANDLING="1",
    )
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    from lightning_utilities.core.rank_zero import rank_zero_only

    rank_zero_only.rank = rank  # what Lightning's import reads from RANK
    sys.argv = [str(script), *args]
    sys.path.insert(0, str(script.parent))  # as `python script` puts the script's folder first
    status: int | str | None = 0
    try:
        runpy.run_path(str(script), run_name="__main__")
    except SystemExit as end:
        status = end.code
    except BaseException:
        import traceback

        traceback.print_exc()
        status = 1
    sys.stdout.flush()
    sys.stderr.flush()
    raise SystemExit(status)  # unwinds to the interpreter's exit: atexit handlers run as in any process


def main(argv: list[str]) -> int:
    nprocs, script, args = int(argv[0]), Path(argv[1]).resolve(), argv[2:]
    os.environ.setdefault("OMP_NUM_THREADS", "1")  # before the imports: thread pools are sized when they load
    # What every worker imports, once, before forking. Nothing here starts a thread or a computation (OpenMP's pool
    # starts with the first parallel operation), so forking is safe.
    import lightning.pytorch  # noqa: F401
    import torch.distributed  # noqa: F401
    import transformers  # noqa: F401

    import lightning_tp  # noqa: F401

    port, run_id = _free_port(), uuid.uuid4().hex
    sys.stdout.flush()
    sys.stderr.flush()
    ranks: dict[int, int] = {}

    def ended(signum: int, _frame: object) -> None:  # the launcher told to stop: the ranks stop with it (finally)
        raise SystemExit(128 + signum)

    launcher = os.getpid()
    signal.signal(signal.SIGTERM, ended)
    signal.signal(signal.SIGHUP, ended)
    try:
        for rank in range(nprocs):
            pid = os.fork()
            if pid == 0:
                _child(rank, nprocs, port, run_id, script, args)  # ends in SystemExit, through the finally below
            ranks[pid] = rank
        return _wait(ranks)
    finally:
        if os.getpid() == launcher:  # not in a rank leaving: its copy of `ranks` lists its older siblings
            signal.signal(signal.SIGTERM, signal.SIG_IGN)  # ending already: a second signal must not cut it short
            signal.signal(signal.SIGHUP, signal.SIG_IGN)
            _end(ranks, grace=GRACE_S)


def _wait(ranks: dict[int, int]) -> int:
    """Wait for every rank; at the first that fails, SIGTERM the others (as torchrun does). The exit status: 0, or
    the first failure's (128 + the signal for a rank a signal ended)."""
    status = 0
    while ranks:
        pid, wait_status = os.wait()
        code = os.waitstatus_to_exitcode(wait_status)
        rank = ranks.pop(pid)
        if code != 0 and status == 0:
            status = code if code > 0 else 128 - code
            print(f"forkrun: rank {rank} (pid {pid}) failed with {code}; ending the others", file=sys.stderr)
            _end(ranks, grace=GRACE_S)
    return status


def _end(ranks: dict[int, int], *, grace: float) -> None:
    """SIGTERM to the ranks still running, then SIGKILL to those left after ``grace`` seconds; reaps them all."""
    for pid in ranks:
        try:
            os.kill(pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + grace
    while ranks:
        pid, _ = os.waitpid(-1, os.WNOHANG)
        if pid:
            ranks.pop(pid, None)
            continue
        if time.monotonic() > deadline:
            for other in ranks:
                try:
                    os.kill(other, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            deadline = float("inf")
        time.sleep(0.05)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
