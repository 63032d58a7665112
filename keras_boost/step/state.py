"""BoostState: the Keras layer that holds every boost stage's variables.

BoostModel owns one; each stage creates its variables in it with `add_state`, in a fixed
order. Being a tracked layer of the model, it is saved and restored by `model.save`,
`save_weights`, `tf.train.Checkpoint` and `BackupAndRestore`, and broadcast with the
other model variables.
"""

import keras


@keras.saving.register_keras_serializable(package="keras_boost")
class BoostState(keras.layers.Layer):
    """A layer with no computation that holds the boost step's non-trainable state."""

    def __init__(self, **kwargs):
        kwargs.setdefault("name", "boost_state")
        super().__init__(trainable=False, **kwargs)
        self.built = True

    def add_state(self, name, initial_value, dtype, shape=()):
        """Creates (or returns the existing) non-trainable variable called `name`."""
        attribute = name.replace("/", "_")
        existing = getattr(self, attribute, None)
        if existing is not None:
            return existing
        variable = self.add_weight(
            shape=shape,
            initializer=keras.initializers.Constant(initial_value),
            dtype=dtype,
            trainable=False,
            name=attribute,
        )
        # An attribute, so that tf.train.Checkpoint finds it (Keras' own saving uses the order).
        setattr(self, attribute, variable)
        return variable

    def call(self, inputs):
        return inputs
