"""No data-dependent hang, no silent divergence: uneven data, stalls, dying ranks, mismatched workers.

Every test launches real processes under horovodrun (Gloo and MPI) with a hard timeout
and asserts both the outcome and how long it took to end (well below the timeout). The
uneven-data and mismatch checks end normally, so they are scenarios of the shared launch
of their controller (`tests.launch.shared`), late in it; their time is the scenario's own
(the launch's start-up, 20-90 s on 2 shared cores, is no longer in it). The numbers in
docs/reliability.md ("Never hang") come from these runs.
"""

import os
import re
import tempfile
import time

import pytest

from tests.launch import horovodrun, results, run_ok, shared

CONTROLLERS = ["gloo", "mpi"]


def _timed(function, *args, **kwargs):
    start = time.monotonic()
    value = function(*args, **kwargs)
    return value, time.monotonic() - start


@pytest.mark.parametrize("controller", CONTROLLERS)
def test_uneven_shards_end_together_with_identical_weights(controller):
    # 64 and 48 training samples, 40 and 24 validation samples, batch 16
    found = shared(controller, "uneven_data")
    seconds = max(found[rank]["scenario_seconds"] for rank in (0, 1))
    assert seconds < 150, seconds  # 240 s for the whole launch before it was shared
    for mode in ("numpy", "dataset", "pydataset"):
        r0, r1 = found[0][mode], found[1][mode]
        assert r0["digest"] == r1["digest"], mode  # bit-identical on every rank
        assert r0["iterations"] == r1["iterations"] == 6, (mode, r0)  # min(4, 3) steps x 2 epochs
        assert r0["history"] == r1["history"], mode
        # the same weights as one process trained on the 3 common global batches per epoch
        assert r0["diff"] < 1e-5, (mode, r0)
        # validation and evaluate weigh every sample the same: equal to one process on all 64 samples
        assert r0["evaluation"] == r1["evaluation"], mode
        assert r0["evaluation_diff"] < 1e-5, (mode, r0)
        assert len(r0["history"]["val_loss"]) == 2
        # fit knows each epoch's length where the data has one (before, evened-out arrays were of unknown
        # length: no progress bar, no `params["steps"]`), and the evening-out adds no warning (a tf.data
        # pipeline of unknown length: None, and Keras' own warnings, that it ran out and that it ignores
        # fit's default shuffle=True, as plain Keras gives them)
        assert r0["epoch_steps"] == ([None, None] if mode == "dataset" else [3, 3]), (mode, r0["epoch_steps"])
        if mode != "dataset":
            assert not [w for w in r0["warnings"] if "shuffle" in w or "ran out" in w], (mode, r0["warnings"])
    r0, r1 = found[0]["numpy_shuffled"], found[1]["numpy_shuffled"]  # each rank reshuffles its shard each epoch
    assert r0["digest"] == r1["digest"] and r0["iterations"] == 6 and r0["epoch_steps"] == [3, 3], r0
    assert r0["diff"] > 1e-4, r0  # not the unshuffled order: the shuffle was kept
    assert not r0["warnings"], r0["warnings"]


def test_mismatched_workers_are_refused_before_any_collective():
    found = shared("gloo", "mismatch")
    seconds = max(found[rank]["scenario_seconds"] for rank in (0, 1))
    assert seconds < 90, seconds  # 180 s for the whole launch before it was shared
    for rank in (0, 1):
        messages = found[rank]["messages"]
        assert re.search(r"variable shapes: rank 0 has hidden/kernel \(8, 16\).*rank 1 has hidden/kernel \(8, 32\)",
                         messages["model"]), messages
        assert ("compile option 'boost.gradient_accumulation': rank 0 has null, rank 1 has "
                '{"max_accumulation_step": 2}') in messages["boost"], messages
        assert "fit argument 'batch_size': rank 0 has 16, rank 1 has 8" in messages["batch_size"], messages
        assert all(s < 5 for s in found[rank]["seconds"].values()), found[rank]["seconds"]
    assert found[0]["messages"] == found[1]["messages"]
    assert found[0]["digest"] == found[1]["digest"]  # and a correct fit afterwards still works


