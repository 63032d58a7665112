"""MindSpore's names and configs work as its API document says."""

import warnings

import keras
import numpy as np
import pytest
import tensorflow as tf

import keras_boost as kb
from tests.helpers import max_diff, weights
from tests.launch import shared
from tests.test_mindspore_api import classifier, data, momentum

# MindSpore's documented boost_config_dict: every section, dim_reduce with the feature off.
MINDSPORE_CONFIG = {
    "boost": {"mode": "auto", "less_bn": False, "grad_freeze": False, "adasum": False, "grad_accumulation": False,
              "dim_reduce": False, "loss_scale_group": False},
    "common": {"gradient_split_groups": [50, 100], "device_number": 8},
    "less_bn": {"fn_flag": True, "gc_flag": True},
    "grad_freeze": {"param_groups": 10, "freeze_type": 1, "freeze_p": 0.7, "total_steps": 65536},
    "grad_accumulation": {"grad_accumulation_step": 1},
    "dim_reduce": {"rho": 0.55, "gamma": 0.9, "alpha": 0.001, "sigma": 0.4, "n_components": 32,
                   "pca_mat_path": None, "weight_load_dir": None, "timeout": 1800},
}
LOSS = keras.losses.CategoricalCrossentropy(from_logits=True)


# ------------------------------------------------------------------ 3. configurations
@pytest.mark.parametrize("level", ["O0", "O1", "O2"])
def test_mindspore_documented_config_trains_in_one_process(level):
    model = classifier(model_class=kb.BoostModel)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model = kb.BoostModel(model.inputs, model.outputs, boost_level=level, boost_config_dict=MINDSPORE_CONFIG)
        model.compile(optimizer=momentum(), loss=LOSS)
        x, y = data()
        before = weights(model)
        history = model.fit(x, y, batch_size=16, epochs=1, verbose=0)
    messages = [str(w.message) for w in caught]
    assert np.isfinite(history.history["loss"]).all() and max_diff(before, weights(model)) > 1e-4
    assert model.auto_boost.params["dim_reduce"]["n_components"] == 32
    adasum_off = [m for m in messages if m.startswith("AdaSum is off: device_number (8)")]
    assert len(adasum_off) == (1 if level == "O2" else 0)  # one warning, as MindSpore leaves AdaSum off
    if level != "O0":  # the documented switches (all False) are ignored in auto mode, and said so
        assert any("take effect only with mode 'manual'" in m for m in messages)


@pytest.mark.parametrize("feature", ["dim_reduce", "loss_scale_group"])
def test_unprovided_feature_raises_only_when_switched_on(feature):
    kb.AutoBoost("O1", {**MINDSPORE_CONFIG, "boost": {"mode": "manual", feature: False}})
    with pytest.raises(ValueError, match=rf"\['{feature}'\] are MindSpore features that keras_boost does not provide"):
        kb.AutoBoost("O1", {**MINDSPORE_CONFIG, "boost": {"mode": "manual", feature: True}})


def test_unknown_keys_still_raise():
    with pytest.raises(ValueError, match=r"unknown key\(s\) \['device_num'\]"):
        kb.AutoBoost("O2", {"common": {"device_num": 8}})


def test_explicit_adasum_with_unfit_device_number_fails_at_compile():
    config = {"boost": {"mode": "manual", "adasum": True}, "common": {"device_number": 8}}
    model = kb.BoostModel(*_io(), boost_level="O0", boost_config=config)
    with pytest.raises(ValueError, match=r"AdaSum's device_number \(8\) must divide the number of workers \(1\)"):
        model.compile(optimizer=momentum(), loss=LOSS)
    with pytest.raises(ValueError, match=r"device_number \(8\) must divide"):
        kb.BoostModel(*_io()).compile(optimizer=momentum(), loss=LOSS, adasum=kb.AdaSum(device_number=8))


def _io():
    model = classifier()
    return model.inputs, model.outputs


