"""Gradient freeze inside the boost step, in one process.

What a frozen step does to variables and optimizer state (against a manual reference),
the schedule and its checkpointed position, steps_per_execution, tracing, loss scaling,
accumulation, the pruned backward pass (counted in the traced graph) and bad inputs.
"""

import collections
import threading
import time

import keras
import numpy as np
import pytest
import tensorflow as tf

from keras_boost import BoostModel, DynamicLossScale, FreezeOpt, GradientFreeze, split_parameters_groups
from tests.helpers import classification_data, weights

LOSS = keras.losses.SparseCategoricalCrossentropy(from_logits=True)


# --------------------------------------------------------------------------- models
@pytest.fixture(autouse=True)
def _trace_ahead_on(monkeypatch):
    """The background tracing these tests check, whatever the cores of the machine (`spare_core`)."""
    monkeypatch.setenv("KERAS_BOOST_TRACE_AHEAD", "1")


def deep_mlp(model_class=BoostModel, seed=0):
    """Three Dense layers, no BatchNorm: three blocks, so groups [all, last two, last one]."""
    keras.utils.set_random_seed(seed)
    x_in = keras.Input((8,))
    h = keras.layers.Dense(16, activation="tanh", name="d0")(x_in)
    h = keras.layers.Dense(16, activation="tanh", name="d1")(h)
    out = keras.layers.Dense(4, name="d2")(h)
    return model_class(x_in, out)


def small_cnn(model_class=BoostModel, seed=0):
    """Three conv-BN-ReLU blocks and a Dense head: four blocks."""
    keras.utils.set_random_seed(seed)
    x_in = keras.Input((8, 8, 1))
    x = x_in
    for n in range(3):
        x = keras.layers.Conv2D(4, 3, padding="same", use_bias=False, name=f"conv{n}")(x)
        x = keras.layers.BatchNormalization(name=f"bn{n}")(x)
        x = keras.layers.ReLU(name=f"relu{n}")(x)
    x = keras.layers.GlobalAveragePooling2D()(x)
    return model_class(x_in, keras.layers.Dense(3, name="head")(x))


def freeze_compile(model, optimizer, strategy=None, groups=3, **boost):
    parameter_groups = split_parameters_groups(model, groups)
    model.compile(optimizer=optimizer, loss=LOSS,
                  gradient_freeze=FreezeOpt(optimizer, parameter_groups, strategy), **boost)
    return model, parameter_groups


def batches(n_steps, batch=16, seed=3, nan_steps=()):
    """Per step a batch; at `nan_steps` one input is NaN (an inf input would be squashed
    to a finite value by the frozen first tanh layer, so a deep group would not overflow)."""
    x, y = classification_data(n=batch * n_steps, seed=seed)
    x = x.copy()
    for step in nan_steps:
        x[batch * step, 0] = np.nan
    return [(x[batch * i:batch * (i + 1)], y[batch * i:batch * (i + 1)]) for i in range(n_steps)]


def train(model, data):
    """train_on_batch over `data`; returns the logged freeze group of each step."""
    return [int(model.train_on_batch(xb, yb, return_dict=True)["freeze_group"]) for xb, yb in data]


def position(model):
    (variable,) = [v for v in model.boost_state.variables if v.name == "freeze_position"]
    return int(variable.numpy())


def slots_of(optimizer, variable):
    """The optimizer's per-variable state of `variable` (momentum, Adam m and v)."""
    index = optimizer._get_variable_index(variable)
    lists = [getattr(optimizer, name, None) for name in ("momentums", "_momentums", "_velocities")]
    return [np.array(slots[index]) for slots in lists if slots]