@pytest.mark.parametrize("controller", CONTROLLERS)
def test_a_stalled_worker_ends_the_job_within_the_timeout_naming_it(controller):
    stall = 10
    completed, seconds = _timed(horovodrun, "stalled_worker.py", controller=controller, args=["1"], timeout=300,
                                env={"KERAS_BOOST_STALL_TIMEOUT": str(stall)})
    out = completed.stdout
    assert completed.returncode != 0, out[-4000:]
    starts = [float(t) for t in re.findall(r"starts fit at ([0-9.]+)", out)]
    assert len(starts) == 2, out[-4000:]
    if controller == "gloo":  # keras_boost's watchdog: Horovod's stall inspector does not fire under Gloo
        assert "keras_boost: stall: rank(s) [1] stopped calling collectives" in out, out[-4000:]
        # each rank's position, with its host
        assert re.search(r"rank 1 on \S+: in callbacks or user code before train step 3 of epoch 1", out), out[-4000:]
    else:  # Horovod's stall inspector names the missing rank and the tensors, then shuts down
        assert re.search(r"Missing ranks:\s*\n\S*1!?: \[\S*keras_boost\.(eager\.)?allreduce", out), out[-4000:]
        if "stalled for longer than 10 seconds. Will shutdown" in out:
            assert re.search(r"keras_boost: lost: rank 0 of 2 on \S+: a collective of fit was abandoned", out), \
                out[-4000:]
        else:  # Horovod's shutdown came late on a loaded machine: keras_boost's watchdog (its backstop) ended it
            assert re.search(r"keras_boost: stall: rank 0 of 2 on \S+ has been in train step 3 of epoch 1 .* ending the job",
                             out), out[-4000:]
    # from the moment rank 1 stopped to the end of the job: the timeout, plus Horovod's check
    # period under MPI (5 s here), plus the launcher's clean-up (slow on a loaded machine)
    stalled_at = float(re.search(r"sleeps at train step 2 at ([0-9.]+)", out).group(1))
    ended_after = time.time() - stalled_at
    print(f"{controller}: stall to end of job {ended_after:.1f} s, launch {seconds:.1f} s")
    assert stall <= ended_after < stall + 25, ended_after
    assert seconds < 240, seconds  # start-up (TensorFlow, model): 20-90 s on 2 shared cores


@pytest.mark.parametrize("controller", CONTROLLERS)
def test_rank_zero_killed_without_elastic_ends_non_zero_naming_it(controller):
    completed, seconds = _timed(horovodrun, "killed_worker.py", controller=controller, args=["0"], timeout=240)
    out = completed.stdout
    assert completed.returncode != 0
    if controller == "gloo":
        assert re.search(r"Process name: 0\s+Exit code: 137", out), out[-4000:]
    else:
        assert "process rank 0" in out, out[-4000:]
    killed_at = float(re.search(r"kills itself at ([0-9.]+)", out).group(1))
    ended_after = time.time() - killed_at
    print(f"{controller}: kill to end of job {ended_after:.1f} s, launch {seconds:.1f} s")
    assert ended_after < 20, ended_after
    assert seconds < 180, seconds


def test_rank_zero_killed_under_elastic_the_survivor_goes_on():
    from tests.test_elastic import _horovodrun_elastic

    work = tempfile.mkdtemp(prefix="kb_elastic0_")
    env = {"KB_RESULT_DIR": os.path.join(work, "results"), "KB_ELASTIC_MARKER": os.path.join(work, "died"),
           "KB_ELASTIC_EPOCHS": "4", "KB_ELASTIC_KILL_AT": "20", "KB_ELASTIC_KILL_RANK": "0",
           "KB_ELASTIC_ALONE": "6", "KB_ELASTIC_WAIT_S": "90"}
    os.makedirs(env["KB_RESULT_DIR"])
    completed, seconds = _timed(_horovodrun_elastic, env, timeout=240)
    out = completed.stdout[-6000:]
    assert completed.returncode == 0, out
    assert "rank 0 (pid" in completed.stdout and "kills itself" in completed.stdout, out
    found = results(completed)
    assert sorted(found) == [0, 1], out
    survivor, joiner = found[0], found[1]  # the old rank 1 is rank 0 now; a new worker joined
    assert not survivor["joined_late"] and joiner["joined_late"], found
    for rank in (0, 1):
        assert found[rank]["epochs"] == 4
        assert found[rank]["reference_diff"] < 1e-4, found[rank]  # exactly the committed batches
        assert found[rank]["iterations"] == len(found[rank]["log"])
    assert survivor["digest"] == joiner["digest"]
    assert {samples for _, samples in survivor["log"]} == {16, 32}, survivor["log"]
    assert seconds < 200, seconds


def test_rank_zero_killed_while_writing_a_backup_resumes_from_the_last_whole_one():
    backup = tempfile.mkdtemp(prefix="kb_backup_")
    crashed, seconds = _timed(horovodrun, "checkpoint_kill.py", controller="gloo", args=["crash", backup],
                              timeout=240)
    out = crashed.stdout
    assert crashed.returncode != 0
    assert "rank 0 dies while writing partial.weights.h5" in out, out[-4000:]
    assert re.search(r"Process name: 0\s+Exit code: 137", out), out[-4000:]
    ended_after = time.time() - float(re.search(r"bytes\) at ([0-9.]+)", out).group(1))
    print(f"kill during the write to end of job {ended_after:.1f} s, launch {seconds:.1f} s")
    assert ended_after < 20, ended_after
    assert seconds < 180, seconds
    found, seconds = _timed(run_ok, "checkpoint_kill.py", controller="gloo", args=["resume", backup], timeout=240)
    for rank in (0, 1):
        assert found[rank]["epochs"] == [2, 3], found[rank]  # epochs 0 and 1 were backed up whole
        assert found[rank]["resumed"] == found[rank]["uninterrupted"]  # bit-identical to no crash at all
    assert found[0]["resumed"] == found[1]["resumed"]
    assert seconds < 180, seconds
