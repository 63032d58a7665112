"""Self-measurement: a boost level's freezing and centralization time themselves in fit and switch off.

The verdicts depend on timing, so the tests that run fit force them with the stages'
threshold (`min_saving`) and check what the switch does: the stage stops
acting from the next step on, nothing is retraced, and every worker decides the same.
"""

import keras
import numpy as np
import pytest
import tensorflow as tf

from keras_boost import BoostModel, GradientCentralization, GradientFreeze
from keras_boost.config import MINDSPORE_DEFAULTS, BoostConfig
from keras_boost.stages.centralization import centralize
from tests.launch import shared

STEPS = 12  # per epoch; O1's default schedule (period 9: six full steps, groups 1, 2, 3) decides at step 42


def small_bn_model(config=None, level="O1", seed=0, batchnorm=True):
    """Three conv blocks; with BatchNorm, LessBN removes one of the three."""
    keras.utils.set_random_seed(seed)
    inputs = keras.Input((12, 12, 1))
    h = inputs
    for filters in (8, 16, 16):
        h = keras.layers.Conv2D(filters, 3, padding="same", use_bias=not batchnorm)(h)
        if batchnorm:
            h = keras.layers.BatchNormalization()(h)
        h = keras.layers.ReLU()(h)
    outputs = keras.layers.Dense(4)(keras.layers.GlobalAveragePooling2D()(h))
    return BoostModel(inputs, outputs, boost_level=level, boost_config=config)


def data(steps=STEPS, batch=16):
    rng = np.random.default_rng(0)
    return rng.random((steps * batch, 12, 12, 1), dtype=np.float32), rng.integers(0, 4, steps * batch)


def compiled(model, **options):
    model.compile(optimizer=keras.optimizers.SGD(0.05, momentum=0.9),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True), **options)
    return model


class Groups(keras.callbacks.Callback):
    def __init__(self):
        super().__init__()
        self.groups = []

    def on_train_batch_end(self, batch, logs=None):
        self.groups.append(int(logs["freeze_group"]))


# ------------------------------------------------------------------ which features are measured
def test_the_level_measures_the_features_it_switched_on():
    o1 = BoostConfig("O1")
    assert o1.measured("grad_freeze") and o1.measured("less_bn")
    assert not o1.measured("adasum")  # off at O1
    assert not BoostConfig("O0").measured("grad_freeze")


@pytest.mark.parametrize("config, fixed", [
    (MINDSPORE_DEFAULTS, {"grad_freeze", "less_bn"}),  # MindSpore's fixed O1
    ({"grad_freeze": {"total_steps": 100}}, {"grad_freeze"}),  # a section given: the user's values
    ({"less_bn": {"gc_flag": True}}, {"less_bn"}),
    ({"boost": {"measure": False}}, {"grad_freeze", "less_bn"}),
    ({"boost": {"mode": "manual", "grad_freeze": True}}, {"grad_freeze"}),  # switched on by name
])
def test_a_feature_the_user_configured_stays_fixed(config, fixed):
    o1 = BoostConfig("O1", config)
    assert {f for f in ("grad_freeze", "less_bn") if not o1.measured(f)} == fixed


def test_measure_must_be_a_bool():
    with pytest.raises(TypeError, match=r"boost_config\['boost'\]\['measure'\].*'yes'"):
        BoostConfig("O1", {"boost": {"measure": "yes"}})


def test_compile_gives_switches_to_the_measured_level_stages_only():
    model = compiled(small_bn_model())
    step = model.boost_step
    assert step.stage("gradient_freeze").switch is not None and step.stage("gradient_centralization").switch is not None
    fixed = compiled(small_bn_model(MINDSPORE_DEFAULTS))
    assert fixed.boost_step.stage("gradient_freeze").switch is None and fixed.boost_step.stage("gradient_centralization").switch is None
    # explicit compile options are the user's, on any level
    explicit = compiled(small_bn_model(), gradient_freeze=GradientFreeze(param_groups=3),
                        gradient_centralization=True)
    assert explicit.boost_step.stage("gradient_freeze").switch is None and explicit.boost_step.stage("gradient_centralization").switch is None