# ----------------------------------------------------------- exactness of a frozen step
OPTIMIZERS = {
    "sgd_momentum": lambda: keras.optimizers.SGD(0.05, momentum=0.9),
    "sgd_momentum_decay": lambda: keras.optimizers.SGD(0.05, momentum=0.9, weight_decay=0.1),
    "adamw": lambda: keras.optimizers.AdamW(0.01, weight_decay=0.2),
}


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
@pytest.mark.parametrize("group", [1, 2])
def test_frozen_step_touches_only_its_group_and_equals_a_restricted_step(name, group):
    make_optimizer = OPTIMIZERS[name]
    model, groups = freeze_compile(deep_mlp(), make_optimizer(), strategy=[0, 0, group])
    optimizer = model.optimizer
    data = batches(3)
    assert train(model, data[:2]) == [0, 0]  # two full steps: every slot is non-zero now

    trained = groups[group]
    trained_ids = {id(v) for v in trained}
    frozen = [v for v in model.trainable_variables if id(v) not in trained_ids]
    assert frozen and len(frozen) + len(trained) == len(model.trainable_variables)
    before = {id(v): (np.array(v), slots_of(optimizer, v)) for v in model.trainable_variables}
    assert all(np.any(s != 0) for _, slots in before.values() for s in slots)

    # Reference: a copy of the model and of the optimizer state, one manual step on `trained` only.
    reference = deep_mlp(keras.Model, seed=5)
    for mine, theirs in zip(reference.trainable_variables, model.trainable_variables):
        mine.assign(theirs)
    ref_optimizer = make_optimizer()
    ref_optimizer.build(reference.trainable_variables)
    assert len(ref_optimizer.variables) == len(optimizer.variables)
    for mine, theirs in zip(ref_optimizer.variables, optimizer.variables):
        mine.assign(theirs)
    positions = {id(v): i for i, v in enumerate(model.trainable_variables)}
    ref_trained = [reference.trainable_variables[positions[id(v)]] for v in trained]
    xb, yb = data[2]
    with tf.GradientTape() as tape:
        loss = LOSS(yb, reference(xb, training=True))
    ref_optimizer.apply(tape.gradient(loss, ref_trained), ref_trained)

    assert train(model, data[2:]) == [group]
    for variable in frozen:
        value, slots = before[id(variable)]
        assert np.array_equal(np.array(variable), value), variable.path
        for old, new in zip(slots, slots_of(optimizer, variable)):
            assert np.array_equal(old, new), variable.path
    for variable, ref_variable in zip(trained, ref_trained):
        value, slots = before[id(variable)]
        assert not np.array_equal(np.array(variable), value), variable.path  # it did train
        np.testing.assert_allclose(np.array(variable), np.array(ref_variable), rtol=0, atol=1e-6)
        ref_slots = slots_of(ref_optimizer, ref_variable)
        for old, new, ref in zip(slots, slots_of(optimizer, variable), ref_slots):
            assert not np.array_equal(old, new)
            np.testing.assert_allclose(new, ref, rtol=0, atol=1e-6)
    assert int(optimizer.iterations.numpy()) == 3 == int(ref_optimizer.iterations.numpy())


# ------------------------------------------------------------------------- schedule
def test_logged_groups_follow_the_strategy_and_wrap_around():
    model, _ = freeze_compile(deep_mlp(), keras.optimizers.SGD(0.05, momentum=0.9), strategy=[0, 2, 1, 2])
    assert train(model, batches(10)) == [0, 2, 1, 2, 0, 2, 1, 2, 0, 2]
    assert position(model) == 10 % 4
    assert int(model.optimizer.iterations.numpy()) == 10


def test_round_robin_without_strategy_and_gradient_freeze_default_groups():
    model, _ = freeze_compile(deep_mlp(), keras.optimizers.SGD(0.05), strategy=None)
    assert train(model, batches(5)) == [0, 1, 2, 0, 1]
    # GradientFreeze: the interval sequence of generate_freeze_index_sequence, seeded.
    freeze = GradientFreeze(param_groups=3, freeze_type=1, freeze_p=0.5, total_steps=12, seed=4)
    model = deep_mlp()
    model.compile(optimizer=keras.optimizers.SGD(0.05), loss=LOSS, gradient_freeze=freeze)
    expected = freeze.generate_freeze_index_sequence()
    assert len(set(expected.tolist())) == 3
    assert train(model, batches(12)) == expected[:12].tolist()


def _checkpointed_run(directory, interrupt_at=None, how="save_weights"):
    data = batches(8)
    model, _ = freeze_compile(deep_mlp(), keras.optimizers.SGD(0.05, momentum=0.9), strategy=[0, 2, 1, 2])
    if interrupt_at is None:
        return train(model, data), model
    groups = train(model, data[:interrupt_at])
    # model.save_weights and tf.train.Checkpoint hold the layers, the optimizer state and the boost state
    if how == "save_weights":
        model.save_weights(str(directory / "run.weights.h5"))
    else:
        path = tf.train.Checkpoint(model=model, optimizer=model.optimizer).write(str(directory / "ckpt"))
    # a fresh process would start here: other weights, a new optimizer, position 0
    resumed, _ = freeze_compile(deep_mlp(seed=9), keras.optimizers.SGD(0.05, momentum=0.9), strategy=[0, 2, 1, 2])
    assert position(resumed) == 0
    if how == "save_weights":
        resumed.load_weights(str(directory / "run.weights.h5"))
    else:
        tf.train.Checkpoint(model=resumed, optimizer=resumed.optimizer).read(path).assert_consumed()
    assert position(resumed) == interrupt_at % 4
    assert int(resumed.optimizer.iterations.numpy()) == interrupt_at
    return groups + train(resumed, data[interrupt_at:]), resumed


