"""BoostState: the Keras layer that holds every boost stage's variables.

BoostModel owns one; each stage creates its variables in it with `add_state`, in a fixed
order. It is kept out of Keras' layer tracking (so the model's weights equal a
`keras.Model`'s), yet saved and restored by `model.save`, `save_weights` (Keras' saving
walks the attributes), `tf.train.Checkpoint` (an explicit edge) and `BackupAndRestore`,
and broadcast with the other variables (`training_variables`).
"""

import keras
import numpy as np


@keras.saving.register_keras_serializable(package="keras_boost")
class BoostState(keras.layers.Layer):
    """A layer with no computation that holds the boost step's non-trainable state."""

    def __init__(self, **kwargs):
        kwargs.setdefault("name", "boost_state")
        super().__init__(trainable=False, **kwargs)
        self.built = True
        # Values read from a file before the stage that owns them was built (the model
        # was loaded before compile): applied when the stage creates the variable.
        object.__setattr__(self, "_pending", {})

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
        # An attribute, so that tf.train.Checkpoint finds it (Keras' own saving uses the name).
        setattr(self, attribute, variable)
        if attribute in self._pending:
            variable.assign(self._pending.pop(attribute))
        return variable

    def add_slots(self, name, variables):
        """One variable per variable of `variables`, its shape and dtype, zero, called `name/<index>`."""
        return [self.add_state(f"{name}/{index}", 0.0, v.dtype, shape=tuple(v.shape))
                for index, v in enumerate(variables)]

    def save_own_variables(self, store):
        """Saves each variable under its state name (files stay readable whatever was built)."""
        for variable in self.variables:
            store[variable.name] = variable

    def load_own_variables(self, store):
        """Loads the state saved by `save_own_variables`; an absent entry (a plain Keras file) keeps the value.

        Values for state not created yet are kept and applied when the stage creates it.
        """
        by_name = {v.name: v for v in self.variables}
        ordered = list(self.variables)
        for key in list(store.keys()):
            value = np.asarray(store[key])
            if key.isdigit():  # files written before the state was saved by name
                if int(key) < len(ordered):
                    ordered[int(key)].assign(value)
            elif key in by_name:
                by_name[key].assign(value)
            else:
                self._pending[key] = value

    def call(self, inputs):
        return inputs


def training_variables(model, optimizer="model", extra=()):
    """Every variable a worker must agree on, in one order: the model's, its boost state's, the optimizer's.

    The one list that the broadcast when `fit` starts, elastic training's state and the
    standalone step's broadcast all use. `optimizer`: "model" (the model's own, if compiled),
    None (none) or an optimizer; `extra`: more variables (a standalone step's own state).
    No variable appears twice.
    """
    if optimizer == "model":
        optimizer = getattr(model, "optimizer", None)
    state = getattr(model, "boost_state", None)
    candidates = list(model.variables) + (list(state.variables) if isinstance(state, BoostState) else [])
    candidates += list(optimizer.variables) if optimizer is not None else []
    candidates += list(extra)
    found, seen = [], set()
    for variable in candidates:
        if id(variable) not in seen:
            seen.add(id(variable))
            found.append(variable)
    return found