def test_mindspore_config_on_two_workers():
    results = shared("gloo", "mindspore_config")  # the first scenario of the shared Gloo launch
    for rank in (0, 1):
        result = results[rank]
        assert result["explicit_error"].startswith("AdaSum's device_number (8) must divide the number of workers (2)")
        assert result["adasum_off_warnings"] == 1
        for level in ("O0", "O1", "O2"):
            assert np.isfinite(result[level]["loss"]) and result[level]["changed"]
    for key in ("O0", "O1", "O2", "cell"):  # the workers agree bit for bit
        assert results[0][key]["checksum"] == results[1][key]["checksum"]


# ------------------------------------------------------ 1. eval shares the trained weights
def test_eval_network_shares_the_trained_variables():
    auto = kb.AutoBoost("O1", {"grad_freeze": {"total_steps": 8}})
    network = classifier()
    untrained = network.predict(data()[0], verbose=0)
    model, optimizer = auto.network_auto_process_train(network, momentum())
    model.compile(optimizer=optimizer, loss=LOSS)
    x, y = data()
    model.fit(x, y, batch_size=16, epochs=2, verbose=0)
    for given in (network, model, keras.Model(network.inputs, network.outputs)):
        evaluated = auto.network_auto_process_eval(given)
        assert {id(v) for v in evaluated.weights} == {id(v) for v in model.weights}
    trained = auto.network_auto_process_eval(network).predict(x, verbose=0)
    assert np.abs(trained - untrained).max() > 1e-3


# -------------------------------------------------- 2. the GC optimizer, selected variables
def test_gc_optimizer_centres_only_the_selected_variables():
    model = keras.Sequential([keras.Input((16,)), keras.layers.Dense(16, name="a"), keras.layers.Dense(16, name="b")])
    first, _, second, _ = model.trainable_variables
    inner = keras.optimizers.SGD(1.0)
    optimizer = kb.optimizers.CentralizedOptimizer(inner, kb.GradientCentralization([first]))
    grads = [tf.reshape(tf.range(256, dtype=tf.float32), (16, 16)), tf.zeros(16)] * 2
    start = [v.numpy() for v in model.trainable_variables]
    optimizer.apply(grads, model.trainable_variables)
    g = grads[0].numpy()
    np.testing.assert_allclose(first.numpy(), start[0] - (g - g.mean(axis=0)), atol=1e-5)
    np.testing.assert_allclose(second.numpy(), start[2] - g, atol=1e-5)
    assert kb.optimizers.CentralizedOptimizer.from_config(optimizer.get_config()).get_config()["centralization"] == {
        "variables": [first.path], "min_channels_multiple": 16}


# ------------------------------------------------------- 4. network_auto_process_train
class Sub(keras.Model):
    def __init__(self):
        super().__init__()
        self.hidden = keras.layers.Dense(16, activation="tanh")
        self.out = keras.layers.Dense(4)

    def call(self, x):
        return self.out(self.hidden(x))


def test_auto_process_train_subclassed_model_at_o0():
    network = Sub()
    model, optimizer = kb.AutoBoost("O0").network_auto_process_train(network, momentum())
    model.compile(optimizer=optimizer, loss=LOSS)
    x, y = data()
    model.fit(x, y, batch_size=16, epochs=1, verbose=0)
    assert {id(v) for v in model.trainable_variables} == {id(v) for v in network.trainable_variables}
    with pytest.raises(TypeError, match="subclassed Sub"):
        kb.AutoBoost("O1").network_auto_process_train(Sub(), momentum())


