"""Gradient accumulation on 2 real Horovod workers (Gloo and MPI), launched with horovodrun
(a scenario of the shared launch of each controller, `tests.launch.shared`)."""

import pytest

from tests.launch import shared

CONTROLLERS = ["gloo", "mpi"]


@pytest.mark.parametrize("controller", CONTROLLERS)
def test_two_workers_accumulating_equal_one_process(controller):
    found = shared(controller, "accumulation_equivalence")
    assert found[0]["size"] == 2

    # N=2 x 16 per worker on 2 workers == batch 64 in one process; 256 samples x 2 epochs
    eq = [found[r]["equivalence"] for r in (0, 1)]
    for phase in eq:
        assert phase["diff"] < 1e-5, phase
        assert phase["micro_batches"] == 16
        assert phase["iterations"] == 8  # one update per window
        assert phase["collectives"] == phase["iterations"]  # exactly one collective per update
    assert eq[0]["digest"] == eq[1]["digest"]  # bit-identical weights on every rank
    assert eq[0]["loss"] == eq[1]["loss"]  # epoch logs averaged across workers

    # 3 micro-batches per epoch with N=2: the second window spans the epoch end
    carry = [found[r]["carry"] for r in (0, 1)]
    for phase in carry:
        assert phase["diff"] < 1e-5, phase
        assert phase["at_epoch_end"] == [[1, 1], [3, 0]]
        assert phase["iterations"] == phase["collectives"] == 3
    assert carry[0]["digest"] == carry[1]["digest"]

    # an inf on rank 1 only, in the first window: every rank drops that whole window
    over = [found[r]["overflow"] for r in (0, 1)]
    for phase in over:
        assert phase["overflows"] == [0, 1, 1, 0, 0, 0], phase
        assert phase["scales"] == [1024.0, 512.0, 512.0, 512.0, 512.0, 512.0]
        assert phase["iterations"] == [0, 0, 0, 1, 1, 2]
        assert phase["collectives"] == 3  # one per window, the dropped one included
        assert phase["micro_step"] == 0 and phase["accumulators_finite"]
        assert phase["diff"] < 1e-5, phase  # == the two clean windows as batches of 64
    assert over[0]["digest"] == over[1]["digest"]