@pytest.mark.parametrize("how", ["save_weights", "tf_checkpoint"])
def test_resumed_run_continues_the_schedule_bit_identically(tmp_path, how):
    groups, model = _checkpointed_run(tmp_path)
    resumed_groups, resumed = _checkpointed_run(tmp_path, interrupt_at=3, how=how)
    assert groups == resumed_groups == [0, 2, 1, 2, 0, 2, 1, 2]
    for a, b in zip(weights(model), weights(resumed)):
        assert np.array_equal(a, b)
    for a, b in zip(model.optimizer.variables, resumed.optimizer.variables):
        assert np.array_equal(np.array(a), np.array(b))
    # without the restore the run would differ: the seeds of the two models differ
    assert not np.array_equal(weights(deep_mlp(seed=9))[0], weights(deep_mlp())[0])


# ------------------------------------------------------- compiled loop and tracing
def _fit(steps_per_execution, data_steps=12):
    model = deep_mlp()
    optimizer = keras.optimizers.SGD(0.05, momentum=0.9)
    model.compile(optimizer=optimizer, loss=LOSS, steps_per_execution=steps_per_execution,
                  gradient_freeze=FreezeOpt(optimizer, split_parameters_groups(model, 3), [0, 2, 1, 2, 1]))
    x, y = classification_data(n=16 * data_steps, seed=3)
    history = model.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0)
    return model, history


def test_steps_per_execution_gives_the_same_training():
    one, history_one = _fit(1)
    three, history_three = _fit(3)
    assert int(three.optimizer.iterations.numpy()) == 24 == int(one.optimizer.iterations.numpy())
    assert position(three) == position(one) == 24 % 5
    assert history_three.history["freeze_group"] == history_one.history["freeze_group"]
    for a, b in zip(weights(one), weights(three)):
        assert np.array_equal(a, b)  # the same ops in the same order: bit-identical
    moved = max(float(np.max(np.abs(a - b))) for a, b in zip(weights(one), weights(deep_mlp())))
    assert moved > 1e-2


def test_each_branch_is_traced_once_over_many_steps():
    model = deep_mlp()
    optimizer = keras.optimizers.SGD(0.05, momentum=0.9)
    model.compile(optimizer=optimizer, loss=LOSS,
                  gradient_freeze=FreezeOpt(optimizer, split_parameters_groups(model, 3), [0, 2, 1, 2, 1, 0, 0]))
    step = model.boost_step
    built = collections.Counter()
    branch = step._branch

    def counting_branch(indices, *args):
        built[tuple(indices)] += 1
        return branch(indices, *args)

    step._branch = counting_branch
    x, y = classification_data(n=16 * 10, seed=3)
    history = model.fit(x, y, batch_size=16, epochs=3, shuffle=False, verbose=0)
    assert int(model.optimizer.iterations.numpy()) == 30
    assert set(history.history["freeze_group"]) == {0.0, 1.0, 2.0}
    assert sorted(built.values()) == [1, 1, 1] and len(built) == 3  # one trace of each branch
    # One compiled function per group (its step, and its loop over the iterator), each traced once.
    counts = model.train_function.tracing_counts()
    assert sorted(counts) == [(kind, g) for kind in ("step", "steps") for g in range(3)]
    assert set(counts.values()) == {1}


def _traced_by_thread(model):
    """[(group, name of the thread that traced its step)], in the order the traces began."""
    step = model.boost_step
    traced, branch = [], step._branch

    def recording_branch(indices, *args):
        traced.append((indices, threading.current_thread().name))
        return branch(indices, *args)

    step._branch = recording_branch
    return traced


def test_the_first_step_compiles_only_its_own_group():
    model = deep_mlp()
    optimizer = keras.optimizers.SGD(0.05)
    model.compile(optimizer=optimizer, loss=LOSS,
                  gradient_freeze=FreezeOpt(optimizer, split_parameters_groups(model, 3), [2, 2, 0, 1]))
    model.make_train_function().trace_ahead = False
    x, y = classification_data(n=32, seed=3)
    model.fit(x, y, batch_size=16, epochs=1, shuffle=False, verbose=0)
    assert model.train_function.traced_groups() == [2]  # steps 0 and 1 both train group 2
    model.fit(x, y, batch_size=16, epochs=1, shuffle=False, verbose=0)
    assert model.train_function.traced_groups() == [2, 0, 1]
    assert model.train_function.traced_ahead == []


