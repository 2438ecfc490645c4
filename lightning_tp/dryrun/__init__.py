"""The dry run: a layout of any size simulated rank by rank in one process, through the real code, before renting
the GPUs (``python -m lightning_tp.plan``):

- ``record``: what a simulated rank does in a step, recorded as it runs (its collectives, its live bytes);
- ``engine``: one rank simulated: the real ``parallelize`` on a fake process group, one step on fake tensors;
- ``agreement``: the collectives of the simulated ranks compared group by group: a hang named before it happens;
- ``layouts``: the layouts of a number of GPUs, each simulated, ranked by fit and communication.

May import (checked by tests/unit/test_repo.py): ``compat``, ``composition``, ``patches``, ``layout``, ``state``,
``options``, ``plans``, ``parallel``, ``checkpoint``, ``parallel_options``, ``stages``, ``parallelize``.
"""

__all__ = ["agreement", "engine", "layouts", "record"]
