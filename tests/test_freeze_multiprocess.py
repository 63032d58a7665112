"""Gradient freeze on 2 real Horovod workers (Gloo and MPI), launched with horovodrun."""

import pytest

from tests.launch import run_ok


@pytest.mark.parametrize("controller", ["gloo", "mpi"])
def test_freeze_training_agrees_across_workers(controller):
    found = run_ok("freeze_training.py", np=2, controller=controller, timeout=120)
    first, second = found[0], found[1]
    # the same schedule on every rank: GradientFreeze's seeded sequence, step by step
    assert first["groups"] == second["groups"] == first["expected"] == second["expected"]
    assert len(set(first["groups"])) >= 3 and 0 in first["groups"]  # full and frozen steps
    assert first["digest"] == second["digest"]  # bit-identical trainable weights
    assert first["history"] == second["history"]
    assert first["iterations"] == second["iterations"] == 18
    # one fused allreduce per update (only the group's gradients), plus the epoch-log averages
    assert first["collectives"] == second["collectives"] == 18
    for result in (first, second):
        assert result["finite"]
        assert result["after"] < 0.7 * result["before"], result
    assert first["history"][-1] < first["history"][0]
