"""Elastic training of a BoostModel (keras_boost.elastic).

The single-process tests check the state object, the commit callback, the data shards
and the recipe without a launcher. The elastic test runs real `horovodrun` in elastic
mode (Gloo, --min-np 1 --max-np 2, a host-discovery script) on this machine: a worker is
SIGKILLed in the middle of an epoch, training goes on with one worker, Horovod lets the
failed "host" back in after its blacklist cool-down and a new worker joins; the run must
finish with the requested epochs, identical weights on both workers, and weights equal
to a plain Keras model that replays exactly the committed batches (nothing lost twice,
nothing applied twice). The elastic run is repeated with AdaSum(device_number=1). 35-70 s
per run on 2 cores; every launch has a hard timeout.
"""

import os
import shutil
import signal
import subprocess
import sys
import tempfile

import keras
import numpy as np
import pytest

from keras_boost import BoostModel
from keras_boost.fit import elastic
from tests.helpers import classification_data, compile_sgd, mlp
from tests.launch import ROOT, WORKERS, horovod_build_env, horovodrun_command, results

DISCOVERY = WORKERS / "elastic_discover.sh"


def _variables(model):
    return [np.array(v) for v in list(model.variables) + list(model.optimizer.variables)]


# ------------------------------------------------------------ single process
def test_state_restores_model_optimizer_and_boost_state():
    x, y = classification_data(n=64)
    model = compile_sgd(mlp(BoostModel), loss_scale="dynamic", gradient_accumulation=2)
    state = elastic.BoostModelState(model, best=1.0)
    names = {v.path for v in state.variables}
    assert {"hidden/kernel", model.optimizer.iterations.path, "boost_state/loss_scale_scale",
            "boost_state/accumulation_micro_step"} <= names  # the optimizer's name depends on earlier tests
    assert (state.epoch, state.batch, state.samples, state.history, state.best) == (0, 0, 0, {}, 1.0)

    model.fit(x, y, batch_size=8, epochs=1, verbose=0)  # 8 micro-steps, 4 updates
    state.epoch, state.best = 1, 0.5
    state.commit()
    committed = _variables(model)
    model.fit(x[:24], y[:24], batch_size=8, epochs=1, verbose=0)  # 3 micro-steps: mid-window
    state.epoch, state.best = 2, 0.25
    assert any(np.any(a != b) for a, b in zip(committed, _variables(model)))

    state.restore()
    for a, b in zip(committed, _variables(model)):
        np.testing.assert_array_equal(a, b)
    assert (state.epoch, state.best) == (1, 0.5)
    assert int(model.optimizer.iterations.numpy()) == 4


def test_state_needs_a_built_compiled_model():
    with pytest.raises(ValueError, match="compiled"):
        elastic.BoostModelState(mlp(BoostModel))

    class Sub(BoostModel):
        def __init__(self):
            super().__init__()
            self.dense = keras.layers.Dense(2)

        def call(self, x):
            return self.dense(x)

    model = Sub()
    model.compile(optimizer="sgd", loss="mse")
    with pytest.raises(ValueError, match="built"):
        elastic.BoostModelState(model)


def test_reset_drops_the_compiled_functions():
    x, y = classification_data(n=32)
    model = compile_sgd(mlp(BoostModel))
    state = elastic.BoostModelState(model)
    model.fit(x, y, batch_size=8, epochs=1, verbose=0, shuffle=False)
    first_function = model.train_function
    assert first_function is not None
    state.on_reset()
    assert model.train_function is None and state.resets == 1
    model.fit(x, y, batch_size=8, epochs=1, verbose=0, shuffle=False)  # retraces
    assert model.train_function is not None and model.train_function is not first_function
    # the retraced step goes on from the same weights and optimizer state: two epochs of plain Keras
    assert int(model.optimizer.iterations.numpy()) == 8
    reference = compile_sgd(mlp(keras.Model))
    reference.fit(x, y, batch_size=8, epochs=2, verbose=0, shuffle=False)
    for a, b in zip(model.get_weights(), reference.get_weights()):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_commit_callback_counts_batches_samples_and_epochs():
    x, y = classification_data(n=64)
    model = compile_sgd(mlp(BoostModel))
    state = elastic.BoostModelState(model)
    commits = []
    original = state.save
    state.save = lambda: (commits.append((state.epoch, state.batch)), original())
    callback = elastic.CommitStateCallback(state, batches_per_commit=3, samples_per_batch=16)
    model.fit(x, y, batch_size=16, epochs=2, verbose=0, callbacks=[callback])
    # 4 batches per epoch: a commit after batch 3 and one at each epoch end
    assert commits == [(0, 3), (1, 0), (1, 3), (2, 0)]
    assert (state.epoch, state.batch, state.samples) == (2, 0, 0)
    assert len(state.history["loss"]) == 2
    with pytest.raises(ValueError):
        elastic.CommitStateCallback(state, batches_per_commit=0)