def test_the_groups_ahead_are_traced_in_the_background_in_the_order_they_come():
    """The first step traces its own group; a background thread traces the others, in sequence order."""
    model = deep_mlp()
    optimizer = keras.optimizers.SGD(0.05)
    groups = split_parameters_groups(model, 3)
    model.compile(optimizer=optimizer, loss=LOSS, gradient_freeze=FreezeOpt(optimizer, groups, [2, 2, 0, 1]))
    traced = _traced_by_thread(model)
    seen = []

    class AfterTheFirstStep(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            if batch == 0:  # let the thread finish (it traces while the main thread is "in a step")
                function = self.model.train_function
                function._in_step.set()
                function._tracer.join(timeout=120)
                function._in_step.clear()
                seen.extend(traced)

    x, y = classification_data(n=16 * 4, seed=3)
    model.fit(x, y, batch_size=16, epochs=1, shuffle=False, verbose=0, callbacks=[AfterTheFirstStep()])
    index = {tuple(model.boost_step.stage("gradient_freeze").group_indices[g]): g for g in range(3)}
    by = [(index[tuple(indices)], thread) for indices, thread in seen]
    assert by == [(2, "MainThread"), (0, "keras_boost-trace-groups"), (1, "keras_boost-trace-groups")]
    assert model.train_function.traced_ahead == [0, 1]
    # each also ran once on an empty iterator (set up, no step): 4 updates, the position at 0
    assert model.train_function.set_up_ahead == [0, 1]
    assert int(model.optimizer.iterations.numpy()) == 4 and int(model.boost_step.stage("gradient_freeze").position.numpy()) == 0
    assert len(traced) == 3  # steps 2 and 3 ran the traces made ahead: nothing traced again
    assert set(model.train_function.tracing_counts().values()) == {1}
    assert model.train_function._tracer is None  # fit ended it


def test_a_group_that_fits_thread_reached_first_is_not_set_up_again():
    """The background thread traces the groups ahead, then sets each up (one call on an empty
    iterator). A group that fit's thread has run meanwhile is set up already: it is skipped."""
    model = deep_mlp()
    optimizer = keras.optimizers.SGD(0.05)
    model.compile(optimizer=optimizer, loss=LOSS,
                  gradient_freeze=FreezeOpt(optimizer, split_parameters_groups(model, 3), [2, 2, 0, 1]))
    function = model.make_train_function()
    function.trace_ahead = True
    gate, held = threading.Event(), []
    set_up = function._set_up

    def held_set_up(branch, *args):
        if not held:  # the first set-up waits until fit's thread has run the groups ahead itself
            held.append(branch)
            assert gate.wait(120)
        return set_up(branch, *args)

    function._set_up = held_set_up

    class Steps(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            if batch == 0:  # let the thread trace groups 0 and 1 (it traces while a step runs)
                function._in_step.set()
                deadline = time.monotonic() + 120
                while function.traced_ahead != [0, 1] and time.monotonic() < deadline:
                    time.sleep(0.05)
                function._in_step.clear()
            if batch == 3:  # steps 3 and 4 trained groups 0 and 1 on this thread
                gate.set()
                function._tracer.join(timeout=120)

    x, y = classification_data(n=16 * 4, seed=3)
    model.fit(x, y, batch_size=16, epochs=1, shuffle=False, verbose=0, callbacks=[Steps()])
    assert function.traced_ahead == [0, 1] and held == [0]
    assert function.set_up_ahead == [0], function.set_up_ahead  # group 1 had run: not set up after the fact
    assert int(model.optimizer.iterations.numpy()) == 4


def test_the_model_waits_for_a_trace_of_the_background_thread():
    """Keras clears a model's `add_loss` lists at every top-level call: while the background
    thread traces a group's step, a call of the model from the main thread waits for it."""
    import time

    bg_inside, release, order = threading.Event(), threading.Event(), []

    class Probe(keras.layers.Layer):
        def call(self, x):
            if threading.current_thread().name == "keras_boost-trace-groups" and not bg_inside.is_set():
                bg_inside.set()
                assert release.wait(60)
                order.append("background trace done")
            self.add_loss(1e-3 * keras.ops.mean(keras.ops.square(x)))  # an activity loss, as regularizers add
            return x

    inputs = keras.Input((8,))
    hidden = keras.layers.Dense(16, activation="relu")(inputs)
    hidden = Probe()(keras.layers.Dense(16, activation="relu")(hidden))
    model = BoostModel(inputs, keras.layers.Dense(4)(hidden))
    optimizer = keras.optimizers.SGD(0.05)
    model.compile(optimizer=optimizer, loss=LOSS,
                  gradient_freeze=FreezeOpt(optimizer, split_parameters_groups(model, 3), [0, 1, 2]))
    x, y = classification_data(n=16 * 3, seed=3)

    class CallAfterTheFirstStep(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            if batch == 0:
                assert bg_inside.wait(60)
                threading.Timer(0.5, release.set).start()
                start = time.perf_counter()
                self.model(x[:2])
                order.append(f"main call done after {time.perf_counter() - start:.1f} s")

    model.fit(x, y, batch_size=16, epochs=1, shuffle=False, verbose=0, callbacks=[CallAfterTheFirstStep()])
    assert order[0] == "background trace done" and order[1].startswith("main call done"), order
    assert model.train_function.traced_ahead[0] == 1


def test_the_background_thread_traces_with_fits_dtype_policy_and_seed():
    """Keras keeps the global dtype policy and random seed per thread; the groups traced
    ahead see the ones fit's thread has, as a trace on that thread would."""
    from keras.src.utils import rng_utils

    seen = []

    class Probe(keras.layers.Layer):
        def call(self, x):
            seen.append((threading.current_thread().name, keras.config.dtype_policy().name,
                         rng_utils.get_random_seed()))
            return x

    keras.config.set_dtype_policy("mixed_bfloat16")
    try:
        keras.utils.set_random_seed(7)
        inputs = keras.Input((8,))
        hidden = Probe()(keras.layers.Dense(16, activation="relu")(inputs))
        model = BoostModel(inputs, keras.layers.Dense(4, dtype="float32")(hidden))
        optimizer = keras.optimizers.SGD(0.05)
        model.compile(optimizer=optimizer, loss=LOSS,
                      gradient_freeze=FreezeOpt(optimizer, split_parameters_groups(model, 2), [0, 1]))
        x, y = classification_data(n=16 * 6, seed=3)
        model.fit(x, y, batch_size=16, epochs=1, shuffle=False, verbose=0)
    finally:
        keras.config.set_dtype_policy("float32")
    traced = [entry for entry in seen if entry[0] == "keras_boost-trace-groups"]
    assert model.train_function.traced_ahead == [1] and traced
    assert {entry[1:] for entry in seen} == {("mixed_bfloat16", 7)}


def test_trace_ahead_is_read_from_the_environment(monkeypatch):
    from keras_boost.step.dispatch import BranchTrainFunction, spare_core

    model = deep_mlp()
    monkeypatch.setenv("KERAS_BOOST_TRACE_AHEAD", "0")
    assert BranchTrainFunction(model, False).trace_ahead is False
    monkeypatch.setenv("KERAS_BOOST_TRACE_AHEAD", "1")
    assert BranchTrainFunction(model, False).trace_ahead is True
    monkeypatch.setenv("KERAS_BOOST_TRACE_AHEAD", "yes")
    with pytest.raises(ValueError, match=r"KERAS_BOOST_TRACE_AHEAD must be 'auto'.*'1'.*'0'.*got 'yes'"):
        BranchTrainFunction(model, False)
    monkeypatch.delenv("KERAS_BOOST_TRACE_AHEAD")  # the default: "auto"
    assert BranchTrainFunction(model, False).trace_ahead is spare_core()


def test_trace_ahead_by_default_only_with_a_spare_core(monkeypatch):
    """Two cores or more per worker of the host: one process on 2 cores yes, 2 workers on 2 cores no."""
    from keras_boost import distributed
    from keras_boost.step import dispatch

    monkeypatch.setenv("KERAS_BOOST_TRACE_AHEAD", "auto")
    for cores, workers, expected in ((2, 1, True), (2, 2, False), (1, 1, False), (32, 4, True), (7, 4, False)):
        monkeypatch.setattr(dispatch.os, "sched_getaffinity", lambda pid, n=cores: set(range(n)))
        monkeypatch.setattr(distributed, "local_size", lambda n=workers: n)
        assert dispatch.spare_core() is expected, (cores, workers)
        assert dispatch.BranchTrainFunction(deep_mlp(), False).trace_ahead is expected


def test_tracing_ahead_gives_the_same_training():
    """Traced ahead or on first use, the groups' steps are the same graphs: bit-identical weights."""
    results = []
    for ahead in (True, False):
        model = deep_mlp()
        optimizer = keras.optimizers.SGD(0.05, momentum=0.9)
        model.compile(optimizer=optimizer, loss=LOSS,
                      gradient_freeze=FreezeOpt(optimizer, split_parameters_groups(model, 3), [1, 0, 2, 2, 0]))
        model.make_train_function().trace_ahead = ahead
        x, y = classification_data(n=16 * 12, seed=5)
        history = model.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0)
        results.append((weights(model), history.history, model.train_function.traced_ahead))
    (w1, h1, ahead1), (w2, h2, ahead2) = results
    assert ahead2 == [] and ahead1 and set(ahead1) <= {0, 2}
    assert h1 == h2
    for a, b in zip(w1, w2):
        np.testing.assert_array_equal(a, b)


def test_per_group_functions_equal_the_switch_case_step():
    """The per-group functions chosen from Python give the weights of the one-graph step."""
    results = []
    for in_python in (True, False):
        model = deep_mlp()
        optimizer = keras.optimizers.Adam(0.01)
        model.compile(optimizer=optimizer, loss=LOSS, steps_per_execution=3, gradient_accumulation=2,
                      gradient_freeze=FreezeOpt(optimizer, split_parameters_groups(model, 3), [0, 2, 2, 1, 0]))
        if not in_python:
            model._chooses_branches_in_python = lambda: False  # Keras' function around one tf.switch_case
        x, y = classification_data(n=16 * 11 - 5, seed=4)  # a partial last batch and a partial last chunk
        history = model.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0)
        assert type(model.train_function).__name__ == ("BranchTrainFunction" if in_python else "function")
        results.append((weights(model), [np.array(v) for v in model.optimizer.variables], history.history,
                        int(model.optimizer.iterations.numpy()), int(model.boost_step.stage("gradient_freeze").position.numpy())))
    (w1, o1, h1, n1, p1), (w2, o2, h2, n2, p2) = results
    assert n1 == n2 == 11 and p1 == p2 == 1  # 22 micro-batches, 2 per update; the sequence of 5 wrapped twice
    assert h1 == h2
    for a, b in zip(w1 + o1, w2 + o2):
        np.testing.assert_array_equal(a, b)


# -------------------------------------------------- loss scaling and accumulation
def test_overflow_drops_the_update_of_its_group_and_halves_the_scale():
    model, groups = freeze_compile(deep_mlp(), keras.optimizers.SGD(0.05, momentum=0.9), strategy=[0, 1, 2],
                                   loss_scale=DynamicLossScale(init_scale=1024.0, scale_window=100))
    data = batches(4, nan_steps=[1])
    train(model, data[:1])
    before_w = weights(model)
    before_opt = [np.array(v) for v in model.optimizer.variables]
    logs = model.train_on_batch(*data[1], return_dict=True)
    assert (int(logs["freeze_group"]), int(logs["overflow"]), float(logs["loss_scale"])) == (1, 1, 512.0)
    for a, b in zip(before_w, weights(model)):
        assert np.array_equal(a, b)
    for a, b in zip(before_opt, model.optimizer.variables):
        assert np.array_equal(a, np.array(b))  # slots and iterations untouched
    assert position(model) == 2  # the schedule moves on: the dropped step used its slot
    logs = [model.train_on_batch(*batch, return_dict=True) for batch in data[2:]]
    assert [int(l["freeze_group"]) for l in logs] == [2, 0]
    assert [int(l["overflow"]) for l in logs] == [0, 0]
    assert [float(l["loss_scale"]) for l in logs] == [512.0, 512.0]
    assert int(model.optimizer.iterations.numpy()) == 3
    last = {id(v) for v in groups[2]}
    changed = [not np.array_equal(a, b) for a, b in zip(before_w, weights(model))]
    assert all(changed)  # group 2 then the full step trained everything again
    assert any(id(v) not in last for v in model.trainable_variables)


def test_accumulation_window_uses_one_group_and_equals_the_big_batch():
    strategy = [0, 1, 2, 1]
    accumulated, groups = freeze_compile(deep_mlp(), keras.optimizers.SGD(0.05, momentum=0.9), strategy=strategy,
                                         gradient_accumulation=2)
    big, _ = freeze_compile(deep_mlp(), keras.optimizers.SGD(0.05, momentum=0.9), strategy=strategy)
    micro = batches(8, batch=16)
    whole = batches(4, batch=32)

    frozen_in_1 = [i for i, v in enumerate(accumulated.trainable_variables) if id(v) not in {id(w) for w in groups[1]}]
    logged, positions = [], []
    for number, (xb, yb) in enumerate(micro):
        if number == 2:  # first micro-batch of group 1's window
            window_start = weights(accumulated)
        logged.append(int(accumulated.train_on_batch(xb, yb, return_dict=True)["freeze_group"]))
        positions.append(position(accumulated))
        if number == 3:
            after = weights(accumulated)
            assert all(np.array_equal(window_start[i], after[i]) for i in frozen_in_1)
            assert not all(np.array_equal(a, b) for a, b in zip(window_start, after))
    assert logged == [0, 0, 1, 1, 2, 2, 1, 1]
    assert positions == [0, 1, 1, 2, 2, 3, 3, 0]  # advances once per window, wraps around
    assert int(accumulated.optimizer.iterations.numpy()) == 4
    assert train(big, whole) == [0, 1, 2, 1]
    for a, b in zip(weights(big), weights(accumulated)):
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-6)


