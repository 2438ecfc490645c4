"""The upstream shims (lightning_tp/compat.py)."""

from datetime import timedelta

from lightning_tp import compat


def test_distributed_is_initialized_without_a_process_group():
    assert compat.distributed_is_initialized() is False


def test_group_options_carry_the_timeout():
    options = compat.group_options("gloo", timedelta(seconds=7))
    assert options._timeout == timedelta(seconds=7)
