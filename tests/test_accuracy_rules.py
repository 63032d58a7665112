"""O1's accuracy rules on the models of the time-to-accuracy benchmark (keras_boost/app/recipes.py).

Each rule is checked where it fires and where it does not, on the recipes people train
(keras-io's examples, the demo), not on a model made for the rule:
- LessBN, its FN head and gradient centralization only where the model has a BatchNorm
  LessBN removes; freezing only where LessBN removed one (otherwise nothing makes up for
  the updates frozen layers skip);
- LessBN only where every output comes from a classifier Dense (a regression head keeps
  every BatchNorm).
The accuracy these rules keep is measured in docs/time_to_accuracy.md (3 seeds per model).
"""

import keras
import numpy as np
import pytest

from keras_boost import BoostModel
from keras_boost.app import recipes
from keras_boost.app.data import load_fashion_mnist


def o1_model(name):
    recipe = recipes.recipe(name)
    keras.utils.set_random_seed(0)
    base = recipe.build()
    model = BoostModel(base.inputs, base.outputs, name=base.name, boost_level="O1")
    model.compile(optimizer=recipe.optimizer(recipe.lr),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=recipe.from_logits))
    return model, recipe


def fit_a_few_steps(model, recipe, steps=3):
    x, y = load_fashion_mnist("test")
    n = steps * recipe.batch_size
    model.fit(recipe.inputs(x[:n]), y[:n], batch_size=recipe.batch_size, epochs=1, verbose=0)


@pytest.mark.parametrize("name", ["mnist_convnet", "transformer"])
def test_without_a_batchnorm_to_remove_the_level_rewrites_nothing_and_freezes_nothing(name, capsys):
    with pytest.warns(UserWarning, match="without an FN head"):
        model, recipe = o1_model(name)
    reference = recipe.build()
    assert model.less_bn_report.num_removed == 0 and model.less_bn_report.fn_heads == ()
    def kinds(m):
        return [type(layer).__name__ for layer in m.layers if not isinstance(layer, keras.layers.InputLayer)]

    assert kinds(model) == kinds(reference) and len(model.weights) == len(reference.weights)
    fit_a_few_steps(model, recipe)
    step = model.boost_step
    assert not step.stage("gradient_freeze").is_on() and not step.stage("gradient_centralization").is_on()
    assert "O1's gradient_freeze switched off: LessBN removed no BatchNormalization layer" in capsys.readouterr().out


@pytest.mark.parametrize("name, removed", [("demo", 5), ("timeseries", 1), ("xception", 4)])
def test_with_a_batchnorm_removed_the_level_keeps_its_fn_head_centralization_and_freezing(name, removed, capsys):
    model, recipe = o1_model(name)
    report = model.less_bn_report
    assert report.num_removed == removed and len(report.fn_heads) == 1
    fit_a_few_steps(model, recipe)
    step = model.boost_step
    assert step.stage("gradient_freeze").is_on() and step.stage("gradient_centralization").is_on()
    assert "switched off: LessBN removed no" not in capsys.readouterr().out


def test_a_regression_head_keeps_every_batchnorm_of_a_recipe_model():
    """The timeseries recipe with a Dense(1) regression output: LessBN does not apply."""
    keras.utils.set_random_seed(0)
    base = recipes.timeseries_fcn()
    regression = keras.layers.Dense(1)(base.layers[-2].output)
    with pytest.warns(UserWarning):
        model = BoostModel(base.inputs, regression, boost_level="O1")
    assert model.less_bn_report is None or model.less_bn_report.num_removed == 0
    assert sum(isinstance(layer, keras.layers.BatchNormalization) for layer in model.layers) == 3


def test_recipe_inputs_keep_every_image():
    images = np.arange(2 * 28 * 28, dtype=np.float32).reshape(2, 28, 28, 1) / (2 * 28 * 28)
    series, tokens = recipes.as_series(images), recipes.as_tokens(images)
    assert series.shape == (2, 28, 28) and np.array_equal(series[1, 3], images[1, 3, :, 0])
    assert tokens.shape == (2, 196) and tokens.dtype == np.int32 and 0 <= tokens.min() <= tokens.max() <= 255
    # a token is the mean of a 2x2 patch, in 256 grey levels
    assert tokens[0, 15] == round(255 * images[0, 2:4, 2:4, 0].mean())