def test_auto_process_train_without_dense_head_skips_fn_and_says_so():
    x_in = keras.Input((8,))
    h = keras.layers.Dense(4)(x_in)
    network = keras.Model(x_in, keras.layers.Activation("softmax", name="probabilities")(
        keras.layers.BatchNormalization()(h)))
    given = kb.AutoBoost("O1", {"grad_freeze": {"total_steps": 8}, "less_bn": {"fn_flag": True}})
    with pytest.warns(UserWarning, match="no Dense layer producing its output, so the FN head is skipped"):
        processed, _ = given.network_auto_process_train(network, momentum())  # the less_bn section: MindSpore's
    assert processed.less_bn_report.fn_heads == ()
    auto = kb.AutoBoost("O1", {"grad_freeze": {"total_steps": 8}})  # the level decides: as BoostModel(boost_level=)
    with pytest.warns(UserWarning, match="found no BatchNormalization layer to remove"):
        model, optimizer = auto.network_auto_process_train(network, momentum())
    assert model.less_bn_report.fn_heads == () and model.less_bn_report.not_classifiers == ("probabilities",)
    again, same = auto.network_auto_process_train(network, optimizer)  # called twice
    assert again is model and same is optimizer
    assert auto.network_auto_process_train(model, optimizer)[0] is model


def test_auto_process_train_keeps_the_users_optimizer():
    class Halving(keras.optimizers.schedules.LearningRateSchedule):  # unregistered, no get_config
        def __call__(self, step):
            return 0.01 / (1.0 + tf.cast(step, tf.float32))

    optimizer = keras.optimizers.AdamW(Halving(), weight_decay=0.5)
    optimizer.exclude_from_weight_decay(var_names=["bias"])
    model, returned = kb.AutoBoost("O1", {"grad_freeze": {"total_steps": 8}}).network_auto_process_train(
        classifier(), optimizer)
    assert returned is optimizer
    model.compile(optimizer=returned, loss=LOSS)
    x, y = data()
    before = weights(model)
    model.fit(x, y, batch_size=16, epochs=1, verbose=0)
    assert max_diff(before, weights(model)) > 1e-5
    bias = next(v for v in model.trainable_variables if v.path.endswith("bias"))
    assert optimizer._use_weight_decay(bias) is False and int(optimizer.iterations.numpy()) == 2


# ---------------------------------------------------------------- 5. the cells' methods
def test_cell_methods():
    x, y = data()
    network, big = classifier(), classifier()
    step = kb.BoostTrainOneStep(network, momentum(), loss_fn=LOSS, gradient_accumulation=2)
    assert step.check_adasum_enable() is False
    step(x[:16], y[:16])  # builds; first micro-batch of the window
    with tf.GradientTape() as tape:
        loss = LOSS(y[16:], network(x[16:], training=True))
    assert step.gradient_accumulation_process(loss, tape.gradient(loss, network.trainable_variables)) is loss
    big.compile(optimizer=momentum(), loss=LOSS)
    big.fit(x, y, batch_size=32, epochs=1, verbose=0)
    assert max_diff(weights(network), weights(big)) < 1e-5  # two micro-batches = one batch of 32

    adasum_net = classifier()
    adasum_step = kb.BoostTrainOneStep(adasum_net, momentum(), loss_fn=LOSS, adasum=kb.AdaSum(device_number=1))
    assert adasum_step.check_adasum_enable(adasum_step.optimizer, True) is True  # before build: switched on
    adasum_step(x, y)
    assert adasum_step.check_adasum_enable() is False  # one worker: a plain step, as MindSpore's check says
    before = weights(adasum_net)
    with tf.GradientTape() as tape:
        loss = LOSS(y, adasum_net(x, training=True))
    adasum_step.adasum_process(loss, tape.gradient(loss, adasum_net.trainable_variables))
    assert max_diff(before, weights(adasum_net)) > 1e-4

    freeze_net = classifier(depth=6)
    _, freeze_opt = kb.GradientFreeze(3, 0, 0.5, 10).freeze_generate(freeze_net, momentum())
    freeze_step = kb.BoostTrainOneStep(freeze_net, freeze_opt, loss_fn=LOSS)
    assert np.isfinite(float(freeze_step.gradient_freeze_process(x, y)))
    with pytest.raises(ValueError, match="gradient_freeze_process needs a freeze stage"):
        step.gradient_freeze_process(x, y)


