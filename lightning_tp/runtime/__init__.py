"""What runs beside training: preemption (save and exit when the scheduler says so), the step watchdog (a stuck rank
dumps its stack and exits), garbage collection at the same step on every rank, throughput and memory monitors, the
weights handed to an inference engine in another process.

May import (checked by tests/unit/test_repo.py): ``compat``, ``composition``, ``patches``, ``layout``, ``state``,
``options``, ``plans``, ``parallel``, ``checkpoint``.
"""

__all__ = ["garbage_collection", "monitor", "preemption", "watchdog", "weight_sync"]
