"""Saving and restoring a BoostModel with its boost configuration and state."""

import keras
import numpy as np
import tensorflow as tf

import keras_boost  # noqa: F401 - registers the classes, as a user's import does
from keras_boost import BoostModel, DynamicLossScale, GradientFreeze
from keras_boost.app.demo_net import demo_resnet


def trained_o1_model(steps=6):
    base = demo_resnet(model_class=keras.Model)
    model = BoostModel(base.inputs, base.outputs, boost_level="O1",
                       boost_config={"grad_freeze": {"total_steps": 40, "param_groups": 4,
                                                     "freeze_type": 1}})  # interval: update 2 of 3 is frozen
    model.compile(optimizer=keras.optimizers.SGD(0.05, momentum=0.9),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True), metrics=["accuracy"],
                  loss_scale=DynamicLossScale(init_scale=64.0, scale_window=4), gradient_accumulation=2)
    rng = np.random.default_rng(0)
    x = rng.random((16 * steps, 28, 28, 1), dtype=np.float32)
    y = rng.integers(0, 10, 16 * steps)
    model.fit(x, y, batch_size=16, epochs=1, verbose=0)
    return model, x


def test_keras_file_round_trip_without_custom_objects(tmp_path):
    model, x = trained_o1_model()
    path = tmp_path / "boost.keras"
    model.save(path)
    loaded = keras.models.load_model(path)
    assert isinstance(loaded, BoostModel)
    assert any(isinstance(l, keras_boost.FNHead) for l in loaded.layers)
    np.testing.assert_array_equal(model.predict(x[:8], verbose=0), loaded.predict(x[:8], verbose=0))
    # the boost configuration came back...
    step = loaded.boost_step
    assert isinstance(step.stage("loss_scale"), DynamicLossScale) and step.stage("loss_scale").scale_window == 4
    assert step.stage("gradient_accumulation").max_accumulation_step == 2
    assert isinstance(step.stage("gradient_freeze").source, GradientFreeze) and step.stage("gradient_freeze").source.param_groups == 4
    assert step.stage("gradient_centralization") is not None and loaded.auto_boost.level == "O1"
    # ...and so did every piece of boost and optimizer state
    for a, b in zip(model.boost_state.variables, loaded.boost_state.variables):
        np.testing.assert_array_equal(np.array(a), np.array(b))
    for a, b in zip(model.optimizer.variables, loaded.optimizer.variables):
        np.testing.assert_array_equal(np.array(a), np.array(b))
    assert int(loaded.boost_step.stage("gradient_freeze").position.numpy()) == 3  # 6 micro-batches, windows of 2


def test_tf_checkpoint_restores_boost_state(tmp_path):
    model, _ = trained_o1_model()
    checkpoint = tf.train.Checkpoint(model=model, optimizer=model.optimizer)
    path = checkpoint.save(str(tmp_path / "ckpt"))
    other, _ = trained_o1_model(steps=2)
    tf.train.Checkpoint(model=other, optimizer=other.optimizer).restore(path).assert_existing_objects_matched()
    for a, b in zip(model.boost_state.variables, other.boost_state.variables):
        np.testing.assert_array_equal(np.array(a), np.array(b))