# ---------------------------------------------------------------- the switch, inside a compiled step
def test_switched_off_centralization_passes_gradients_through_without_a_retrace():
    kernel = keras.Variable(np.ones((3, 3, 16, 8), np.float32))
    stage = GradientCentralization([kernel])
    stage.add_switch()
    grad = tf.random.stateless_normal((3, 3, 16, 8), seed=(1, 2))
    transform = tf.function(lambda g: stage.transform([g], [kernel])[0])
    np.testing.assert_allclose(transform(grad), centralize(grad), rtol=0, atol=1e-6)  # same ops, reassociated
    stage.switch_off()
    np.testing.assert_array_equal(transform(grad), grad)
    assert transform.experimental_get_tracing_count() == 1


def test_switched_off_freezing_trains_the_full_step_and_holds_its_position():
    model = compiled(small_bn_model())
    model.boost_step.stage("gradient_freeze").min_saving = 2.0  # no schedule saves 200%
    groups = Groups()
    x, y = data()
    model.fit(x, y, batch_size=16, epochs=4, shuffle=False, verbose=0, callbacks=[groups])
    decisions = {option: kept for option, kept, _ in model.self_measurement}
    assert decisions == {"gradient_freeze": False, "gradient_centralization": True}
    schedule = model.boost_step.stage("gradient_freeze").plan.schedule
    # the sequence ran as scheduled up to the decision (step 42, the third timed step of group 1: its
    # steps 6 (traced) and 24 (an epoch's first) are not timed), then
    # only full steps, with the sequence standing where it was
    assert groups.groups[:43] == [int(g) for g in schedule[:43]]
    assert groups.groups[43:] == [0] * 5
    assert int(model.boost_step.stage("gradient_freeze").position.numpy()) == 43
    # every group's function was traced once: switching off retraced nothing
    assert set(model.train_function.tracing_counts().values()) == {1}
    assert all(np.isfinite(np.array(w)).all() for w in model.trainable_weights)


def test_a_paying_stage_stays_on_and_the_decision_is_printed(capsys):
    model = compiled(small_bn_model())
    assert model.less_bn_report.num_removed == 1
    model.boost_step.stage("gradient_freeze").min_saving = -10.0  # any schedule pays
    groups = Groups()
    x, y = data()
    model.fit(x, y, batch_size=16, epochs=4, shuffle=False, verbose=0, callbacks=[groups])
    out = capsys.readouterr().out
    assert "O1's gradient_freeze stays on in one process: the freeze schedule's mean step takes" in out
    assert ("O1's gradient_centralization stays on in one process: centralizing costs" in out
            and "kept for accuracy, since LessBN removed 1 BatchNormalization layers" in out)
    schedule = model.boost_step.stage("gradient_freeze").plan.schedule
    assert groups.groups == [int(g) for g in schedule[:48]]  # freezing went on as scheduled
    assert model.boost_step.stage("gradient_centralization").is_on()
    # a second fit keeps the decision: no more timing, no more lines
    model.fit(x, y, batch_size=16, epochs=1, verbose=0)
    assert "keras_boost:" not in capsys.readouterr().out


def test_without_a_removed_batchnorm_the_level_adds_no_fn_head_no_centralization_and_no_freezing(capsys):
    with pytest.warns(UserWarning, match="without an FN head, and a boost level leaves its gradient centralization"):
        model = compiled(small_bn_model(batchnorm=False))
    reference = small_bn_model(batchnorm=False, level="O0")
    assert model.less_bn_report.num_removed == 0 and model.less_bn_report.fn_heads == ()
    assert [type(layer).__name__ for layer in model.layers] == [type(layer).__name__ for layer in reference.layers]
    x, y = data()
    groups = Groups()
    model.boost_step.stage("gradient_freeze").min_saving = -10.0  # it would pay: it is off for accuracy, not for speed
    model.fit(x, y, batch_size=16, epochs=4, verbose=0, callbacks=[groups])
    # both off before the first step is traced; nothing left to time
    assert not model.boost_step.stage("gradient_centralization").is_on() and not model.boost_step.stage("gradient_freeze").is_on()
    # nothing of freezing is left in the step: Keras' own train function runs it, one group
    from keras_boost.step.dispatch import BranchTrainFunction

    assert groups.groups == [0] * 48 and not isinstance(model.train_function, BranchTrainFunction)
    assert model.self_measurement is None
    out = capsys.readouterr().out
    assert out.count("O1's gradient_freeze switched off: LessBN removed no BatchNormalization layer") == 1, out
    # freezing asked for by name, or by the configuration's section, stays
    explicit = compiled(small_bn_model(batchnorm=False), gradient_freeze=True)
    sectioned = compiled(small_bn_model({"grad_freeze": {"freeze_type": 0, "param_groups": 4}}, batchnorm=False))
    for kept in (explicit, sectioned):
        kept.fit(x, y, batch_size=16, epochs=1, verbose=0)
        assert kept.boost_step.stage("gradient_freeze").is_on()
    # MindSpore's O1 (the less_bn section given) keeps its FN head and GC on any model
    mindspore = compiled(small_bn_model(MINDSPORE_DEFAULTS, batchnorm=False))
    assert mindspore.less_bn_report.fn_heads and mindspore.boost_step.stage("gradient_centralization").is_on()