def test_epoch_shards_cover_the_global_batches_and_resume():
    n, batch = 100, 4
    order = elastic.epoch_shard(n, 3, 0, 1, 0, 1, seed=5)
    assert sorted(order) == list(range(n))
    shards = [elastic.epoch_shard(n, 3, 0, batch, r, 2, seed=5) for r in (0, 1)]
    # 12 global batches of 8; rank r has rows r*4:(r+1)*4 of each
    assert all(len(s) == 12 * batch for s in shards)
    for step in range(12):
        together = np.concatenate([s[step * batch:(step + 1) * batch] for s in shards])
        np.testing.assert_array_equal(together, order[step * 8:(step + 1) * 8])
    # resuming after 40 samples with one worker: the rest of the same order
    np.testing.assert_array_equal(elastic.epoch_shard(n, 3, 40, batch, 0, 1, seed=5), order[40:100])
    np.testing.assert_array_equal(elastic.epoch_shard(n, 0, 0, 1, 0, 1, shuffle=False), np.arange(n))


def test_fit_elastic_in_one_process_is_plain_fit():
    x, y = classification_data(n=96)
    model = compile_sgd(mlp(BoostModel))
    history = elastic.fit_elastic(model, x, y, batch_size=16, epochs=3, batches_per_commit=2, shuffle=False)
    reference = compile_sgd(mlp(keras.Model))
    expected = reference.fit(x, y, batch_size=16, epochs=3, shuffle=False, verbose=0)
    for a, b in zip(model.get_weights(), reference.get_weights()):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(history["loss"], expected.history["loss"], rtol=1e-5)
    assert len(history["accuracy"]) == 3


def test_fit_elastic_resumes_inside_an_epoch():
    x, y = classification_data(n=96)
    model = compile_sgd(mlp(BoostModel))
    state = elastic.BoostModelState(model)
    state.epoch, state.samples = 1, 32  # as if restored: epoch 0 and 2 batches of epoch 1 done
    elastic.fit_elastic(model, x, y, state, batch_size=16, epochs=2, shuffle=False)
    assert int(model.optimizer.iterations.numpy()) == 4  # the 4 batches left of epoch 1
    assert (state.epoch, state.samples) == (2, 0)
    with pytest.raises(TypeError):
        elastic.fit_elastic(model, x, y, state, batch_size=16, epochs=2, initial_epoch=1)


def test_run_without_launcher_calls_once():
    model = compile_sgd(mlp(BoostModel))
    state = elastic.BoostModelState(model)
    calls = []
    assert elastic.run(lambda s, v: calls.append(v) or v)(state, 7) == 7
    assert calls == [7]
    assert not elastic.elastic_launch()


def test_only_horovod_failures_are_restored():
    import tensorflow as tf

    trace = 'Graph execution error:\n\nDetected at node x defined at:\n  File "/v/horovod/common/elastic.py", line 1\n'
    failed = tf.errors.UnknownError(None, None, trace + "Horovod has been shut down. This was caused by ...")
    gloo = tf.errors.UnknownError(None, None, "[gloo/transport/tcp/pair.cc:589] Read error: Connection reset")
    other = tf.errors.InvalidArgumentError(None, None, trace + "Matrix size-incompatible: In[0]: [2,3]")
    assert elastic._is_horovod_failure(failed) and elastic._is_horovod_failure(gloo)
    assert not elastic._is_horovod_failure(other)  # a horovod path in the traceback is not enough
    assert not elastic._is_horovod_failure(ValueError("Horovod"))


# -------------------------------------------------------------- elastic run
def _horovodrun_elastic(env, timeout):
    cmd = [*horovodrun_command(), "-np", "2", "--min-np", "1",
           "--max-np", "2", "--host-discovery-script", f"sh {DISCOVERY}", "--blacklist-cooldown-range", "1", "2",
           "--gloo", "--start-timeout", "60", "--elastic-timeout", "60",
           sys.executable, str(WORKERS / "elastic_train.py")]
    full_env = dict(os.environ)
    full_env.update({"PYTHONPATH": str(ROOT), "TF_CPP_MIN_LOG_LEVEL": "2", "PYTHONUNBUFFERED": "1",
                     # a collective that never completes becomes an error instead of a hang
                     "HOROVOD_STALL_SHUTDOWN_TIME_SECONDS": "60",
                     # a joining worker imports TensorFlow before it reaches the rendezvous: more
                     # than Gloo's default 30 s on a loaded 2-core machine (seen: both runs aborted)
                     "HOROVOD_GLOO_TIMEOUT_SECONDS": "120",
                     **horovod_build_env()})
    full_env.update(env)
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=full_env,
                            start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        raise AssertionError(f"elastic run timed out after {timeout} s:\n{out[-6000:]}")
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # no stray worker survives the test
        except ProcessLookupError:
            pass
    completed = subprocess.CompletedProcess(cmd, proc.returncode, out, None)
    completed.result_dir = env["KB_RESULT_DIR"]
    return completed


