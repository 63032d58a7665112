"""keras_boost's warnings name the user's line, and the user's model, wherever Keras calls keras_boost from."""

import warnings

import keras
import numpy as np

import keras_boost


def _mlp():
    inputs = keras.Input((4,))
    return inputs, keras.layers.Dense(2)(keras.layers.Dense(8)(inputs))


def test_a_warning_at_construction_names_the_users_line_and_model():
    inputs, outputs = _mlp()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        line = _line_after()
        keras_boost.BoostModel(inputs, outputs, boost_level="O1")
    lessbn = [w for w in caught if "LessBN" in str(w.message)]
    assert lessbn, [str(w.message) for w in caught]
    assert all((w.filename, w.lineno) == (__file__, line) for w in lessbn), [(w.filename, w.lineno) for w in lessbn]
    assert "model 'BoostModel'" in str(lessbn[0].message)  # not Keras' internal 'functional_N'


def test_a_warning_in_compile_names_the_users_line():
    inputs, outputs = _mlp()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = keras_boost.BoostModel(inputs, outputs, boost_level="O1")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        line = _line_after()
        model.compile(optimizer=keras.optimizers.RMSprop(), loss="mse")
        model.fit(np.ones((8, 4), "float32"), np.ones((8, 2), "float32"), verbose=0)
    fused = [w for w in caught if "fused update is off" in str(w.message)]
    assert fused and all(w.filename == __file__ and w.lineno in (line, line + 1) for w in fused), \
        [(w.filename, w.lineno) for w in fused]


def _line_after():
    """The line number after the caller's line."""
    import sys

    return sys._getframe(1).f_lineno + 1