def test_too_short_a_fit_says_so_once_and_the_next_fit_goes_on_timing(capsys):
    model = compiled(small_bn_model())
    x, y = data()
    model.fit(x, y, batch_size=16, epochs=1, verbose=0)
    assert "stay on: this fit ran too few steps to time them" in capsys.readouterr().out
    model.fit(x, y, batch_size=16, epochs=1, verbose=0)
    assert capsys.readouterr().out == ""
    assert model.self_measurement is None and model._measuring.times  # still timing
    model.boost_step.stage("gradient_freeze").min_saving = 2.0
    model.fit(x, y, batch_size=16, epochs=2, verbose=0)
    assert [kept for option, kept, _ in model.self_measurement if option == "gradient_freeze"] == [False]


def test_steps_per_execution_leaves_the_stages_on_with_a_line(capsys):
    model = compiled(small_bn_model(), steps_per_execution=4)
    x, y = data()
    model.fit(x, y, batch_size=16, epochs=1, verbose=0)
    assert "stay on unmeasured: steps_per_execution=4" in capsys.readouterr().out
    assert model.boost_step.stage("gradient_freeze").is_on() and model.boost_step.stage("gradient_centralization").is_on()


def test_two_workers_switch_off_together():
    found = shared("gloo", "self_measurement")
    first, second = found[0], found[1]
    assert first["decisions"] == second["decisions"] == [["gradient_freeze", False], ["gradient_centralization", True]]
    assert first["centralization_on"] and second["centralization_on"]  # kept for accuracy: a BatchNorm removed
    assert first["decided_at"] == second["decided_at"] == 42
    assert first["groups"] == second["groups"] and set(first["groups"][43:]) == {0}
    assert first["position"] == second["position"] == 43
    # every compiled function, group 0's included after the switch, was traced once
    assert first["tracing"] == second["tracing"] and len(first["tracing"]) == 8
    assert all(t.endswith(":1") for t in first["tracing"]), first["tracing"]
    assert first["digest"] == second["digest"] and first["finite"]  # bit-identical weights


# ------------------------------------------------------------------ the gate before the groups compile
@pytest.fixture
def gate(monkeypatch):
    """The gate on, and the groups compiled on fit's path (no tracing ahead, unless a test says)."""
    from keras_boost.step.tuning import SelfMeasurement

    monkeypatch.setattr(SelfMeasurement, "gate", True)
    monkeypatch.setenv("KERAS_BOOST_TRACE_AHEAD", "0")


def test_the_gate_switches_freezing_off_before_a_group_compiles_in_a_short_fit(gate, capsys):
    model = compiled(small_bn_model())
    groups = Groups()
    x, y = data()
    model.fit(x, y, batch_size=16, epochs=4, shuffle=False, verbose=0, callbacks=[groups])
    out = capsys.readouterr().out
    # 48 steps of ~10 ms cannot repay three compilations of ~0.5 s: off at the third step
    assert "O1's gradient_freeze switched off in one process before compiling its groups: its 3 partial" in out
    assert "steps left of this fit could save at most" in out
    decisions = {option: kept for option, kept, _ in model.self_measurement}
    assert decisions == {"gradient_freeze": False, "gradient_centralization": True}
    assert groups.groups == [0] * 48  # full steps only
    assert int(model.boost_step.stage("gradient_freeze").position.numpy()) == 0  # the sequence never moved
    assert model.train_function.traced_groups() == [0]  # no partial group was ever compiled
    assert set(model.train_function.tracing_counts()) == {("step", 0), ("steps", 0)}