# ------------------------------------------------------------ the pruned backward
def _count_ops(library, name, counter):
    for node in library[name].node_def:
        counter[node.op] += 1
        for attr in node.attr.values():
            names = [attr.func.name] if attr.func.name else [f.name for f in attr.list.func]
            for nested in names:
                if nested in library:
                    _count_ops(library, nested, counter)
    return counter


def branch_op_counts(model, input_shape):
    """Per branch of the step's switch_case, how many ops of each type its graph holds."""
    spec = (tf.TensorSpec((None, *input_shape), tf.float32), tf.TensorSpec((None,), tf.int32))
    graph = tf.function(model.train_step, autograph=False).get_concrete_function(spec).graph.as_graph_def()
    library = {f.signature.name: f for f in graph.library.function}
    cases = [n for n in graph.node if n.op in ("Case", "StatelessCase")]
    assert len(cases) == 1
    return [_count_ops(library, f.name, collections.Counter()) for f in cases[0].attr["branches"].list.func]


def test_frozen_prefix_has_no_backward_ops():
    model = small_cnn()
    optimizer = keras.optimizers.SGD(0.05, momentum=0.9)
    groups = split_parameters_groups(model, 4)  # conv0+bn0 | conv1+bn1 | conv2+bn2 | head
    model.compile(optimizer=optimizer, loss=LOSS, gradient_freeze=FreezeOpt(optimizer, groups))
    counts = branch_op_counts(model, (8, 8, 1))
    assert len(counts) == 4
    assert [c["Conv2D"] for c in counts] == [3, 3, 3, 3]  # every branch runs the whole forward
    # group k: no kernel gradient for the k frozen convs, and no gradient through their
    # BatchNorms (Keras' BN backward holds one RsqrtGrad) and ReLUs
    assert [c["Conv2DBackpropFilter"] for c in counts] == [3, 2, 1, 0]
    assert [c["RsqrtGrad"] for c in counts] == [3, 2, 1, 0]
    assert [c["ReluGrad"] for c in counts] == [3, 2, 1, 0]
    # input gradients exist only down to the first trained conv (its own input gradient is
    # dead code, removed by Grappler at run time)
    assert [c["Conv2DBackpropInput"] for c in counts] == [3, 2, 1, 0]
    # and the update touches only the group's variables: fewer optimizer writes per branch
    writes = [c["AssignVariableOp"] + c["AssignSubVariableOp"] + c["AssignAddVariableOp"] for c in counts]
    assert writes[0] > writes[1] > writes[2] > writes[3]
    # still trains: one step of each group on real data changes the loss, and moves exactly
    # the group's variables (the frozen prefix stays bit-identical)
    x = np.random.default_rng(0).normal(size=(32, 8, 8, 1)).astype(np.float32)
    y = np.arange(32) % 3
    logged = []
    for group in range(4):
        trained_ids = {id(v) for v in groups[group]}
        loss_before = model.evaluate(x, y, batch_size=32, verbose=0)
        before = weights(model)
        logged += train(model, [(x, y)])
        loss_after = model.evaluate(x, y, batch_size=32, verbose=0)
        assert abs(loss_after - loss_before) > 1e-6, (group, loss_before, loss_after)
        for variable, old in zip(model.trainable_variables, before):
            moved = not np.array_equal(np.array(variable), old)
            assert moved == (id(variable) in trained_ids), (group, variable.path)
    assert logged == [0, 1, 2, 3]