def test_standalone_cell_needs_a_loss():
    with pytest.raises(TypeError, match="needs a loss: pass loss_fn"):
        kb.BoostTrainOneStep(classifier(), momentum())(*data())


# ---------------------------------------------------------------- 6. FreezeOpt everywhere
def test_freeze_opt_is_an_optimizer_and_given_once():
    network = classifier()
    _, freeze_opt = kb.GradientFreeze(2, 1, 0.5, 10).freeze_generate(network, momentum())
    model = kb.BoostModel(network.inputs, network.outputs)
    with pytest.raises(ValueError, match="pass the freeze groups once"):
        model.compile(optimizer=freeze_opt, loss=LOSS, gradient_freeze=kb.GradientFreeze(2))
    model.compile(optimizer=freeze_opt, loss=LOSS)
    assert model.optimizer is freeze_opt.optimizer and model.boost_step.stage("gradient_freeze") is not None


# ----------------------------------------------------------- 7. GradientAccumulation(…, optimizer)
def test_gradient_accumulation_optimizer_is_checked():
    model = classifier(model_class=kb.BoostModel)
    with pytest.raises(ValueError, match="must be the optimizer the step trains with"):  # built model: at compile
        model.compile(optimizer=momentum(), loss=LOSS, gradient_accumulation=kb.GradientAccumulation(2, momentum()))
    optimizer = momentum()
    model.compile(optimizer=optimizer, loss=LOSS, gradient_accumulation=kb.GradientAccumulation(2, optimizer))
    with pytest.raises(ValueError, match="needs its optimizer"):
        kb.GradientAccumulation(2)(tf.constant(1.0), [])


# ------------------------------------------------------------------------ 8. aliases
def test_mindspore_keyword_aliases():
    assert kb.AutoBoost("O1", boost_config_dict={"grad_freeze": {"total_steps": 7}}).params["grad_freeze"][
        "total_steps"] == 7
    with pytest.raises(TypeError, match="`boost_config` and `boost_config_dict` are the same argument"):
        kb.AutoBoost("O1", {}, boost_config_dict={"common": {}})
    assert kb.DynamicLossScale(loss_scale_value=2**12).init_scale == 4096.0
    assert kb.GradientFreeze(10, 1, 0.5, 2000.0).total_steps == 2000
    assert len(kb.generate_freeze_index_sequence(4, 1, 0.5, 100.0)) == 101
    with pytest.raises(TypeError, match="`total_steps` must be a positive int"):
        kb.GradientFreeze(10, 1, 0.5, 2000.5)


def test_freeze_opt_and_gc_optimizer_survive_a_keras_file(tmp_path):
    x, y = data(16)
    model = classifier(depth=2)
    freeze_opt = kb.FreezeOpt(keras.optimizers.SGD(0.1), kb.split_parameters_groups(model, 2), [0, 1, 1])
    model.compile(optimizer=freeze_opt, loss=LOSS)
    model.fit(x, y, batch_size=8, epochs=1, verbose=0)
    model.save(tmp_path / "freeze.keras")
    loaded = keras.models.load_model(tmp_path / "freeze.keras")
    assert isinstance(loaded.optimizer, kb.FreezeOpt) and int(loaded.optimizer.position.numpy()) == 2
    assert [[v.path for v in g] for g in loaded.optimizer.groups] == [
        [v.path for v in g] for g in kb.split_parameters_groups(loaded, 2)]

    kernel = model.trainable_variables[0]
    model.compile(optimizer=kb.optimizers.CentralizedOptimizer(keras.optimizers.SGD(0.1),
                                                               kb.GradientCentralization([kernel], 1)),
                  loss=LOSS)
    model.fit(x, y, batch_size=8, epochs=1, verbose=0)
    model.save(tmp_path / "gc.keras")
    loaded = keras.models.load_model(tmp_path / "gc.keras")
    assert [loaded.optimizer.applies_to(v) for v in loaded.trainable_variables] == [
        v is kernel for v in model.trainable_variables]
