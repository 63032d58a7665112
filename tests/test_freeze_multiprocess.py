"""Gradient freeze on 2 real Horovod workers (Gloo and MPI), launched with horovodrun
(a scenario of the shared launch of each controller, `tests.launch.shared`)."""

import pytest

from tests.launch import shared


@pytest.mark.parametrize("controller", ["gloo", "mpi"])
def test_freeze_training_agrees_across_workers(controller):
    found = shared(controller, "freeze_training")
    first, second = found[0], found[1]
    # the same schedule on every rank: GradientFreeze's seeded sequence, step by step
    assert first["groups"] == second["groups"] == first["expected"] == second["expected"]
    assert len(set(first["groups"])) >= 3 and 0 in first["groups"]  # full and frozen steps
    assert first["digest"] == second["digest"]  # bit-identical trainable weights
    assert first["history"] == second["history"]
    # the groups after the first were traced in the background on both workers (their
    # collectives named alike whichever thread traced them, or the steps would not pair)
    assert first["traced_ahead"] and second["traced_ahead"]
    # and set up on an empty iterator, one worker at a time: no collective ran there
    assert first["set_up_ahead"] and second["set_up_ahead"]
    assert first["iterations"] == second["iterations"] == 18
    # one fused allreduce per update (only the group's gradients), plus the epoch-log averages
    assert first["collectives"] == second["collectives"] == 18
    for result in (first, second):
        # every step on every worker: the frozen variables and their momentum slots are
        # bit-identical across the step, and every variable of the trained group moved
        assert all(result["frozen_untouched"]), result["frozen_untouched"]
        assert all(result["trained_moved"]), result["trained_moved"]
        frozen_steps = [count for group, count in zip(result["groups"], result["frozen_counts"]) if group]
        assert len(frozen_steps) >= 3 and all(count > 0 for count in frozen_steps)
        assert result["finite"]
        assert result["after"] < 0.7 * result["before"], result
    assert first["history"][-1] < first["history"][0]
