"""AutoBoost: levels, modes, config merging, defaults, errors; processing a model for training."""

import json
import re

import keras
import numpy as np
import pytest

import keras_boost as kb
from keras_boost import AdaSum, AutoBoost, BoostModel, GradientCentralization, generate_freeze_index_sequence
from keras_boost.config import DEFAULTS, FEATURES
from keras_boost.stages.freeze import FreezeStage
from keras_boost.app.demo_net import demo_resnet
from tests.helpers import classification_data


@pytest.mark.parametrize("level, on", [("O0", set()), ("O1", {"less_bn", "grad_freeze"}),
                                       ("O2", {"less_bn", "grad_freeze", "adasum"})])
def test_level_table(level, on):
    auto = AutoBoost(level)
    assert {k for k, v in auto.features.items() if v} == on
    assert auto.params == DEFAULTS


@pytest.mark.parametrize("config, gc, groups, strategy, freeze_p", [
    (None, True, 4, 0, 0.7),  # keras_boost's defaults (docs/auto_boost.md, "O1's defaults")
    (kb.MINDSPORE_DEFAULTS, True, 10, 1, 0.7),  # MindSpore's, on request
    ({**kb.MINDSPORE_DEFAULTS, "grad_freeze": {"freeze_p": 0.5}}, True, 4, 0, 0.5),  # sections merge key by key
    ({"less_bn": {"gc_flag": False}}, False, 4, 0, 0.7),
])
def test_o1_defaults_and_mindspore_defaults_on_request(config, gc, groups, strategy, freeze_p):
    base = demo_resnet(model_class=keras.Model)
    model = BoostModel(base.inputs, base.outputs, boost_level="O1", boost_config=config)
    model.compile(optimizer=keras.optimizers.SGD(0.05), loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    step = model.boost_step
    assert isinstance(step.stage("gradient_centralization"), GradientCentralization) is gc
    assert len(step.stage("gradient_freeze").plan.branches) == groups
    expected = generate_freeze_index_sequence(groups, strategy, freeze_p, 40)
    np.testing.assert_array_equal(np.asarray(step.stage("gradient_freeze").plan.schedule[:40]), np.asarray(expected[:40]))


def test_modes():
    assert not any(AutoBoost("O2", {"boost": {"mode": "disable_all"}}).features.values())
    assert all(AutoBoost("O0", {"boost": {"mode": "enable_all"}}).features.values())
    manual = AutoBoost("O1", {"boost": {"mode": "manual", "grad_freeze": False, "grad_accumulation": True}})
    assert manual.features == {"less_bn": True, "grad_freeze": False, "adasum": False, "grad_accumulation": True}


def test_no_singleton_each_autoboost_is_its_own():
    first = AutoBoost("O1", {"boost": {"mode": "manual", "less_bn": False}})
    second = AutoBoost("O1")
    assert first.features["less_bn"] is False and second.features["less_bn"] is True
    assert AutoBoost("O1").features == second.features  # the level table was not mutated


def test_config_merging_and_json_file(tmp_path):
    config = {"grad_freeze": {"freeze_p": 0.5, "total_steps": 100}, "common": {"device_number": 2}}
    path = tmp_path / "boost.json"
    path.write_text(json.dumps(config))
    for source in (config, str(path)):
        auto = AutoBoost("O2", source)
        assert auto.params["grad_freeze"] == {**DEFAULTS["grad_freeze"], "freeze_p": 0.5, "total_steps": 100}
        assert auto.params["less_bn"] == DEFAULTS["less_bn"]
        assert auto.params["common"]["device_number"] == 2


@pytest.mark.parametrize("level, config, error, match", [
    ("O3", None, ValueError, r"level must be one of \['O0', 'O1', 'O2'\]"),
    ("O1", {"boost": {"mode": "fast"}}, ValueError, "The boost mode must be in"),
    ("O1", {"dim_reduce": {"n_component": 32}}, ValueError, r"unknown key\(s\) \['n_component'\]"),  # tutorial typo
    ("O1", {"grad_freeze": {"freeze_pp": 0.5}}, ValueError, r"unknown key\(s\) \['freeze_pp'\].*valid keys"),
    ("O1", {"common": {"device_num": 8}}, ValueError, "device_num"),  # the tutorial's typo is not ignored
    ("O1", {"boost": {"mode": "manual", "dim_reduce": True}}, ValueError, "does not provide"),
    ("O1", {"boost": {"mode": "manual", "adasum": "yes"}}, TypeError, r"must be a bool \(True or False\), got 'yes'"),
    ("O1", {"grad_freeze": {"freeze_p": 1.5}}, ValueError, "freeze_p"),
    ("O1", {"grad_freeze": {"param_groups": 0}}, ValueError, "param_groups"),
    ("O1", {"grad_accumulation": {"grad_accumulation_step": 0}}, ValueError, "max_accumulation_step"),
    ("O1", {"less_bn": {"fn_flag": 1}}, TypeError, "fn_flag"),
    ("O1", {"common": {"gradient_split_groups": 50}}, ValueError, "gradient_split_groups"),
    ("O1", {"common": {"gradient_split_groups": [100, 50]}}, ValueError, "strictly increasing"),
    ("O1", {"adasum": {"backend": "fast"}}, ValueError, "`backend` must be one of"),
    ("O1", {"common": {"device_number": 0}}, ValueError, "`device_number` must be None or a positive int, got 0"),
    ("O1", [1, 2], TypeError, "boost_config must be a dict"),
    ("O1", {"boost": []}, TypeError, r"boost_config\['boost'\] must be a dict"),
])
def test_bad_configuration(level, config, error, match):
    with pytest.raises(error, match=match):
        AutoBoost(level, config)


def test_bad_json_file(tmp_path):
    path = tmp_path / "bad.json"
    path.write_text("{'boost': 1}")
    with pytest.raises(ValueError, match="not valid JSON"):
        AutoBoost("O1", str(path))


def test_network_auto_process_train_demo_model():
    auto = AutoBoost("O2", {"grad_freeze": {"total_steps": 40, "param_groups": 4}})
    base = demo_resnet(model_class=keras.Model)
    model, optimizer = auto.network_auto_process_train(base, keras.optimizers.SGD(0.05, momentum=0.9))
    assert isinstance(model, BoostModel) and model.auto_boost is auto
    assert model.less_bn_report.num_removed == 5
    assert sum(isinstance(l, keras.layers.BatchNormalization) for l in base.layers) == 9  # input unchanged
    model.compile(optimizer=optimizer, loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    step = model.boost_step
    assert isinstance(step.stage("gradient_freeze"), FreezeStage)
    assert isinstance(step.stage("gradient_centralization"), GradientCentralization) and isinstance(step.stage("adasum"), AdaSum)
    x = np.random.default_rng(0).random((64, 28, 28, 1), dtype=np.float32)
    y = np.arange(64) % 10
    history = model.fit(x, y, batch_size=16, epochs=3, verbose=0)
    assert np.isfinite(history.history["loss"]).all()
    assert history.history["loss"][-1] < history.history["loss"][0]
    assert auto.network_auto_process_eval(model) is model


def test_network_auto_process_train_resnet50():
    # the interval strategy (its second step trains group 1), 2 traced branches, not 10
    auto = AutoBoost("O1", {"grad_freeze": {"total_steps": 4, "param_groups": 2, "freeze_type": 1}})
    base = keras.applications.ResNet50(weights=None, input_shape=(32, 32, 3), classes=10, classifier_activation=None)
    model, optimizer = auto.network_auto_process_train(base, keras.optimizers.SGD(0.01, momentum=0.9))
    assert model.less_bn_report.num_removed == 36
    assert sum(isinstance(l, keras.layers.BatchNormalization) for l in model.layers) == 53 - 36
    model.compile(optimizer=optimizer, loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    step = model.boost_step
    assert isinstance(step.stage("gradient_freeze"), FreezeStage) and len(step.stage("gradient_freeze").group_indices) == 2
    assert isinstance(step.stage("gradient_centralization"), GradientCentralization) and step.stage("adasum") is None
    x = np.random.default_rng(0).random((8, 32, 32, 3), dtype=np.float32)
    y = np.arange(8) % 10
    groups = []
    for _ in range(2):
        before = [np.array(v) for v in model.trainable_variables]
        logs = model.train_on_batch(x, y, return_dict=True)
        assert np.isfinite(logs["loss"])
        group = int(logs["freeze_group"])
        groups.append(group)
        trained = set(step.stage("gradient_freeze").group_indices[group])
        for index, (variable, old) in enumerate(zip(model.trainable_variables, before)):
            # the step's group trained (every one of its variables moved), the rest stayed bit-identical
            assert np.array_equal(np.array(variable), old) == (index not in trained), (group, variable.path)
    assert groups == [int(g) for g in step.stage("gradient_freeze").plan.schedule[:2]]
    assert int(model.optimizer.iterations.numpy()) == 2


def test_boost_level_on_the_model():
    base = demo_resnet(model_class=keras.Model)
    model = BoostModel(base.inputs, base.outputs, boost_level="O1", boost_config={"grad_freeze": {"total_steps": 8}})
    assert model.less_bn_report.num_removed == 5
    model.compile(optimizer="sgd", loss="mse")
    assert model.boost_step.stage("gradient_freeze") is not None
    explicit = BoostModel(base.inputs, base.outputs, boost_level="O1")
    explicit.compile(optimizer="sgd", loss="mse", gradient_centralization=False)
    assert explicit.boost_step.stage("gradient_centralization") is None  # an explicit compile option wins...
    assert explicit.boost_step.stage("gradient_freeze") is not None  # ...over the level's, for that option only


def test_boost_level_without_less_bn_on_a_subclassed_model():
    class Net(BoostModel):
        def __init__(self, **kwargs):
            super().__init__(**kwargs)
            self.dense = keras.layers.Dense(4)

        def call(self, x):
            return self.dense(x)

    with pytest.raises(TypeError, match="build the BoostModel functionally"):
        Net(boost_level="O1")
    net = Net(boost_level="O1", boost_config={"boost": {"mode": "manual", "less_bn": False},
                                              "grad_freeze": {"total_steps": 8, "param_groups": 1}})
    net.compile(optimizer="sgd", loss="mse")
    x, _ = classification_data(n=16)
    net.fit(x, np.zeros((16, 4), np.float32), verbose=0)
    assert net.boost_step.stage("gradient_freeze") is not None


def test_features_list_is_the_seed_subset():
    assert FEATURES == ("less_bn", "grad_freeze", "adasum", "grad_accumulation")
    for feature in FEATURES:  # each is a switch of its own: manual mode turns on exactly it
        auto = AutoBoost("O0", {"boost": {"mode": "manual", feature: True}})
        assert {k for k, v in auto.features.items() if v} == {feature}


def test_a_subclassed_boostmodel_at_a_lessbn_level_is_told_what_works():
    class Net(BoostModel):
        def __init__(self, **kwargs):
            super().__init__(**kwargs)
            self.conv, self.head = keras.layers.Conv2D(4, 3), keras.layers.Dense(3)

        def call(self, x, training=False):
            return self.head(keras.ops.mean(keras.ops.relu(self.conv(x)), axis=(1, 2)))

    with pytest.raises(TypeError, match=r"boost_level='O1' includes LessBN.*Net is a subclassed model") as error:
        Net(boost_level="O1")
    advice = eval(re.search(r"boost_config=(\{.*\})$", str(error.value)).group(1))  # the advice, as printed
    model = Net(boost_level="O1", boost_config=advice)
    model.compile(optimizer=keras.optimizers.SGD(0.1, momentum=0.9),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    assert model.boost_step.stage("gradient_freeze") is not None  # the level's other features stay on
    x = np.random.default_rng(0).random((32, 8, 8, 1), dtype=np.float32)
    model.fit(x, np.arange(32) % 3, batch_size=16, epochs=1, verbose=0)


def test_network_auto_process_train_keeps_dict_outputs_and_their_names():
    keras.utils.set_random_seed(7)
    inputs = keras.Input((8, 8, 3))
    x = inputs
    for _ in range(3):
        x = keras.layers.ReLU()(keras.layers.BatchNormalization()(keras.layers.Conv2D(4, 3, padding="same")(x)))
    x = keras.layers.GlobalAveragePooling2D()(x)
    base = keras.Model(inputs, {"label": keras.layers.Dense(3, activation="softmax", name="head")(x),
                                "large": keras.layers.Dense(1, activation="sigmoid", name="large")(x)})
    model, optimizer = AutoBoost("O1").network_auto_process_train(base, keras.optimizers.SGD(0.01))
    assert model.output_names == base.output_names == ["head", "large"]
    assert sorted(model.less_bn_report.fn_heads) == ["head", "large"]
    model.compile(optimizer, loss={"label": "sparse_categorical_crossentropy", "large": "binary_crossentropy"})
    rng = np.random.default_rng(0)
    data = rng.normal(size=(32, 8, 8, 3)).astype(np.float32)
    model.fit(data, {"label": rng.integers(0, 3, 32), "large": rng.integers(0, 2, (32, 1))}, batch_size=16, verbose=0)
    assert sorted(model.predict(data, verbose=0)) == ["label", "large"]


@pytest.mark.parametrize("option, stage", [("gradient_freeze", "FreezeStage"),
                                           ("gradient_centralization", "GradientCentralization"),
                                           ("gradient_accumulation", "GradientAccumulation"),
                                           ("adasum", "AdaSum"), ("loss_scale", "DynamicLossScale")])
def test_false_switches_off_the_levels_stage_of_an_option(option, stage):
    # Found trying O1 piece by piece: gradient_centralization=False and adasum=False worked, while
    # gradient_freeze=False and gradient_accumulation=False were a TypeError.
    base = demo_resnet(model_class=keras.Model)
    config = {"boost": {"mode": "enable_all"}, "grad_accumulation": {"grad_accumulation_step": 2}}
    policy = keras.config.dtype_policy()
    keras.config.set_dtype_policy("mixed_float16" if option == "loss_scale" else "float32")
    try:
        level = BoostModel(base.inputs, base.outputs, boost_level="O2", boost_config=config)
        level.compile(optimizer="sgd", loss="sparse_categorical_crossentropy")
        assert stage in [type(s).__name__ for s in level.boost_step.stages]
        off = BoostModel(base.inputs, base.outputs, boost_level="O2", boost_config=config)
        off.compile(optimizer="sgd", loss="sparse_categorical_crossentropy", **{option: False})
        names = {type(s).__name__ for s in off.boost_step.stages}
        assert stage not in names
        # AdaSum's place is averaging's and the plain update's; without loss scaling the NaN guard's
        replacements = {"Average", "OptimizerUpdate", "NanGuard"}
        assert names - replacements == {type(s).__name__ for s in level.boost_step.stages} - replacements - {stage}
    finally:
        keras.config.set_dtype_policy(policy)


def test_gradient_freeze_true_is_mindspores_default_freezing():
    model = BoostModel(*(lambda m: (m.inputs, m.outputs))(demo_resnet(model_class=keras.Model)))
    model.compile(optimizer="sgd", loss="sparse_categorical_crossentropy", gradient_freeze=True)
    source = model.boost_step.stage("gradient_freeze").source
    assert source.get_config() == kb.GradientFreeze().get_config()
    with pytest.raises(TypeError, match=r"`gradient_freeze` must be None, a bool, a GradientFreeze or a FreezeOpt, "
                                        r"got 'yes' \(str\)"):
        model.compile(optimizer="sgd", loss="sparse_categorical_crossentropy", gradient_freeze="yes")