HOROVOD_LOST_ERROR = "Horovod background loop uncaught exception"


@pytest.mark.parametrize("adasum", [False, True], ids=["average", "adasum"])
def test_training_survives_a_dying_worker_and_one_joining(adasum):
    work = tempfile.mkdtemp(prefix="kb_elastic_")
    env = {"KB_RESULT_DIR": os.path.join(work, "results"), "KB_ELASTIC_MARKER": os.path.join(work, "died"),
           "KB_ELASTIC_EPOCHS": "5", "KB_ELASTIC_KILL_AT": "22", "KB_ELASTIC_ALONE": "8", "KB_ELASTIC_WAIT_S": "90",
           "KB_ELASTIC_ADASUM": "1" if adasum else "0"}
    os.makedirs(env["KB_RESULT_DIR"])
    completed = _horovodrun_elastic(env, timeout=170)
    if completed.returncode != 0 and HOROVOD_LOST_ERROR in completed.stdout:
        # A Horovod 0.28.1 defect (seen here once, in a full suite run): the Gloo read error of the
        # dying peer is raised in Horovod's background loop ("uncaught exception") and never reaches the
        # survivor's pending collective, so there is no HorovodInternalError to reset on. What
        # keras_boost owes then is no hang: its watchdog ends the job, naming the silent rank.
        # Then the scenario runs once more, from scratch.
        assert "keras_boost: stall:" in completed.stdout and "nothing heard from rank 1" in completed.stdout, \
            completed.stdout[-6000:]
        shutil.rmtree(work, ignore_errors=True)
        os.makedirs(env["KB_RESULT_DIR"])
        completed = _horovodrun_elastic(env, timeout=170)
    out = completed.stdout[-6000:]
    assert completed.returncode == 0, out
    assert os.path.exists(env["KB_ELASTIC_MARKER"]), out  # the worker did die
    assert "kills itself" in completed.stdout and "a collective failed" in completed.stdout, out
    found = results(completed)
    assert sorted(found) == [0, 1], out  # a worker joined: two at the end
    first, joiner = found[0], found[1]
    assert not first["joined_late"] and joiner["joined_late"], found
    assert first["resets"] >= 2, found  # the failure and the join
    for rank in (0, 1):
        assert found[rank]["size"] == 2
        assert found[rank]["epochs"] == 5
        losses = found[rank]["history"]["loss"]
        assert len(losses) == 5 and all(np.isfinite(losses)), losses
        assert losses[-1] < 0.5 * losses[0], losses
        if adasum:
            # AdaSum's stage was rebuilt for the two workers that finished: one group each
            assert found[rank]["adasum_groups"] == 2, found[rank]
        else:
            # the weights are those of exactly the committed batches: none lost twice, none repeated
            assert found[rank]["reference_diff"] < 1e-4, found[rank]
        assert found[rank]["iterations"] == len(found[rank]["log"])
    if adasum:
        # AdaSum's local step uses each worker's own gradients (a group of one averages nothing),
        # so the momentum slots are per worker by design (as in MindSpore); the weights agree
        assert first["weights_digest"] == joiner["weights_digest"]
        assert first["digest"] != joiner["digest"]
    else:
        assert first["digest"] == joiner["digest"]  # weights and optimizer state bit-identical
    assert first["log"] == joiner["log"] and first["history"] == joiner["history"]
    batch_sizes = {samples for _, samples in first["log"]}
    assert batch_sizes == {16, 32}, first["log"]  # trained with one worker and with two
    # each epoch covers its data once (an incomplete last global batch may be dropped)
    per_epoch = {}
    for epoch, samples in first["log"]:
        per_epoch[epoch] = per_epoch.get(epoch, 0) + samples
    assert sorted(per_epoch) == [0, 1, 2, 3, 4]
    assert all(512 - 32 < total <= 512 for total in per_epoch.values()), per_epoch
