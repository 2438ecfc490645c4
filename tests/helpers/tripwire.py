"""Hang tripwire for multi-process tests: a hang fails in about two minutes with every rank's stack.

Call :func:`worker_setup` once, first thing, in any script run by :func:`tests.helpers.launch.torchrun` (or by
``run_script``)::

    from tests.helpers.tripwire import worker_setup

    TIMEOUT = worker_setup()  # faulthandler on; every TensorParallelStrategy built afterwards gets TIMEOUT

It turns on ``faulthandler`` for every thread (a fatal signal prints each thread's stack), and makes ``TIMEOUT`` (from
the launcher's ``LIGHTNING_TP_TEST_TIMEOUT``, 120 s by default) the default ``timeout`` of every
``TensorParallelStrategy`` built afterwards in this process, so a collective that one rank never joins raises after it
instead of waiting out gloo's 30 minutes. Pass ``timeout=TIMEOUT`` explicitly where a strategy gets other keyword
arguments from a table, or a longer one where a test waits on purpose. A hang outside any collective is caught by the
launcher: at its own timeout it sends SIGABRT to every process it started, and faulthandler prints their stacks.
"""

from __future__ import annotations

import faulthandler
import gc
import os
from datetime import timedelta

#: Seconds of the process-group timeout that the launcher hands to its workers.
TIMEOUT_ENV = "LIGHTNING_TP_TEST_TIMEOUT"
DEFAULT_TIMEOUT_S = 120


def tripwire_timeout() -> timedelta:
    """The process-group timeout for strategies built in a test worker."""
    return timedelta(seconds=float(os.environ.get(TIMEOUT_ENV, DEFAULT_TIMEOUT_S)))


def worker_setup() -> timedelta:
    """Turn on stack dumps and the short timeout in this process (idempotent); return the timeout."""
    faulthandler.enable(all_threads=True)
    # What the imports made is frozen, as a long-lived user process may do: the strategy's GarbageCollection leaves a
    # user's freeze alone, so each fit's first collection scans only what the cases made since (a full scan of
    # torch, Transformers and Lightning costs about 0.3 s per fit and process: a minute of the suite's launches).
    gc.freeze()
    timeout = tripwire_timeout()
    from lightning_tp import TensorParallelStrategy

    # The default of the keyword-only `timeout` argument, for this test process only: every strategy a worker (or a
    # LightningCLI config) builds without its own timeout then fails fast instead of hanging.
    from lightning_tp.strategies.fabric import TensorParallelStrategy as FabricStrategy

    TensorParallelStrategy.__init__.__kwdefaults__["timeout"] = timeout
    FabricStrategy.__init__.__kwdefaults__["timeout"] = timeout
    return timeout
