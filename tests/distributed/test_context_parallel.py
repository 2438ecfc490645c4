"""Context parallelism for real: each sequence split over 2 gloo processes (cp 2), and over 4 (cp 2 x tp 2 with and
without sequence and loss parallelism, cp 2 x dp 2, a ring of cp 4), against one process training the whole
sequences; with the keys and values all-gathered and passed around a ring (`cp_comm="ring"`). The cases
live in tests/helpers/cases.py (``CP_CASES``, ``CP_2D_CASES``) and run in the folded launches of
tests/distributed/conftest.py."""

from __future__ import annotations

import pytest
import torch

from tests.helpers.cases import CASES, CP_2D_CASES, CP_CASES
from tests.helpers.models import PROBE
from tests.helpers.parity import assert_parity, reference_of, trained_logits_gap
from tests.helpers.selection import scenario_result as _result


def _probe_logits(name: str, state: dict) -> torch.Tensor:
    """The logits of the probe batch from the reference's trained weights, on one process."""
    model = CASES[name].module(reference=True)
    model.configure_model()
    model.model.load_state_dict(state)
    model.model.eval()
    with torch.no_grad():
        return model.model(input_ids=PROBE).logits


def _check(results: list[dict], name: str, *, dp_size: int) -> None:
    ref = reference_of(name)
    result = _result(results, name)
    assert_parity(result, ref, name)
    # Every rank reports the loss of the whole sequence (the ranks of a CP group hold the same one).
    assert all(r[name]["losses"] == result["losses"] for r in results[: len(results) // dp_size])
    # The data is split over the data-parallel ranks only: the ranks of a CP (and TP) group read the same rows.
    group = len(results) // dp_size
    assert [r[name]["sampler"] for r in results] == [
        {"num_replicas": dp_size, "rank": rank // group} for rank in range(len(results))
    ]
    # A forward without labels returns the whole sequence's logits on every rank: within fp32's bound of the
    # reference's trained weights' (tests/helpers/tolerances.py): the forward's roundings and the training's before
    # it, and the two runs' trained weights' gap.
    expected = _probe_logits(name, ref["state"])
    bound = trained_logits_gap(result, ref, expected, name)
    for r in results:
        torch.testing.assert_close(r[name]["split"]["logits"], expected, atol=bound, rtol=0)
    # FSDP2 shards every parameter over dp_shard x cp (the flattened axis), beside the TP axis.
    assert result["mesh_axes"] == [("dp_shard_cp", "tp")]
    # Tokens are counted once per data-parallel replica, not once per CP rank.
    throughput = result["split"]["throughput"]
    if dp_size == 1:
        assert throughput["tokens_per_sec"] == pytest.approx(throughput["tokens_per_sec_per_replica"])


@pytest.mark.parametrize("name", CP_CASES)
@pytest.mark.scenarios("tp2", "{name}")
def test_cp2_matches_single_process(tp2_results: list[dict], name: str) -> None:
    _check(tp2_results, name, dp_size=1)


@pytest.mark.parametrize("name", CP_2D_CASES)
@pytest.mark.scenarios("2d", "{name}")
def test_cp2_with_tp_or_data_parallelism_matches_single_process(two_d_results: list[dict], name: str) -> None:
    sizes = CASES[name].strategy_kwargs
    tp_size = sizes.get("tp_size")  # None: the ranks CP leaves
    dp_size = len(two_d_results) // (sizes["cp_size"] * tp_size) if tp_size else 1
    _check(two_d_results, name, dp_size=dp_size)


@pytest.mark.scenarios("tp2", "cp_rows_differ")
def test_ranks_of_a_cp_group_with_different_rows_raise_on_every_rank(tp2_results: list[dict]) -> None:
    """A loader that gives the two ranks of a CP group different rows: the first forward checks the batches (one
    all-gather of shape and checksum) and every rank raises the same error within seconds."""
    errors = [r["cp_rows_differ"] for r in tp2_results]
    for error in errors:
        assert error["type"] == "ValueError", error
        assert "the ranks of a CP group got different batches" in error["message"]
        assert "over the data-parallel ranks only" in error["message"]
        assert error["seconds"] < 30, error
    assert len({e["message"] for e in errors}) == 1
