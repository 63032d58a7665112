"""The stage contract: a new stage needs only its own file and one registry line."""

import keras
import numpy as np
import pytest
import tensorflow as tf

from keras_boost import AdaSum, BoostModel, DynamicLossScale, FixedLossScale, GradientAccumulation
from keras_boost import GradientCentralization, GradientFreeze
from keras_boost.stages.freeze import FreezeStage
from keras_boost.stages.fused_update import FusedUpdate
from keras_boost.stages.nan_guard import NanGuard
from keras_boost.core.rewrite import ModelRewrite
from keras_boost.step import Stage, registry
from tests.helpers import classification_data, mlp, weights


class ClipByGlobalNorm(Stage):
    """A toy stage: clips the averaged gradients to a global norm (written here, registered here)."""

    option = "gradient_clip_norm"

    def __init__(self, clip_norm):
        self.clip_norm = float(clip_norm)

    @classmethod
    def from_option(cls, value, model):
        if value is None:
            return None
        return value if isinstance(value, cls) else cls(value)

    def transform(self, grads, variables):
        return tf.clip_by_global_norm(grads, self.clip_norm)[0]

    def get_config(self):
        return {"clip_norm": self.clip_norm}


class SecondApplier(Stage):
    option = "second_applier"

    @classmethod
    def from_option(cls, value, model):
        return cls() if value else None

    def apply_update(self, optimizer, grads, variables):
        optimizer.apply(grads, variables)


@pytest.fixture
def clip_registered():
    registry.register(ClipByGlobalNorm)
    yield
    registry.unregister(ClipByGlobalNorm.option)


def _train(model, x, y, **compile_kwargs):
    model.compile(optimizer=compile_kwargs.pop("optimizer"),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True), **compile_kwargs)
    model.fit(x, y, batch_size=32, epochs=2, shuffle=False, verbose=0)
    return weights(model)


def test_toy_stage_equals_keras_global_clipnorm(clip_registered):
    x, y = classification_data(128)
    boosted = _train(mlp(), x, y, optimizer=keras.optimizers.SGD(0.5), gradient_clip_norm=0.05)
    reference = _train(mlp(keras.Model), x, y, optimizer=keras.optimizers.SGD(0.5, global_clipnorm=0.05))
    unclipped = _train(mlp(), x, y, optimizer=keras.optimizers.SGD(0.5))
    for a, b in zip(boosted, reference):
        np.testing.assert_allclose(a, b, atol=1e-6)
    assert max(float(np.max(np.abs(a - b))) for a, b in zip(boosted, unclipped)) > 1e-3  # clipping acted


def test_registered_option_round_trips_through_compile_config(clip_registered):
    model = mlp()
    model.compile(optimizer="sgd", loss="mse", gradient_clip_norm=0.25)
    config = registry.step_config(model.boost_step)
    options = registry.options_from_config(config)
    assert isinstance(options["gradient_clip_norm"], ClipByGlobalNorm)
    assert options["gradient_clip_norm"].clip_norm == 0.25


def test_unknown_option_is_a_type_error_naming_it():
    with pytest.raises(TypeError, match="gradient_clip_norm"):
        mlp().compile(optimizer="sgd", loss="mse", gradient_clip_norm=0.25)


def test_two_stages_defining_apply_update_are_refused():
    registry.register(SecondApplier)
    try:
        with pytest.raises(ValueError, match="only one stage may define the `apply_update` hook"):
            mlp().compile(optimizer="sgd", loss="mse", adasum=True, second_applier=True)
    finally:
        registry.unregister(SecondApplier.option)


def test_register_rejects_a_non_stage_and_an_unnamed_stage():
    with pytest.raises(TypeError, match="Stage subclass"):
        registry.register(dict)

    class Nameless(Stage):
        pass

    with pytest.raises(ValueError, match="must name its compile keyword"):
        registry.register(Nameless)


@pytest.mark.parametrize("stage", [
    DynamicLossScale(init_scale=64.0, scale_window=7, hysteresis=2),
    FixedLossScale(8.0, drop_overflow_update=False),
    GradientAccumulation(3),
    FreezeStage(GradientFreeze(param_groups=2, freeze_p=0.5, total_steps=10)),
    GradientCentralization(min_channels_multiple=4),
    AdaSum(device_number=1, backend="exact"),
    NanGuard(),
    FusedUpdate(strict=False),
], ids=lambda s: type(s).__name__)
def test_every_builtin_stage_round_trips_its_config(stage):
    restored = registry.deserialize(registry.serialize(stage))
    assert type(restored) is type(stage)
    assert restored.get_config() == stage.get_config()