def test_a_recompiled_model_measures_its_new_step(gate, capsys):
    # the keras-io fine-tuning recipe: fit, change what trains, compile again, fit again
    model = compiled(small_bn_model())  # the gate decides freezing; GC stays (LessBN removed a BatchNorm)
    x, y = data()
    model.fit(x, y, batch_size=16, epochs=2, verbose=0)
    assert [(option, kept) for option, kept, _ in model.self_measurement] == [
        ("gradient_freeze", False), ("gradient_centralization", True)]
    assert "switched off in one process before compiling its groups" in capsys.readouterr().out
    model.layers[1].trainable = False
    compiled(model)  # a new step, with its freezing on again
    assert model.self_measurement is None and model.boost_step.stage("gradient_freeze").is_on()
    model.fit(x, y, batch_size=16, epochs=2, verbose=0)
    assert "switched off in one process before compiling its groups" in capsys.readouterr().out
    assert [(option, kept) for option, kept, _ in model.self_measurement] == [
        ("gradient_freeze", False), ("gradient_centralization", True)]
    assert not model.boost_step.stage("gradient_freeze").is_on()


def test_a_fit_long_enough_passes_the_gate_and_freezes_from_there(gate, capsys):
    model = compiled(small_bn_model())
    model.boost_step.stage("gradient_freeze").min_saving = -10.0  # once timed, the schedule is kept

    class StopAt(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            if len(groups.groups) == 24:
                self.model.stop_training = True

    groups = Groups()
    x, y = data()
    # 1000 epochs of 12 steps: time enough to repay any compilation (stopped after 24 steps)
    model.fit(x, y, batch_size=16, epochs=1000, shuffle=False, verbose=0, callbacks=[groups, StopAt()])
    assert "before compiling its groups" not in capsys.readouterr().out
    schedule = [int(g) for g in model.boost_step.stage("gradient_freeze").plan.schedule]
    # three full steps held back by the gate, then the sequence from its start
    assert groups.groups == [0, 0, 0] + schedule[:21]
    assert model.boost_step.stage("gradient_freeze").is_on()
    assert int(model.boost_step.stage("gradient_freeze").position.numpy()) == 21


def test_with_tracing_ahead_the_gate_holds_the_groups_back_then_traces_them_ahead(gate, monkeypatch):
    monkeypatch.setenv("KERAS_BOOST_TRACE_AHEAD", "1")
    model = compiled(small_bn_model())
    x, y = data()
    short = Groups()
    model.fit(x, y, batch_size=16, epochs=4, shuffle=False, verbose=0, callbacks=[short])
    assert short.groups == [0] * 48 and model.train_function.traced_ahead == []  # nothing traced ahead

    model = compiled(small_bn_model())
    model.boost_step.stage("gradient_freeze").min_saving = -10.0
    long = Groups()

    class StopAt(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            self.model.stop_training = len(long.groups) == 24

    model.fit(x, y, batch_size=16, epochs=1000, shuffle=False, verbose=0, callbacks=[long, StopAt()])
    assert long.groups[:3] == [0, 0, 0] and set(long.groups[3:]) == {0, 1, 2, 3}
    # once the gate let freezing on, the groups still to come were traced in the background
    assert model.train_function.traced_ahead, model.train_function.traced_groups()
    assert set(model.train_function.tracing_counts().values()) == {1}


@pytest.mark.parametrize("fit_epochs, kept", [(4, False), (1000, True)])
def test_with_accumulation_the_gate_changes_freezing_only_between_windows(gate, fit_epochs, kept):
    """Windows of 2 micro-batches: the gate's 3 steps end inside a window, so it decides after the 4th;
    every window trains one group whatever the gate decides."""
    model = compiled(small_bn_model(), gradient_accumulation=2)
    model.boost_step.stage("gradient_freeze").min_saving = -10.0

    class StopAt(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            self.model.stop_training = len(groups.groups) == 40

    groups = Groups()
    x, y = data()
    model.fit(x, y, batch_size=16, epochs=fit_epochs, shuffle=False, verbose=0, callbacks=[groups, StopAt()])
    assert all(groups.groups[i] == groups.groups[i + 1] for i in range(0, len(groups.groups), 2)), groups.groups
    assert groups.groups[:4] == [0, 0, 0, 0]  # held back to the end of the second window
    assert model.boost_step.stage("gradient_freeze").is_on() == kept
    if kept:
        schedule = [int(g) for g in model.boost_step.stage("gradient_freeze").plan.schedule]
        assert groups.groups[4::2] == schedule[:18]  # one group per window, from the sequence's start
    else:
        assert set(groups.groups) == {0}
    assert all(np.isfinite(np.array(w)).all() for w in model.trainable_weights)


@pytest.mark.parametrize("epochs, kept", [(2, False), (1000, True)])
def test_in_a_fit_of_unknown_length_the_gate_holds_the_first_epoch(gate, capsys, epochs, kept):
    model = compiled(small_bn_model())
    model.boost_step.stage("gradient_freeze").min_saving = -10.0  # once timed, the schedule is kept
    x, y = data()
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(16).filter(lambda a, b: True)  # unknown length
    assert int(dataset.cardinality()) == tf.data.UNKNOWN_CARDINALITY

    class StopAt(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            self.model.stop_training = len(groups.groups) == 30

    groups = Groups()
    model.fit(dataset, epochs=epochs, verbose=0, callbacks=[groups, StopAt()])
    out = capsys.readouterr().out
    assert groups.groups[:STEPS] == [0] * STEPS  # the whole first epoch held back: its length was unknown
    if kept:  # 999 epochs of 12 steps left: on from the sequence's start
        assert "before compiling its groups" not in out
        schedule = [int(g) for g in model.boost_step.stage("gradient_freeze").plan.schedule]
        assert groups.groups[STEPS:] == schedule[:len(groups.groups) - STEPS]
    else:  # the 12 steps left cannot repay three compilations; the line counts them
        assert "the 12 steps left of this fit could save at most" in out
        assert set(groups.groups) == {0} and model.train_function.traced_groups() == [0]
    assert model.boost_step.stage("gradient_freeze").is_on() == kept


def test_a_fit_that_ends_inside_the_gate_leaves_the_next_fit_to_gate(gate, capsys):
    model = compiled(small_bn_model())
    x, y = data()
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(16).filter(lambda a, b: True)
    model.fit(dataset, epochs=1, verbose=0)  # one epoch of unknown length: it ends inside the gate
    assert model.boost_step.stage("gradient_freeze").is_on() and model.train_function.traced_groups() == [0]
    # known length: gated again, and switched off. The compilation it weighs is the first fit's first step:
    # 480 steps, so that this fit's own first step (no compilation, but the epoch's start: 10-50 ms on a
    # loaded machine) would not switch it off too, and a gate that took it would let freezing go on
    x, y = data(steps=120)
    model.fit(x, y, batch_size=16, epochs=4, verbose=0)
    assert "switched off in one process before compiling its groups" in capsys.readouterr().out
    assert not model.boost_step.stage("gradient_freeze").is_on() and model.train_function.traced_groups() == [0]


def test_two_workers_pass_the_gate_together():
    """Rank 1 compiles its groups on fit's path, rank 0 ahead: both hold freezing back, both decide off together."""
    found = shared("gloo", "self_measurement_gate")
    first, second = found[0], found[1]
    assert first["decisions"] == second["decisions"] == [["gradient_freeze", False], ["gradient_centralization", True]]
    # the gate switched freezing off at step 2; GC's verdict came once the full step had 5 timed steps
    assert first["decided_at"] == second["decided_at"] == 5
    assert first["groups"] == second["groups"] == [0] * 48
    assert first["position"] == second["position"] == 0
    assert first["tracing"] == second["tracing"] == ["step0:1", "steps0:1"]
    assert first["digest"] == second["digest"] and first["finite"]