# ------------------------------------------------------------------------ bad input
def _foreign_variable_opt(model, optimizer):
    other = deep_mlp(seed=1)
    groups = split_parameters_groups(model, 3)
    return FreezeOpt(optimizer, [groups[0], groups[1] + [other.trainable_variables[0]]])


def _non_trainable_opt(model, optimizer):
    cnn = small_cnn()
    moving_mean = [v for v in cnn.non_trainable_variables if "moving_mean" in v.path][0]
    return FreezeOpt(optimizer, [list(model.trainable_variables) + [moving_mean]])


_NOT_FREEZE = "`gradient_freeze` must be None, a bool, a GradientFreeze or a FreezeOpt, got .*"
BAD = {  # case: (make the value, error type, message pattern)
    "string": (lambda model, optimizer: "freeze", TypeError, _NOT_FREEZE + r"\(str\)"),
    "int": (lambda model, optimizer: 10, TypeError, _NOT_FREEZE + r"\(int\)"),
    "class": (lambda model, optimizer: GradientFreeze, TypeError, _NOT_FREEZE + r"\(type\)"),
    "dict": (lambda model, optimizer: {"param_groups": 2}, TypeError, _NOT_FREEZE + r"\(dict\)"),
    "groups_list": (lambda model, optimizer: split_parameters_groups(model, 3), TypeError, _NOT_FREEZE + r"\(list\)"),
    "optimizer": (lambda model, optimizer: optimizer, TypeError, _NOT_FREEZE + r"\(SGD\)"),
    "foreign_variable": (_foreign_variable_opt, ValueError,
                         r"Group 1 of `freeze_opt` holds variables that are not trainable variables of `model`: "
                         r"\['d0/kernel'\]"),
    "non_trainable_variable": (_non_trainable_opt, ValueError,
                               r"Group 0 of `freeze_opt` holds variables that are not trainable variables of "
                               r"`model`: \['bn0/moving_mean'\]"),
    "duplicate_variable": (
        lambda model, optimizer: FreezeOpt(optimizer, [model.trainable_variables[:1] * 2]), ValueError,
        "Group 0 of `freeze_opt` holds a variable more than once"),
    "other_optimizer": (
        lambda model, optimizer: FreezeOpt(keras.optimizers.SGD(0.3), split_parameters_groups(model, 3)),
        ValueError, r"The optimizer of `gradient_freeze` \(a FreezeOpt\) must be the optimizer the model is "
                    r"compiled with"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_gradient_freeze_is_refused_at_compile(case):
    make, error, message = BAD[case]
    model = deep_mlp()
    optimizer = keras.optimizers.SGD(0.05)
    with pytest.raises(error, match=message):
        model.compile(optimizer=optimizer, loss=LOSS, gradient_freeze=make(model, optimizer))


def test_freeze_opt_bad_arguments():
    model = deep_mlp()
    optimizer = keras.optimizers.SGD(0.05)
    groups = split_parameters_groups(model, 3)
    with pytest.raises(ValueError, match=r"`train_strategy` holds group indices in \[0, 3\), got 3 at position 1"):
        FreezeOpt(optimizer, groups, [0, 3])  # index out of range
    with pytest.raises(ValueError, match="`train_strategy` was given without `train_parameter_groups`"):
        FreezeOpt(optimizer, None, [0])  # strategy without groups
    with pytest.raises(ValueError, match="`train_parameter_groups` element 0 is empty"):
        FreezeOpt(optimizer, [[]])
    with pytest.raises(TypeError, match="`opt` must be a keras.optimizers.Optimizer instance, got str"):
        FreezeOpt("sgd", groups)
    with pytest.raises(ValueError, match=r"Every element of `train_strategy` must be an int, got 0.5 \(float\)"):
        FreezeOpt(optimizer, groups, [0.5, 1])


@pytest.mark.parametrize("mode", ["run_eagerly", "jit_compile"])
def test_per_group_functions_run_eagerly_and_under_xla(mode):
    results = {}
    for current in ("graph", mode):
        model = deep_mlp()
        optimizer = keras.optimizers.Adam(0.01)
        model.compile(optimizer=optimizer, loss=LOSS, **({current: True} if current != "graph" else {}),
                      gradient_freeze=FreezeOpt(optimizer, split_parameters_groups(model, 3), [0, 2, 1]))
        x, y = classification_data(n=16 * 4, seed=5)
        history = model.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0)
        assert type(model.train_function).__name__ == "BranchTrainFunction"
        assert history.history["freeze_group"] == [0.0, 2.0]  # steps 3 and 7 train groups 0 and 2
        results[current] = weights(model)
    # Eager and graph (and XLA) run other kernels: where TensorFlow turns oneDNN on (AVX-512
    # CPUs; TF_ENABLE_ONEDNN_OPTS) the eager matmuls round differently from the graph's fused
    # ones (3e-8 seen on 19 of 128 values after 8 Adam steps). The schedule is what is compared
    # here (which groups trained when), not the kernels: 1e-5 is far below one step's change.
    for a, b in zip(results["graph"], results[mode]):
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-5)