def test_freeze_opt_and_gc_variables_round_trip_by_path():
    x, y = classification_data(64)
    model = mlp()
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse", gradient_centralization=True,
                  gradient_freeze=GradientFreeze(param_groups=2, freeze_p=0.5, total_steps=10))
    model.boost_step.build(model.boost_state)
    config = registry.step_config(model.boost_step)
    assert config["stages"]["gradient_centralization"]["config"]["variables"] == [
        v.path for v in model.boost_step.stage("gradient_centralization").variables]
    twin = mlp()
    twin.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse", **registry.options_from_config(config))
    twin.boost_step.build(twin.boost_state)
    assert [v.path for v in twin.boost_step.stage("gradient_centralization").variables] == [
        v.path for v in model.boost_step.stage("gradient_centralization").variables]
    assert twin.boost_step.stage("gradient_freeze").group_indices == model.boost_step.stage("gradient_freeze").group_indices


def test_adasum_and_auto_boost_construction_do_not_initialise_horovod():
    from keras_boost import AutoBoost, distributed

    distributed._state.initialized = False
    AdaSum(device_number=1)
    AutoBoost("O2")
    BoostModel  # noqa: B018 - importing the model must not initialise either
    assert distributed._state.initialized is False


def test_builtin_gradient_clipping_matches_keras_global_clipnorm():
    """`compile(gradient_clipping=c)` against Keras' own `global_clipnorm=c` on the same data.

    Both compute the same global norm of the same float32 gradients, in a different order of
    operations (tf.clip_by_global_norm against Keras' ops), hence a tolerance, not equality.
    """
    x, y = classification_data(n=256)
    clipped = _train(mlp(BoostModel, seed=0), x, y, optimizer=keras.optimizers.SGD(0.5), gradient_clipping=0.05)
    keras_clipped = _train(mlp(keras.Model, seed=0), x, y, optimizer=keras.optimizers.SGD(0.5, global_clipnorm=0.05))
    plain = _train(mlp(keras.Model, seed=0), x, y, optimizer=keras.optimizers.SGD(0.5))
    assert max(np.max(np.abs(a - b)) for a, b in zip(clipped, keras_clipped)) < 1e-5
    assert max(np.max(np.abs(a - b)) for a, b in zip(clipped, plain)) > 1e-2  # the clip was active
    with pytest.raises(ValueError, match="gradient_clipping"):
        mlp(BoostModel, seed=0).compile(optimizer="sgd", loss="mse", gradient_clipping=-1.0)


class _WiderHead(ModelRewrite):
    """A model rewrite written from outside: the output doubled by a layer of its own, at any level."""

    feature = "test_wider_head"
    attribute = "wider_head_report"

    def applies(self, boost_config):
        return boost_config is not None

    def rewrite(self, model, boost_config):
        outputs = keras.layers.Rescaling(2.0, name="doubled")(model.outputs[0])
        return keras.Model(model.inputs, outputs)

    def record(self, rewritten):
        return "doubled"

    def report(self, model):
        return {"doubled": model.wider_head_report is not None}


@pytest.fixture
def wider_head_registered():
    rewrite = registry.register_rewrite(_WiderHead())
    yield rewrite
    registry._REWRITES.remove(rewrite)


def test_a_registered_model_rewrite_runs_when_a_boost_model_is_made(wider_head_registered):
    x, _ = classification_data(n=8)
    plain = mlp()
    rewritten = mlp(model_class=lambda i, o: BoostModel(i, o, boost_level="O0"))
    assert rewritten.wider_head_report == "doubled" and plain.wider_head_report is None
    np.testing.assert_allclose(rewritten.predict(x, verbose=0), 2.0 * plain.predict(x, verbose=0), rtol=1e-6)
    assert wider_head_registered.report(rewritten) == {"doubled": True}

    class Subclassed(BoostModel):
        def call(self, x):
            return x

    with pytest.raises(TypeError, match="Subclassed is a subclassed model"):
        Subclassed(boost_level="O0")


def test_register_rewrite_rejects_what_is_not_a_rewrite():
    with pytest.raises(TypeError, match=r"`rewrite` must be a ModelRewrite instance, got <class"):
        registry.register_rewrite(_WiderHead)
